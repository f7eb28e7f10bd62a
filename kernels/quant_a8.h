/* Quantized weights times int8 activations (W4A8, W8A8): integer dot products with VNNI.
 *
 * Why: at batch 16 the weight-only loops of quant_dot.h are arithmetic-bound, not bandwidth-bound:
 * every int4 weight becomes a float and meets 16 float inputs in 16 multiply-adds (an AVX-512 FMA
 * does 16 of them). AVX-512 VNNI's vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and
 * adds each 4 products into one of 16 int32 lanes: 64 multiply-adds per instruction. To use it the
 * inputs must be bytes too, so they are quantized on the fly, per row and per block of 32 columns
 * (the scheme llama.cpp pairs with its Q4_1 weights, Q8_1): d = max|x| / 127, a = round(x / d).
 * That is a second, small rounding error on top of the weights' own; minserve/quant/activations.py
 * is the torch reference these loops are tested against, and `minserve eval` measures its cost.
 *
 *   int4:  y[b, r] = sum_k ( scale[r, g(k)] d[b, k] (q[r, k] . a[b, k]) + min[r, g(k)] xsum[b, k] )
 *   int8:  y[b, r] = scale[r] sum_k d[b, k] (codes[r, k] . a[b, k])
 * with k over 32-column blocks and xsum the block's float sum (the min term stays exact).
 *
 * Layout trick: a vpdpbusd lane must hold 4 bytes of ONE output row, so that a row's whole block
 * ends up in one int32 lane and needs no horizontal sum. Weights are stored row after row
 * (formats.py), so a tile of 16 rows is transposed in registers as it is loaded (transpose16):
 * 16 loads and 8 unpacks per 16 rows x 16 bytes, shared by every input row of the pass. Each
 * input then costs 8 vpdpbusd per 16 x 32 weights, its 4-byte activation groups broadcast from
 * memory. The activations are stored in the order the weight bytes arrive: for int4, each 8
 * columns as their 4 even ones (the low nibbles) then their 4 odd ones (the high nibbles); for
 * int8, in column order. vpdpbusd's first operand is unsigned: int4 codes are (0..15); int8 codes
 * are made so by adding 128 as they are loaded, and sum_k 128 d_k sum(a_k), one number per
 * input row, is subtracted at the end.
 *
 * Without AVX-512 VNNI, AVX2 builds use vpmaddubsw (see the AVX2 section below) and any other
 * build plain loops: identical integers, the float sums in another order (a8_isa() says which).
 */
#ifndef MINSERVE_QUANT_A8_H
#define MINSERVE_QUANT_A8_H
#include <math.h>
#include <stdlib.h>   /* aligned_alloc, free: the packed tile (quant_a8_packed.h) */
#include <string.h>

#include "quant_dot.h"   /* QWeight, ROW_TILE (16: one vector of rows), omp */

#define A8_BLOCK 32       /* columns per activation scale */
#define A8_BATCH_PASS 8   /* input rows per pass over a tile: 8 accumulators + 8 weight vectors */

typedef struct {          /* x [B, in] quantized for one weight format, in scratch the caller owns */
    int8_t *codes;        /* [B, in], in the format's order (see the top of this file) */
    float *d, *xsum;      /* [B, in / 32]: each block's scale and its float sum */
    float *shift;         /* [B]: sum over blocks of 128 d sum(codes), for int8 weights */
} Activations8;

/* Which column of a block its i-th activation code holds: int4 reads each 8 columns as their 4
 * even ones (low nibbles), then their 4 odd ones (high nibbles); int8 reads them in order. */
static inline int64_t a8_source_column(int int4_order, int i) {
    return int4_order ? 8 * (i / 8) + 2 * (i % 4) + (i % 8 >= 4) : i;
}

