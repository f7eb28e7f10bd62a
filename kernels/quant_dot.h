/* The inner loops of the weight-only quantized matrix-vector products, shared by quant.c (the
 * int8 / int4 linear layers) and decode.c (the fused decode step): one copy of the code that
 * turns codes into floats and multiplies them into the input rows, included by both.
 *
 * Layouts: minserve/quant/formats.py is the contract (checked on the Python side before any call):
 * - int8: codes int8 [out, in], scales float32 [out]: w = code * scale[row];
 * - int4: packed uint8 [out, in/2], column 2i in the low nibble, 2i+1 in the high one; scales and
 *   mins float32 [out, in/g]: w = q * scale + min per group of g (32, 64, 128) input features.
 *
 * Structure: OpenMP threads split the output rows in tiles of ROW_TILE; each tile is multiplied
 * into up to MAX_BATCH_PASS input rows per pass, so for batch 16 the tile comes from DRAM once and
 * from L1 the second time. Within a tile, rows go two at a time.
 *
 * int4 dequantization, AVX-512: a group has only 16 possible weights, min + k * scale. We build
 * those 16 floats in one register per group and look each code up with one vpermps
 * (_mm512_permutexvar_ps reads only the low 4 bits of each index, so the low nibble needs no mask).
 * That is one instruction per 16 weights whatever the batch; the other classic form,
 * y += scale * (q . x_g) + min * sum(x_g), needs a convert per 16 weights and an extra
 * multiply-add per group *per input row*, and batch 16 is compute-bound here already.
 * The interleaved nibbles (2i low, 2i+1 high) are undone on the x side, not per weight: x is
 * rearranged once per call (order_columns) so that each 32-column block holds its 16 even columns,
 * then its 16 odd ones, and the low and high codes of 16 bytes meet contiguous x.
 *
 * Without AVX-512: AVX2 (most x86 laptops) converts and scales the int4 codes instead of looking
 * them up; any other CPU or compiler gets plain loops. Same results up to the order of additions.
 */
#ifndef MINSERVE_QUANT_DOT_H
#define MINSERVE_QUANT_DOT_H
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* 16 floats: one AVX-512 register, or two AVX2 registers; unaligned loads are fine (aligned(4)). */
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

/* Input rows per pass over a tile: 2 x 8 accumulators + temporaries fill AVX-512's 32 registers.
 * AVX2 has 16: 2 x 4 accumulators (one ymm each, see qacc below) + two weight vectors and an input
 * (two ymm each) are 14. 4 also halves the code the switch in qmatmul instantiates (the portable
 * build compiles ~2x faster). */
#if defined(__AVX512F__)
#define MAX_BATCH_PASS 8
#else
#define MAX_BATCH_PASS 4
#endif
#define ROW_TILE 16           /* weight rows per OpenMP work item */
/* Software prefetch this far ahead in a row's codes. int4 (g32, one thread streaming from DRAM,
 * bench_quant_kernels.py): ~12.8 GB/s from 512 B on, into L1 (prefetcht0). int8 spends half the
 * time per byte, so it needs more bytes in flight: prefetcht0 at 512 B -> ~8 GB/s, 768-1024 B ->
 * ~11-12 GB/s, 1536 B -> ~9 GB/s (the early lines evict each other from L1); prefetcht2 (into
 * L2/L3, locality 1) 4 KB ahead -> 13.5-14.7 GB/s, and with two threads over a 135 MB matrix
 * 25-27.7 GB/s against 20-21 GB/s for prefetcht0 1 KB (int4 stays best as it is: 28 GB/s). */
#define PREFETCH_BYTES 1024
#define INT8_PREFETCH_BYTES 4096

/* A software prefetch ahead of the fused step's float32 / bf16 weight stream (decode.c, dot_block)
 * and its KV stream (decode_attention.h). On AMD (MS_PREFETCH_L2, which kernels/build.py defines
 * from the CPU's vendor) into L2 (prefetcht2): on the Zen 4 EPYC (AVX-512, 2026-12-06, two threads,
 * FusedDecoder.step_profile, medians of 9-11 steps, three alternating rounds) a float32 step's
 * products took 22-23 ms against 29-31 with prefetcht0 at 16 rows, 16.6 against 22-26 at 8, the
 * same at 1 row; bf16 18.6 against 20.2 at 16 rows and 10.6 against 14.9 at 8; the KV stream,
 * context 300, 11.8-12.3 against 13.1-13.7 ms of attention at 16 rows and 0.94-1.01 against
 * 1.53-1.61 at 1. An L1 prefetch holds one of the core's few miss buffers until its line comes,
 * and a burst of them stalls the loads the multiply-adds wait on. Elsewhere into L1 (prefetcht0),
 * the setting the Intel Xeon's figures in decode.c were measured with. */
#ifdef MS_PREFETCH_L2
#define PREFETCH_AHEAD(p) __builtin_prefetch((p), 0, 1)
#else
#define PREFETCH_AHEAD(p) __builtin_prefetch((p))
#endif

/* Sum of the 16 lanes as a tree of vector adds: a lane-by-lane loop would be a chain of 15
 * dependent additions per output row, which dominates once several inputs share a weight load. */
#if defined(__AVX512F__) || defined(__AVX2__)   /* immintrin.h is included above */
/* The same tree in register shuffles: GCC 12 lowers the unions below to a store and reloads (perf
 * annotate: decode attention's per-key sums went through the stack). Same additions, same order. */
static inline float hsum8(vf8 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                 /* b0 + b2, b1 + b3 */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));      /* (b0 + b2) + (b1 + b3) */
}
#else
static inline float hsum8(vf8 v) {
    union { vf8 whole; vf4 half[2]; } w = {v};        /* unions, not shuffles: any GCC or clang */
    vf4 b = w.half[0] + w.half[1];
    return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif
#if defined(__AVX512F__)
static inline float hsum(vf16 v) {
    return hsum8((vf8)_mm256_add_ps(_mm512_castps512_ps256((__m512)v),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), 1))));
}
#else
static inline float hsum(vf16 v) {
    union { vf16 whole; vf8 half[2]; } u = {v};
    return hsum8(u.half[0] + u.half[1]);
}
#endif

/* y = v * scale + bias[r] (or y += that): one rounding, written as fmaf, because left to
 * -ffp-contract=fast the compiler fused the multiply and the add in some of the per-batch-size
 * copies of the loops and not in others, so an int8 row with a bias got other last bits at 1, 3 or
 * 7 rows than at 16 (found by the batch-invariant mode's tests on a Qwen2 model with q/k/v biases). */
static inline void store_row(float *y, float v, float scale, const float *bias, int64_t r, int accumulate) {
    v = __builtin_fmaf(v, scale, bias ? bias[r] : 0.0f);
    if (accumulate) *y += v; else *y = v;
}

/* The two ways codes become floats, per instruction set. (GCC's generic vector conversions from
 * 8-bit lanes, __builtin_convertvector, compile to one scalar convert per lane in GCC 12, so each
 * path says what it wants.)
 *   int8x16_to_float(p):            16 int8 codes -> 16 floats (the caller scales the row's sum);
 *   group_levels(scale, min):       what a group's 4-bit codes decode against;
 *   dequant32(p, levels, &e, &o):   16 bytes -> the weights of 16 even and 16 odd columns. */