/* One block of 32: its scale d (returned), its sum, and its codes round(x / d) (half to even, as
 * torch.round: the default rounding mode), in the order int4_order says. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline float quantize_block(const float *xb, int int4_order, int8_t *out, float *sum_out) {
    __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    float d = amax / 127.0f;
    __m512 div = _mm512_set1_ps(d > 0.f ? d : 1.0f);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    __m512i qlo = _mm512_cvtps_epi32(_mm512_div_ps(lo, div)), qhi = _mm512_cvtps_epi32(_mm512_div_ps(hi, div));
    qlo = _mm512_max_epi32(_mm512_min_epi32(qlo, top), bottom);
    qhi = _mm512_max_epi32(_mm512_min_epi32(qhi, top), bottom);
    __m256i codes = _mm256_set_m128i(_mm512_cvtepi32_epi8(qhi), _mm512_cvtepi32_epi8(qlo));
    if (int4_order)   /* within each 8 columns: the 4 even ones, then the 4 odd ones */
        codes = _mm256_shuffle_epi8(codes, _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                                            0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    _mm256_storeu_si256((__m256i *)out, codes);
    *sum_out = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    return d;
}
#elif defined(__AVX2__)
static inline float quantize_block(const float *xb, int int4_order, int8_t *out, float *sum_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    float d = amax / 127.0f;
    const __m256 div = _mm256_set1_ps(d > 0.f ? d : 1.0f);
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    __m256i q[4];
    for (int i = 0; i < 4; i++)   /* cvtps rounds half to even (the default mode), as nearbyintf */
        q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_div_ps(v[i], div)), top), bottom);
    /* The packs work within 128-bit lanes: dwords come out as columns 0-3, 8-11, 16-19, 24-27,
     * 4-7, 12-15, 20-23, 28-31; one permute puts them back in order. */
    __m256i codes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    codes = _mm256_permutevar8x32_epi32(codes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (int4_order)   /* within each 8 columns: the 4 even ones, then the 4 odd ones */
        codes = _mm256_shuffle_epi8(codes, _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                                            0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    _mm256_storeu_si256((__m256i *)out, codes);
    __m256 s8 = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    *sum_out = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
    return d;
}
#else
static inline float quantize_block(const float *xb, int int4_order, int8_t *out, float *sum_out) {
    float amax = 0.f, sum = 0.f;
    for (int i = 0; i < A8_BLOCK; i++) {
        amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        sum += xb[i];
    }
    float d = amax / 127.0f, div = d > 0.f ? d : 1.0f;
    for (int i = 0; i < A8_BLOCK; i++) {
        float q = nearbyintf(xb[a8_source_column(int4_order, i)] / div);
        out[i] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
    }
    *sum_out = sum;
    return d;
}
#endif

/* Quantize x [B, in] (in % 32 == 0) block by block into act, and for int8 weights each row's
 * shift (see int8_a8_tile). Rows split over the team: prefill quantizes hundreds of them. */
static void quantize_a8(const float *x, int64_t B, int64_t in, int int4_order, Activations8 act,
                        int nthreads) {
    int64_t blocks = in / A8_BLOCK;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (B * in >= 16384)
    for (int64_t b = 0; b < B; b++) {
        float shift = 0.f;
        for (int64_t k = 0; k < blocks; k++) {
            int8_t *codes = act.codes + b * in + k * A8_BLOCK;
            float d = quantize_block(x + b * in + k * A8_BLOCK, int4_order, codes,
                                     act.xsum + b * blocks + k);
            int32_t code_sum = 0;
            for (int i = 0; i < A8_BLOCK; i++) code_sum += codes[i];
            act.d[b * blocks + k] = d;
            shift += 128.0f * d * (float)code_sum;
        }
        act.shift[b] = shift;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define A8_ISA "avx512-vnni"

/* 16 bytes at off of each of 16 rows -> T[j] with dword j of row rr in lane rr (j = 0..3). Z[a]
 * holds rows a, 4 + a, 8 + a, 12 + a in its four 128-bit lanes; a 4 x 4 dword transpose inside
 * each 128-bit lane then puts row 4i + a in lane 4i + a: the identity, no lane order to undo. */
static inline void transpose16(const uint8_t *const rows[ROW_TILE], int64_t off, __m512i T[4]) {
    __m512i Z[4];
    for (int a = 0; a < 4; a++) {   /* masked broadcast loads: a load and a blend each, no shuffle */
        __m512i z = _mm512_maskz_broadcast_i32x4(0x000F, _mm_loadu_si128((const __m128i *)(rows[a] + off)));
        z = _mm512_mask_broadcast_i32x4(z, 0x00F0, _mm_loadu_si128((const __m128i *)(rows[4 + a] + off)));
        z = _mm512_mask_broadcast_i32x4(z, 0x0F00, _mm_loadu_si128((const __m128i *)(rows[8 + a] + off)));
        Z[a] = _mm512_mask_broadcast_i32x4(z, 0xF000, _mm_loadu_si128((const __m128i *)(rows[12 + a] + off)));
    }
    __m512i t0 = _mm512_unpacklo_epi32(Z[0], Z[1]), t1 = _mm512_unpackhi_epi32(Z[0], Z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(Z[2], Z[3]), t3 = _mm512_unpackhi_epi32(Z[2], Z[3]);
    T[0] = _mm512_unpacklo_epi64(t0, t2);
    T[1] = _mm512_unpackhi_epi64(t0, t2);
    T[2] = _mm512_unpacklo_epi64(t1, t3);
    T[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* 4 activation bytes into every lane: written as a plain load, so that the compiler folds it
 * into vpdpbusd as a broadcast memory operand ({1to16}) instead of a separate instruction. */
typedef int32_t unaligned_i32 __attribute__((may_alias, aligned(1)));
static inline __m512i bcast4(const int8_t *p) { return _mm512_set1_epi32(*(const unaligned_i32 *)p); }

/* Finish a tile: out[b] holds rows r0 .. r0 + 15 of input b (lanes past r1 are not stored). */
static inline void store_tile(const __m512 *out, const float *bias, int64_t r0, int64_t r1, float *y,
                              int64_t ldy, const int nb, int accumulate) {
    __mmask16 mask = r1 - r0 >= 16 ? 0xFFFF : (__mmask16)((1u << (r1 - r0)) - 1);
    __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + r0) : _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        float *yb = y + b * ldy + r0;
        __m512 v = _mm512_add_ps(out[b], bv);
        if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, yb));
        _mm512_mask_storeu_ps(yb, mask, v);
    }
}

/* The hardware prefetcher follows one stream per row poorly when 16 rows are read 16 or 32 bytes
 * at a time, so each block of a tile also prefetches its share of the tile A8_PREFETCH_TILES
 * ahead: base..base + bytes, cut in blocks pieces. */
#define A8_PREFETCH_TILES 2
static inline void prefetch_share(const uint8_t *tile, int64_t tile_bytes, int64_t k, int64_t blocks) {
    const uint8_t *ahead = tile + A8_PREFETCH_TILES * tile_bytes;
    int64_t lo = k * tile_bytes / blocks, hi = (k + 1) * tile_bytes / blocks;
    for (int64_t off = lo & ~(int64_t)63; off < hi; off += 64) __builtin_prefetch(ahead + off, 0, 3);
}

static inline void tile_rows(const uint8_t *base, int64_t stride, int64_t r0, int64_t r1,
                             const uint8_t *rows[ROW_TILE], int64_t row_ids[ROW_TILE]) {
    for (int rr = 0; rr < ROW_TILE; rr++) {   /* rows past r1 repeat the last one, never stored */
        row_ids[rr] = r0 + rr < r1 ? r0 + rr : r1 - 1;
        rows[rr] = base + row_ids[rr] * stride;
    }
}

/* out[c] = column c0 + c of a [rows, stride] float matrix, over 16 rows (lane rr: row rows[rr]),
 * for c < n <= 16: a 16 x 16 transpose in registers (unpack, then 4 x 4 blocks within 128-bit lanes,
 * then 4 x 4 across them). Per group, the int4 loop needs its 16 rows' scales as one vector, and
 * they lie a row apart; a vector gather per group was slower than this transpose done once per
 * 16 groups. */
static inline void columns16(const float *m, int64_t stride, const int64_t rows[ROW_TILE], int64_t c0,
                             int n, __m512 out[16]) {
    __mmask16 mask = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
    __m512 r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_maskz_loadu_ps(mask, m + rows[i] * stride + c0);
    for (int q = 0; q < 16; q += 4) {   /* u[q + e]: rows q..q+3, element e of each 128-bit lane */
        t[q] = _mm512_unpacklo_ps(r[q], r[q + 1]);
        t[q + 1] = _mm512_unpackhi_ps(r[q], r[q + 1]);
        t[q + 2] = _mm512_unpacklo_ps(r[q + 2], r[q + 3]);
        t[q + 3] = _mm512_unpackhi_ps(r[q + 2], r[q + 3]);
        u[q] = _mm512_shuffle_ps(t[q], t[q + 2], 0x44);
        u[q + 1] = _mm512_shuffle_ps(t[q], t[q + 2], 0xEE);
        u[q + 2] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0x44);
        u[q + 3] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
    }
    for (int e = 0; e < 4; e++) {       /* column 4L + e: lane L of u[e], u[4 + e], u[8 + e], u[12 + e] */
        __m512 p0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x44), p1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xEE);
        __m512 p2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x44), p3 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xEE);
        out[e] = _mm512_shuffle_f32x4(p0, p2, 0x88);
        out[4 + e] = _mm512_shuffle_f32x4(p0, p2, 0xDD);
        out[8 + e] = _mm512_shuffle_f32x4(p1, p3, 0x88);
        out[12 + e] = _mm512_shuffle_f32x4(p1, p3, 0xDD);
    }
}