#if defined(__AVX512F__)
#define QUANT_ISA "avx512"
static inline vf16 int8x16_to_float(const int8_t *p) {
    return (vf16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
typedef __m512 levels_t;   /* a group's 16 possible weights, min + k * scale, k = 0..15 */
static inline levels_t group_levels(float scale, float min) {
    const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(k, _mm512_set1_ps(scale), _mm512_set1_ps(min));
}
static inline void dequant32(const uint8_t *p, levels_t t, vf16 *even, vf16 *odd) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *even = (vf16)_mm512_permutexvar_ps(q, t);              /* index = low 4 bits: the low nibble */
    *odd = (vf16)_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define QUANT_ISA "avx2"   /* most x86 laptops: no 16-entry lookup, so convert and scale */
typedef union { vf16 v; __m256 h[2]; } vf16_halves;
static inline vf16 int8x16_to_float(const int8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    vf16_halves u = {.h = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))}};
    return u.v;
}
typedef struct { __m256 scale, min; } levels_t;
static inline levels_t group_levels(float scale, float min) {
    return (levels_t){_mm256_set1_ps(scale), _mm256_set1_ps(min)};
}
static inline vf16 nibbles_to_float(__m128i q, levels_t t) {   /* 16 codes, one per byte */
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
    vf16_halves u = {.h = {_mm256_fmadd_ps(lo, t.scale, t.min), _mm256_fmadd_ps(hi, t.scale, t.min)}};
    return u.v;
}
static inline void dequant32(const uint8_t *p, levels_t t, vf16 *even, vf16 *odd) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
    *even = nibbles_to_float(_mm_and_si128(b, mask), t);
    *odd = nibbles_to_float(_mm_and_si128(_mm_srli_epi16(b, 4), mask), t);
}
#else
#define QUANT_ISA "portable"   /* plain loops; the compiler vectorizes what it can */
typedef union { float f[16]; vf16 v; } vf16_lanes;
static inline vf16 int8x16_to_float(const int8_t *p) {
    vf16_lanes u;
    for (int k = 0; k < 16; k++) u.f[k] = (float)p[k];
    return u.v;
}
typedef struct { float scale, min; } levels_t;
static inline levels_t group_levels(float scale, float min) { return (levels_t){scale, min}; }
static inline void dequant32(const uint8_t *p, levels_t t, vf16 *even, vf16 *odd) {
    vf16_lanes e, o;
    for (int k = 0; k < 16; k++) {
        e.f[k] = (float)(p[k] & 15) * t.scale + t.min;
        o.f[k] = (float)(p[k] >> 4) * t.scale + t.min;
    }
    *even = e.v, *odd = o.v;
}
#endif

/* Load a vector once and keep it in a register. Without this, GCC folds the load into each
 * multiply-add that uses it (a memory operand), so an input vector is loaded once per weight row
 * instead of once per pair of rows, and at batch 8-16 the load ports, not the FMAs, bound the loop
 * (measured in L2, one thread: int4 g32 28 -> 43 GMAC/s, int8 42 -> 48 GMAC/s at batch 16). */
#if defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) ((void)0)   /* AVX2 / portable: a vf16 spans several registers anyway */
#endif

/* The accumulator of one (weight row, input row) pair, and acc + w * x for 16 columns of each.
 * AVX-512: one vf16 register. AVX2 has 16 ymm registers, and GCC 12 kept the 2 x 4 vf16
 * accumulators (16 ymm halves, beside the weights and inputs) on the stack, so every multiply-add
 * went through memory (objdump of qmatmul: 170 FMAs with a stack operand); there a pair
 * accumulates in one 8-float vf8, both halves of the 16 columns added into it by explicit FMAs
 * (low half first), so 2 x 4 accumulators take 8 registers. The order of a row's additions
 * is the same for every batch size either way. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
typedef vf8 qacc;
static inline __attribute__((always_inline)) qacc qfma(qacc a, vf16 w, vf16 x) {
    vf16_halves wh = {.v = w}, xh = {.v = x};
    return (qacc)_mm256_fmadd_ps(wh.h[1], xh.h[1], _mm256_fmadd_ps(wh.h[0], xh.h[0], (__m256)a));
}
#define qacc_hsum hsum8
#else
typedef vf16 qacc;
#define qfma(a, w, x) ((a) + (w) * (x))
#define qacc_hsum hsum
#endif

/* Both row loops below share a shape: two weight rows at a time, so each x vector loaded feeds
 * two multiply-adds and batch 1 has two independent chains of adds (one chain would wait on the
 * FMA latency at every step). An odd last row pairs with itself and is stored once. A row's sum
 * is accumulated the same way whatever nb, its neighbours in the batch or the team size, so
 * results are batch-invariant and bit-identical across thread counts. */