/* int4 (any group size, a multiple of 32) times nb quantized inputs, rows [r0, r1). Groups go 16
 * at a time: their 16 rows' scales and mins are transposed into vectors once (columns16), kept in
 * a small buffer, and every block of those groups reads its pair from there. */
static inline __attribute__((always_inline)) void
int4_a8_tile(const QWeight *w, int64_t r0, int64_t r1, Activations8 act, float *y, int64_t ldy,
             const int nb, int accumulate) {
    const int64_t in = w->in, groups = in / w->group, blocks = in / A8_BLOCK, per_group = w->group / A8_BLOCK;
    const uint8_t *rows[ROW_TILE];
    int64_t row_ids[ROW_TILE];
    tile_rows(w->codes, in / 2, r0, r1, rows, row_ids);
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 out[A8_BATCH_PASS], scale[16], min[16];
    for (int b = 0; b < nb; b++) out[b] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        int ng = groups - g0 < 16 ? (int)(groups - g0) : 16;
        columns16(w->scales, groups, row_ids, g0, ng, scale);
        columns16(w->mins, groups, row_ids, g0, ng, min);
        for (int64_t k = g0 * per_group; k < (g0 + ng) * per_group; k++) {
            const __m512 s = scale[k / per_group - g0], m = min[k / per_group - g0];
            __m512i T[4], lo[4], hi[4];
            prefetch_share(rows[0], ROW_TILE * (in / 2), k, blocks);
            transpose16(rows, k * (A8_BLOCK / 2), T);
            for (int j = 0; j < 4; j++) {
                lo[j] = _mm512_and_si512(T[j], nibble);
                hi[j] = _mm512_and_si512(_mm512_srli_epi16(T[j], 4), nibble);
            }
            for (int b = 0; b < nb; b++) {
                const int8_t *a = act.codes + b * in + k * A8_BLOCK;
                __m512i dot = _mm512_setzero_si512();
                for (int j = 0; j < 4; j++) {
                    dot = _mm512_dpbusd_epi32(dot, lo[j], bcast4(a + 8 * j));
                    dot = _mm512_dpbusd_epi32(dot, hi[j], bcast4(a + 8 * j + 4));
                }
                __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(act.d[b * blocks + k]));
                out[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, out[b]);
                out[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(act.xsum[b * blocks + k]), out[b]);
            }
        }
    }
    store_tile(out, w->bias, r0, r1, y, ldy, nb, accumulate);
}

/* int8 (one scale per row) times nb quantized inputs, rows [r0, r1). */
static inline __attribute__((always_inline)) void
int8_a8_tile(const QWeight *w, int64_t r0, int64_t r1, Activations8 act, float *y, int64_t ldy,
             const int nb, int accumulate) {
    const int64_t in = w->in, blocks = in / A8_BLOCK;
    const uint8_t *rows[ROW_TILE];
    int64_t row_ids[ROW_TILE];
    tile_rows(w->codes, in, r0, r1, rows, row_ids);
    const __m512i offset = _mm512_set1_epi8((char)0x80);   /* code + 128: flip the sign bit */
    __m512 out[A8_BATCH_PASS];
    for (int b = 0; b < nb; b++) out[b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        __m512i T[8];
        prefetch_share(rows[0], ROW_TILE * in, k, blocks);
        transpose16(rows, k * A8_BLOCK, T);
        transpose16(rows, k * A8_BLOCK + 16, T + 4);
        for (int j = 0; j < 8; j++) T[j] = _mm512_xor_si512(T[j], offset);
        for (int b = 0; b < nb; b++) {
            const int8_t *a = act.codes + b * in + k * A8_BLOCK;
            __m512i dot = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) dot = _mm512_dpbusd_epi32(dot, T[j], bcast4(a + 4 * j));
            out[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(act.d[b * blocks + k]), out[b]);
        }
    }
    __mmask16 mask = r1 - r0 >= 16 ? 0xFFFF : (__mmask16)((1u << (r1 - r0)) - 1);
    __m512 scale = _mm512_maskz_loadu_ps(mask, w->scales + r0);
    for (int b = 0; b < nb; b++)
        out[b] = _mm512_mul_ps(_mm512_sub_ps(out[b], _mm512_set1_ps(act.shift[b])), scale);
    store_tile(out, w->bias, r0, r1, y, ldy, nb, accumulate);
}