static inline void store_pair(qacc acc[2][MAX_BATCH_PASS], float tail[2][MAX_BATCH_PASS],
                              const float scale[2], int64_t r, int64_t r1, const float *bias,
                              float *y, int64_t ldy, const int nb, int accumulate) {
    for (int rr = 0; rr < 2 && r + rr < r1; rr++)
        for (int b = 0; b < nb; b++)
            store_row(y + b * ldy + r + rr, qacc_hsum(acc[rr][b]) + tail[rr][b], scale[rr], bias,
                      r + rr, accumulate);
}

/* int8: y[b, r] = scale[r] * (codes[r, :] . x[b, :]) for rows [r0, r1) and nb inputs. */
static inline __attribute__((always_inline)) void
int8_rows(const int8_t *restrict codes, const float *restrict scales, const float *restrict bias,
          int64_t in, int64_t r0, int64_t r1, const float *restrict x, float *restrict y,
          int64_t ldy, const int nb, int accumulate) {
    for (int64_t r = r0; r < r1; r += 2) {
        const int8_t *w[2] = {codes + r * in, codes + (r + 1 < r1 ? r + 1 : r) * in};
        qacc acc[2][MAX_BATCH_PASS];
        float tail[2][MAX_BATCH_PASS] = {{0}};
        for (int b = 0; b < nb; b++) acc[0][b] = acc[1][b] = (qacc){0};
        int64_t i = 0;
        for (; i + 16 <= in; i += 16) {
            __builtin_prefetch(w[0] + i + INT8_PREFETCH_BYTES, 0, 1);
            __builtin_prefetch(w[1] + i + INT8_PREFETCH_BYTES, 0, 1);
            vf16 w0 = int8x16_to_float(w[0] + i), w1 = int8x16_to_float(w[1] + i);
            for (int b = 0; b < nb; b++) {
                vf16 xv = *(const vf16 *)(x + b * in + i);
                IN_REGISTER(xv);
                acc[0][b] = qfma(acc[0][b], w0, xv);
                acc[1][b] = qfma(acc[1][b], w1, xv);
            }
        }
        for (int rr = 0; rr < 2; rr++)   /* in % 16 last columns */
            for (int b = 0; b < nb; b++)
                for (int64_t j = i; j < in; j++) tail[rr][b] += (float)w[rr][j] * x[b * in + j];
        const float scale[2] = {scales[r], r + 1 < r1 ? scales[r + 1] : 0.f};
        store_pair(acc, tail, scale, r, r1, bias, y, ldy, nb, accumulate);
    }
}

/* int4: y[b, r] = W[r, :] . x[b, :] for rows [r0, r1) and nb inputs, x given as xs (each 32-column
 * block: 16 even columns, then 16 odd ones). in is a multiple of g; g (32, 64 or 128) is a
 * constant after inlining, so a group's blocks unroll and g32 pays no inner-loop overhead. */
static inline __attribute__((always_inline)) void
int4_rows(const uint8_t *restrict packed, const float *restrict scales, const float *restrict mins,
          const float *restrict bias, const int g, int64_t in, int64_t r0, int64_t r1,
          const float *restrict xs, float *restrict y, int64_t ldy, const int nb, int accumulate) {
    int64_t groups = in / g;
    for (int64_t r = r0; r < r1; r += 2) {
        int64_t rows[2] = {r, r + 1 < r1 ? r + 1 : r};
        qacc acc[2][MAX_BATCH_PASS];
        for (int b = 0; b < nb; b++) acc[0][b] = acc[1][b] = (qacc){0};
        for (int64_t k = 0; k < groups; k++) {
            levels_t t[2];
            const uint8_t *p[2];
            for (int rr = 0; rr < 2; rr++) {
                t[rr] = group_levels(scales[rows[rr] * groups + k], mins[rows[rr] * groups + k]);
                p[rr] = packed + rows[rr] * (in / 2) + k * (g / 2);
                __builtin_prefetch(p[rr] + PREFETCH_BYTES);
            }
            for (int j = 0; j < g; j += 32) {
                vf16 we[2], wo[2];
                dequant32(p[0] + j / 2, t[0], &we[0], &wo[0]);
                dequant32(p[1] + j / 2, t[1], &we[1], &wo[1]);
                for (int b = 0; b < nb; b++) {
                    const float *xb = xs + b * in + k * g + j;
                    vf16 xe = *(const vf16 *)xb, xo = *(const vf16 *)(xb + 16);
                    IN_REGISTER(xe);
                    IN_REGISTER(xo);
                    for (int rr = 0; rr < 2; rr++) {   /* two FMAs: fewest operations at batch 16 */
                        acc[rr][b] = qfma(acc[rr][b], we[rr], xe);
                        acc[rr][b] = qfma(acc[rr][b], wo[rr], xo);
                    }
                }
            }
        }
        float no_tail[2][MAX_BATCH_PASS] = {{0}}, unit[2] = {1.f, 1.f};
        store_pair(acc, no_tail, unit, r, r1, bias, y, ldy, nb, accumulate);
    }
}