#define A8_PACKED   /* prefill sizes: each tile packed once per call, the inputs interleaved */
#include "quant_a8_packed.h"
#include "quant_a8_tiles.h"   /* tiles laid out at load: every size reads them as they lie */

#elif defined(__AVX2__) && defined(__FMA__)
#define A8_ISA "avx2"
/* AVX2 has no vpdpbusd. Its nearest, vpmaddubsw, multiplies 32 unsigned bytes by 32 signed ones
 * and adds each pair into a saturating int16; vpmaddwd by ones then adds the int16 pairs into int32.
 * The lane layout is VNNI's at half the width: a lane holds 4 bytes of one weight row, 8 rows a
 * vector (transpose8), so a row's block ends up in one int32 lane with no horizontal sum.
 * int4: a code (0..15) times an activation (-127..127), two to a pair, is at most 3810 in magnitude,
 * so the 8 pairs a lane gets per block of 32 columns add up in int16 without overflow (30480 <
 * 32767): one vpmaddwd per block instead of one per 4 columns. int8: codes and activations are both
 * signed; vpmaddubsw takes |a| as the unsigned side and the code with a's sign as the signed one
 * (a pair is then at most 2 * 127 * 127 = 32258: each pair widens to int32 at once).
 * Prefill has hundreds of inputs per weight row: the 8 rows of a block are unpacked once and meet
 * up to A8_INPUT_CHUNK inputs, whose partial sums wait in a small stack buffer. */
#define A8_RUNTIME_BATCH   /* qmatmul_a8 hands the tiles every input at once */
/* Inputs per pass over 8 rows (their partial sums live on the stack: 8 KiB): the more inputs meet
 * a block's unpacked weights, the less the unpacking costs. Scratch builds of this file at each
 * size, called alternately (1024 x 576 -> 1536 on the AVX2 EPYC, 2 threads, GFLOP/s; oneDNN's fp32
 * product 70.0-71.7 in the same runs): 16 inputs 70.0, 32 72.6-74.4, 64 76.9-77.8, 128 76.9-78.8,
 * 256 78.4-79.3, 512 78.4. */
#define A8_INPUT_CHUNK 256

typedef int32_t unaligned_i32 __attribute__((may_alias, aligned(1)));
static inline __m256i bcast4(const int8_t *p) { return _mm256_set1_epi32(*(const unaligned_i32 *)p); }

/* 16 bytes at off of each of 8 rows -> T[j] with dword j of row rr in lane rr (j = 0..3). Z[a]
 * holds rows a and 4 + a in its two 128-bit lanes; a 4 x 4 dword transpose inside each lane
 * then puts row 4i + a in lane 4i + a. */
static inline void transpose8(const uint8_t *const rows[8], int64_t off, __m256i T[4]) {
    __m256i Z[4];
    for (int a = 0; a < 4; a++)
        Z[a] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rows[a] + off))),
                                       _mm_loadu_si128((const __m128i *)(rows[4 + a] + off)), 1);
    __m256i t0 = _mm256_unpacklo_epi32(Z[0], Z[1]), t1 = _mm256_unpackhi_epi32(Z[0], Z[1]);
    __m256i t2 = _mm256_unpacklo_epi32(Z[2], Z[3]), t3 = _mm256_unpackhi_epi32(Z[2], Z[3]);
    T[0] = _mm256_unpacklo_epi64(t0, t2);
    T[1] = _mm256_unpackhi_epi64(t0, t2);
    T[2] = _mm256_unpacklo_epi64(t1, t3);
    T[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* Column c of a [rows, stride] float matrix over 8 rows: the rows' scales (or mins) of one group. */
static inline __m256 column8(const float *m, int64_t stride, const int64_t ids[8], int64_t c) {
    return _mm256_setr_ps(m[ids[0] * stride + c], m[ids[1] * stride + c], m[ids[2] * stride + c],
                          m[ids[3] * stride + c], m[ids[4] * stride + c], m[ids[5] * stride + c],
                          m[ids[6] * stride + c], m[ids[7] * stride + c]);
}

/* acc[b] (8 rows) for inputs b0 .. b0 + nb - 1 of an int4 weight. */
static void int4_a8_rows8(const QWeight *w, const uint8_t *const rows[8], const int64_t ids[8],
                          Activations8 act, int64_t b0, int64_t nb, __m256 *acc) {
    const int64_t in = w->in, groups = in / w->group, blocks = in / A8_BLOCK, per_group = w->group / A8_BLOCK;
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 s = _mm256_setzero_ps(), m = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        if (k % per_group == 0) {
            s = column8(w->scales, groups, ids, k / per_group);
            m = column8(w->mins, groups, ids, k / per_group);
        }
        __m256i T[4], lo[4], hi[4];
        transpose8(rows, k * (A8_BLOCK / 2), T);
        for (int j = 0; j < 4; j++) {
            lo[j] = _mm256_and_si256(T[j], nibble);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(T[j], 4), nibble);
        }
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *a = act.codes + (b0 + b) * in + k * A8_BLOCK;
            __m256i pairs = _mm256_maddubs_epi16(lo[0], bcast4(a));
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi[0], bcast4(a + 4)));
            for (int j = 1; j < 4; j++) {
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo[j], bcast4(a + 8 * j)));
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi[j], bcast4(a + 8 * j + 4)));
            }
            __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            int64_t blk = (b0 + b) * blocks + k;
            __m256 v = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(act.d[blk])), acc[b]);
            acc[b] = _mm256_fmadd_ps(m, _mm256_set1_ps(act.xsum[blk]), v);
        }
    }
}

/* acc[b] (8 rows) for inputs b0 .. b0 + nb - 1 of an int8 weight, scaled by the rows' scales. */
static void int8_a8_rows8(const QWeight *w, const uint8_t *const rows[8], const int64_t ids[8],
                          Activations8 act, int64_t b0, int64_t nb, __m256 *acc) {
    const int64_t in = w->in, blocks = in / A8_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t k = 0; k < blocks; k++) {
        __m256i T[8];
        transpose8(rows, k * A8_BLOCK, T);
        transpose8(rows, k * A8_BLOCK + 16, T + 4);
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *a = act.codes + (b0 + b) * in + k * A8_BLOCK;
            __m256i dot = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                __m256i av = bcast4(a + 4 * j);
                __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(av), _mm256_sign_epi8(T[j], av));
                dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
            }
            acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(act.d[(b0 + b) * blocks + k]), acc[b]);
        }
    }
    const __m256 scale = column8(w->scales, 1, ids, 0);
    for (int64_t b = 0; b < nb; b++) acc[b] = _mm256_mul_ps(acc[b], scale);
}