typedef struct {             /* one quantized weight, either format */
    int bits;                /* 8 or 4 */
    const void *codes;
    const float *scales, *mins, *bias;
    int64_t group, in, out;
    const void *tiles;       /* with int8 activations: the weight also in the integer loops'
                                tile order (quant_a8_tiles.h), or NULL */
} QWeight;

/* Rows [r0, r1) times nb (a constant after inlining) inputs starting at x / y. */
static inline __attribute__((always_inline)) void
tile_pass(const QWeight *w, int64_t r0, int64_t r1, const float *x, float *y, const int nb, int acc) {
    if (w->bits == 8)
        int8_rows(w->codes, w->scales, w->bias, w->in, r0, r1, x, y, w->out, nb, acc);
    else if (w->group == 32)
        int4_rows(w->codes, w->scales, w->mins, w->bias, 32, w->in, r0, r1, x, y, w->out, nb, acc);
    else if (w->group == 64)
        int4_rows(w->codes, w->scales, w->mins, w->bias, 64, w->in, r0, r1, x, y, w->out, nb, acc);
    else
        int4_rows(w->codes, w->scales, w->mins, w->bias, 128, w->in, r0, r1, x, y, w->out, nb, acc);
}

/* y[B, out] = x[B, in] @ W^T (+ bias), or y += that when accumulate. Returns the team size.
 * (unused: files that include this header for its vector helpers only) */
static __attribute__((unused)) int64_t qmatmul(const QWeight *w, const float *x, float *y, int64_t B, int accumulate,
                       int nthreads) {
    int64_t tiles = (w->out + ROW_TILE - 1) / ROW_TILE, team = 1;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp master
        team = omp_get_num_threads();
        /* static: each thread streams one contiguous share of the rows, which the hardware
         * prefetcher follows; schedule(dynamic, 1) interleaves the tiles of the two threads and
         * streamed 14-16 GB/s against 20-27 GB/s static (int8 / int4 from DRAM, same C loop). */
        #pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++) {
            int64_t r0 = t * ROW_TILE, r1 = r0 + ROW_TILE < w->out ? r0 + ROW_TILE : w->out;
            for (int64_t b = 0; b < B; b += MAX_BATCH_PASS) {
                int64_t nb = B - b < MAX_BATCH_PASS ? B - b : MAX_BATCH_PASS;
                const float *xb = x + b * w->in;
                float *yb = y + b * w->out;
                switch (nb) {   /* a constant nb per case: the loop over inputs unrolls into registers */
#define CASE(n) case n: tile_pass(w, r0, r1, xb, yb, n, accumulate); break;
                CASE(1) CASE(2) CASE(3) CASE(4)
#if MAX_BATCH_PASS == 8
                CASE(5) CASE(6) CASE(7) CASE(8)
#endif
#undef CASE
                }
            }
        }
    }
    return team;
}

/* x [n / 32 blocks of 32 columns] -> xs with each block's 16 even columns first, then its 16 odd
 * ones: the column order in which dequant32 produces int4 weights. n: a multiple of 32. */
static inline void order_columns(const float *x, float *xs, int64_t n) {
    for (int64_t i = 0; i < n; i += 32)
        for (int k = 0; k < 16; k++) {
            xs[i + k] = x[i + 2 * k];
            xs[i + 16 + k] = x[i + 2 * k + 1];
        }
}

#endif /* MINSERVE_QUANT_DOT_H */