/* Rows [r0, r1) (at most ROW_TILE) for all nb inputs: 8 rows and A8_INPUT_CHUNK inputs at a time. */
static void a8_tile(const QWeight *w, int64_t r0, int64_t r1, Activations8 act, float *y, int64_t ldy,
                    int64_t nb, int accumulate) {
    const int64_t stride = w->bits == 4 ? w->in / 2 : w->in;
    __m256 acc[A8_INPUT_CHUNK];
    for (int64_t h = r0; h < r1; h += 8) {
        const int n = r1 - h < 8 ? (int)(r1 - h) : 8;
        const uint8_t *rows[8];
        int64_t ids[8];
        for (int rr = 0; rr < 8; rr++) {   /* rows past r1 repeat the last one, never stored */
            ids[rr] = rr < n ? h + rr : h + n - 1;
            rows[rr] = (const uint8_t *)w->codes + ids[rr] * stride;
        }
        for (int64_t b0 = 0; b0 < nb; b0 += A8_INPUT_CHUNK) {
            int64_t cnt = nb - b0 < A8_INPUT_CHUNK ? nb - b0 : A8_INPUT_CHUNK;
            for (int64_t b = 0; b < cnt; b++) acc[b] = _mm256_setzero_ps();
            if (w->bits == 4) int4_a8_rows8(w, rows, ids, act, b0, cnt, acc);
            else int8_a8_rows8(w, rows, ids, act, b0, cnt, acc);
            for (int64_t b = 0; b < cnt; b++) {
                float lanes[8];
                _mm256_storeu_ps(lanes, acc[b]);
                for (int rr = 0; rr < n; rr++)
                    store_row(y + (b0 + b) * ldy + h + rr, lanes[rr], 1.0f, w->bias, h + rr, accumulate);
            }
        }
    }
}

#else
#define A8_ISA "portable"

/* The same integers as the VNNI loops, one row at a time. */
static inline __attribute__((always_inline)) void
int4_a8_tile(const QWeight *w, int64_t r0, int64_t r1, Activations8 act, float *y, int64_t ldy,
             const int nb, int accumulate) {
    const int64_t in = w->in, groups = in / w->group, blocks = in / A8_BLOCK, per_group = w->group / A8_BLOCK;
    for (int64_t r = r0; r < r1; r++)
        for (int b = 0; b < nb; b++) {
            float acc = 0.f;
            for (int64_t k = 0; k < blocks; k++) {
                const uint8_t *p = (const uint8_t *)w->codes + r * (in / 2) + k * (A8_BLOCK / 2);
                const int8_t *a = act.codes + b * in + k * A8_BLOCK;
                int32_t dot = 0;
                for (int j = 0; j < 4; j++)
                    for (int e = 0; e < 4; e++) {
                        dot += (p[4 * j + e] & 15) * a[8 * j + e];
                        dot += (p[4 * j + e] >> 4) * a[8 * j + 4 + e];
                    }
                int64_t g = r * groups + k / per_group, blk = b * blocks + k;
                acc += w->scales[g] * act.d[blk] * (float)dot + w->mins[g] * act.xsum[blk];
            }
            store_row(y + b * ldy + r, acc, 1.0f, w->bias, r, accumulate);
        }
}

static inline __attribute__((always_inline)) void
int8_a8_tile(const QWeight *w, int64_t r0, int64_t r1, Activations8 act, float *y, int64_t ldy,
             const int nb, int accumulate) {
    const int64_t in = w->in, blocks = in / A8_BLOCK;
    for (int64_t r = r0; r < r1; r++)
        for (int b = 0; b < nb; b++) {
            float acc = 0.f;
            for (int64_t k = 0; k < blocks; k++) {
                const int8_t *c = (const int8_t *)w->codes + r * in + k * A8_BLOCK;
                const int8_t *a = act.codes + b * in + k * A8_BLOCK;
                int32_t dot = 0;
                for (int i = 0; i < A8_BLOCK; i++) dot += c[i] * a[i];
                acc += act.d[b * blocks + k] * (float)dot;
            }
            store_row(y + b * ldy + r, acc, w->scales[r], w->bias, r, accumulate);
        }
}
#endif

/* y[B, out] (+)= x[B, in] @ W^T (+ bias) with x quantized to int8 blocks; W int8 or int4 with
 * in % 32 == 0 (the caller checks). act: scratch for B * in codes and 2 * B * in / 32 floats.
 * Returns the team size. */
static int64_t qmatmul_a8(const QWeight *w, const float *x, Activations8 act, float *y, int64_t B,
                          int accumulate, int nthreads) {
    quantize_a8(x, B, w->in, w->bits == 4, act, nthreads);
    int64_t tiles = (w->out + ROW_TILE - 1) / ROW_TILE, team = 1;
#ifdef A8_PACKED   /* the inputs interleaved for the packed tiles (quant_a8_packed.h, quant_a8_tiles.h) */
    const int tiled = w->tiles != NULL;
    void *passes_buf = B >= A8_PACKED_MIN_ROWS || tiled
                       ? aligned_alloc(64, (a8_passes_bytes(B, w->in) + 63) / 64 * 64) : NULL;
    A8Passes passes = {0};
    if (passes_buf) passes = a8_interleave(act, B, w->in, w->bits == 4, passes_buf, nthreads);
#endif
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp master
        team = omp_get_num_threads();
#ifdef A8_PACKED   /* a thread's copy of one tile; without it, the per-pass transposes below */
        __m512i *packed = passes_buf && !tiled
                          ? aligned_alloc(64, (size_t)a8_tile_vectors(w->bits, w->in, w->group) * 64) : NULL;
#endif
        #pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++) {
            int64_t r0 = t * ROW_TILE, r1 = r0 + ROW_TILE < w->out ? r0 + ROW_TILE : w->out;
#ifdef A8_PACKED
            if (tiled && passes_buf) {
                a8_tiled_rows(w, t, act, passes, y, B, accumulate);
                continue;
            }
            if (packed) {
                a8_packed_rows(w, t, act, passes, y, B, accumulate, packed);
                continue;
            }
#endif
#ifdef A8_RUNTIME_BATCH
            a8_tile(w, r0, r1, act, y, w->out, B, accumulate);
#else
            for (int64_t b = 0; b < B; b += A8_BATCH_PASS) {
                int64_t nb = B - b < A8_BATCH_PASS ? B - b : A8_BATCH_PASS;
                Activations8 ab = {act.codes + b * w->in, act.d + b * (w->in / A8_BLOCK),
                                   act.xsum + b * (w->in / A8_BLOCK), act.shift + b};
                float *yb = y + b * w->out;
                switch (nb) {   /* a constant nb per case: the loop over inputs unrolls into registers */
#define CASE(n) case n: { if (w->bits == 4) int4_a8_tile(w, r0, r1, ab, yb, w->out, n, accumulate); \
                        else int8_a8_tile(w, r0, r1, ab, yb, w->out, n, accumulate); } break;
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
                }
            }
#endif
        }
#ifdef A8_PACKED
        free(packed);
#endif
    }
#ifdef A8_PACKED
    free(passes_buf);
#endif
    return team;
}

/* Activations8 views into a float scratch of at least B * in + B floats (in % 32 == 0): codes
 * take a quarter of it, the scales and sums 2 / 32, the shifts B floats. */
static inline Activations8 a8_scratch(float *scratch, int64_t B, int64_t in) {
    float *d = scratch + B * in / 4, *xsum = d + B * in / A8_BLOCK;
    Activations8 act = {(int8_t *)scratch, d, xsum, xsum + B * in / A8_BLOCK};
    return act;
}

#endif /* MINSERVE_QUANT_A8_H */
