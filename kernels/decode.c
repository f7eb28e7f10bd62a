/* A whole decode step of a Llama-family model in one call: the CPU fast path.
 *
 * Why this exists: at batch 1 a decode step reads every weight once (~540 MB for SmolLM2-135M in
 * fp32), so its speed limit is memory bandwidth. PyTorch streams the big matrices near that limit,
 * but the ~35 small operations per layer (norms, RoPE, KV writes, attention, residuals) each pay a
 * dispatch from Python and together cost a third of the step. Here the same arithmetic runs in
 * plain C: matrix-vector products are split over the OpenMP threads (the same libgomp PyTorch
 * uses, so the two share one thread pool), everything else runs in the calling thread.
 *
 * A step is a batch of *rows*, one token each with its own position and block-table row: a decode
 * step has one row per sequence, a speculative verification k + 1 rows of one sequence at
 * consecutive positions sharing its table. Rows are independent everywhere except attention, where
 * row j at position p reads keys 0..p of its table, its own sequence's earlier rows included.
 *
 * The caller picks the team size per step (nthreads): a region ends only when its slowest thread
 * does, so on a core that another process shares, a smaller team is faster
 * (minserve/engine/threads.py measures which).
 *
 * Layout contracts (checked on the Python side, kernels/decode.py):
 * - each weight matrix is [out_features, in_features], q/k/v and gate/up fused as in llama.py, in
 *   its own format (a Weight): row-major fp32 or bf16 (a dtype="bfloat16" model: widened in
 *   registers, exactly, so the step computes in fp32; with two or more rows on an AMX CPU, tiles
 *   multiply the weights by each input split in two bf16 halves, amx_bf16.h, and without tiles AVX-512
 *   BF16 dot products by each input rounded to bf16, dp_block), or int8 / int4 in minserve/quant/formats.py's
 *   layouts, multiplied with the dequantization in the weight stream (quant_dot.h, shared with
 *   quant.c). Fewer bytes per weight is the whole point at batch 1: the step is a weight stream;
 * - the KV cache of a layer is [num_blocks, block_size, kv_heads, head_dim], addressed through
 *   one block table per query row (int64, [rows, table_stride]): float32, bfloat16 (rounded to
 *   nearest even on write, as the torch path's .to(bfloat16)), or (KV_INT8) int8 codes
 *   plus a float32 scale per (slot, kv head), quantized on write as the torch reference does;
 * - RoPE uses the model's tables cos and sin_signed [max_positions, head_dim] (half-split layout,
 *   the sign of rotate_half folded into the sin table).
 */
#define _POSIX_C_SOURCE 199309L   /* clock_gettime under -std=c11 */
#define _DEFAULT_SOURCE           /* syscall (amx_bf16.h asks Linux for the AMX tile state) */
#include <math.h>
#include <stdlib.h>   /* malloc in decode_attention.h (AVX builds got it through immintrin.h) */
#include <string.h>
#include <time.h>

#include "quant_a8.h"    /* quant_dot.h (vf16, hsum, ROW_TILE, the int8 / int4 row loops, qmatmul,
                            order_columns) and the int8-activation loops, qmatmul_a8 */
#include "vmath.h"       /* vexp: exp of 16 floats (softmax, SiLU) */
#include "amx_bf16.h"    /* amx_matmul: bf16 weights times several rows on AMX tiles, where built */


/* A float32 product's register block (dot_rows): weight rows x input rows per pass over a tile.
 * 4 x 6 accumulators + 4 weight vectors + 1 input fill most of AVX-512's 32 registers. Elsewhere
 * (AVX2: 8-float accumulators, one ymm each, see dvec below) 3 x 4: 12 accumulators + 3 weight
 * vectors in 16 ymm, each input vector read by the FMA itself, 7 loads per 12 multiply-adds; the
 * 1 x 8 block before it needed 9 loads per 8 and kept only 8 FMAs in flight, fewer than the FMA
 * units' latency x throughput (one product at 16 rows in a scratch timing, 57-68 -> 62-85 GFLOP/s;
 * the step in docs/performance/vllm-avx2-epyc.md, bench_quant.py's per-part profile). */
#if defined(__AVX512F__)
#define DENSE_ROW_BLOCK 4
#define DENSE_BATCH_PASS 6
#else
#define DENSE_ROW_BLOCK 3
#define DENSE_BATCH_PASS 4
#endif
/* How far ahead of the weight stream the first pass prefetches, in bytes, by format. At 1 KiB bf16
 * weights streamed at ~23 GB/s where float32 reached ~31; 2 KiB took the Intel Xeon's bf16 batch-1
 * products from 12.5-13.9 to 8.0-9.2 ms a step (4 KiB measured as 2). float32 takes 2 KiB at one
 * row and 1 KiB at more: 2 gained ~4 % at 1 row and lost 15 % at 4 rows (15.7-16.3 -> 17.7-18.5
 * ms). FusedDecoder.step_profile, alternating runs, 2026-12-05; the one-row case again on
 * 2026-12-06, nine alternating runs of a float32 step at 64 tokens of context: 26.6 against 27.1
 * ms (median of 25 steps each, averaged), the host in a slow phase. */
#define PREFETCH_BYTES_F32 1024
#define PREFETCH_BYTES_F32_ONE_ROW 2048
#define PREFETCH_BYTES_BF16 2048

/* How a matrix is stored: the Python side sets format from the layer's descriptor and checks every
 * tensor's dtype and shape against it, so the kernel never reads a buffer as another type. */
enum { WEIGHT_F32 = 0, WEIGHT_INT8 = 1, WEIGHT_INT4 = 2, WEIGHT_BF16 = 3 };
enum { KV_F32 = 0, KV_INT8 = 1, KV_BF16 = 2 };

typedef struct {             /* one weight matrix [out, in], as its descriptor describes it */
    int64_t format;          /* WEIGHT_* */
    const void *data;        /* f32 [out, in] | int8 codes [out, in] | uint8 packed [out, in / 2]
                                | bf16 (uint16) [out, in] */
    const float *scales;     /* int8: [out]; int4: [out, in / group_size]; f32: NULL */
    const float *mins;       /* int4: [out, in / group_size] (w = q * scale + min); else NULL */
    const float *bias;       /* [out] or NULL */
    int64_t group_size;      /* int4: 32, 64 or 128; else 0 */
    int64_t act_int8;        /* int8 / int4 with in % 32 == 0: quantize the input rows (quant_a8.h) */
    const uint16_t *split_hi, *split_lo;   /* f32 at fp32_matmul_precision "high": the weight as two
                                              bf16 halves [out, in] for the tiles (amx_matmul); else NULL */
    const void *a8_tiles;    /* with act_int8: the weight in quant_a8_tiles.h's order, or NULL */
} Weight;

typedef struct {
    const float *input_norm, *post_norm;
    Weight qkv, o_proj, gate_up, down;
    void *k_cache, *v_cache;     /* [blocks, block_size, kv_heads, head_dim]: f32, or int8 codes */
    float *k_scales, *v_scales;  /* KV_INT8: [blocks, block_size, kv_heads]; KV_F32: NULL */
} LayerPtrs;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, block_size;
    int64_t kv_format;           /* KV_*, the same for every layer */
    int64_t embed_bf16;          /* embed is bfloat16 (uint16) [vocab, hidden], not float32 */
    float eps, scale;
    const void *embed;
    const float *final_norm, *cos, *sin_signed;
    Weight lm_head;
    const LayerPtrs *layers;
} ModelPtrs;

/* prefill_attention.c's ms_prefill_attention_paged (another library: the caller passes its address). */
typedef int64_t (*PagedFlashFn)(const float *q, const void *k_cache, const void *v_cache,
                                const float *k_scales, const float *v_scales, int64_t kv_int8,
                                int64_t block_size, const int64_t *tables, int64_t table_stride,
                                const int64_t *context_lens, int64_t n, int64_t T, int64_t H,
                                int64_t Hkv, int64_t D, float scale, float *out, int64_t nthreads);

/* The batch-invariant mode's attention (decode_attention.h, flash_attention_block): every row of
 * the step, prompt chunk or decode row, through the paged flash kernel, whose bits for a row do not
 * depend on the rest of its call, in place of this file's decode kernel (which computes the same
 * formula with other roundings, so a token would get other bits as a prompt row after a preemption
 * than as the decode row it was). The kernel takes sequences of equal query counts at a time:
 * the step's sequences come sorted into such groups. */
typedef struct {
    PagedFlashFn attend;
    int64_t n_groups;
    const int64_t *groups;        /* [n_groups, 3]: first sequence, sequences, queries each */
    const int64_t *first_row;     /* per sequence, in group order: its first query's row in the step */
    const int64_t *context_lens;  /* per sequence: keys before its first query */
    const int64_t *tables;        /* [sequences, table_stride]: block tables */
    int64_t table_stride;
    float *q, *out;               /* [rows, heads * head_dim]: a group's queries gathered, its output */
    float *final_hidden;          /* NULL, or [rows, hidden]: every row after the final norm, for
                                     prompt logprobs through the same LM head (ms_weight_matmul) */
} FlashPlan;

typedef struct {   /* caller-owned scratch, sized for the most rows and the longest context */
    float *h, *x, *qkv, *attn, *gate_up, *act;
    float *xs;               /* rows x (max(hidden, heads * head_dim, intermediate) + 1): int4's x
                                order, or int8 activations (matmul) */
    float *scores;
    int64_t scores_stride;   /* floats per (row, head) of scores: >= longest context */
    const FlashPlan *flash;  /* NULL: the decode kernel's attention; else the flash kernel's */
} Scratch;

/* Where a step's time goes (benchmarks/bench_quant.py): seconds per part, summed over the steps
 * run while profiling is on. Off by default, and then a step reads no clock. One set of sums per
 * process: profile one decoder at a time. Two clocks: wall time (PROFILE_WALL), or the calling
 * thread's CPU time (PROFILE_CPU), which on a shared host leaves out the time other processes
 * held the core, and is the whole cost only when the step runs on one thread. */
enum { PART_WEIGHTS, PART_LM_HEAD, PART_ATTENTION, PART_STEP, STEP_PARTS };
enum { PROFILE_OFF = 0, PROFILE_WALL = 1, PROFILE_CPU = 2 };
static int profiling;
static double part_seconds[STEP_PARTS];

static inline double clock_now(void) {
    if (profiling != PROFILE_CPU) return profiling ? omp_get_wtime() : 0.0;
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
static inline void add_time(int part, double since) {
    if (profiling) part_seconds[part] += clock_now() - since;
}

/* Copy the sums since the last call into out[STEP_PARTS] (unless NULL), zero them, and set the
 * profiling mode (PROFILE_*). Parts: block weight matmuls, LM head, attention (RoPE, KV writes
 * and reads), the whole step (the rest is norms, SwiGLU, embedding). */
void ms_step_profile(int mode, double *out) {
    for (int k = 0; k < STEP_PARTS; k++) {
        if (out) out[k] = part_seconds[k];
        part_seconds[k] = 0.0;
    }
    profiling = mode == PROFILE_WALL || mode == PROFILE_CPU ? mode : PROFILE_OFF;
}


/* y[b, r + k] (+)= W[r + k, :] . x[b, :] for rb weight rows and nb <= DENSE_BATCH_PASS inputs
 * (both compile-time constants at every call, so the accumulators live in registers). */
static inline __attribute__((always_inline)) vf16 weights16(const void *w, int64_t i, const int bf16) {
    return bf16 ? bf16x16_to_float((const uint16_t *)w + i) : *(const vf16 *)((const float *)w + i);
}

static inline __attribute__((always_inline)) float weight1(const void *w, int64_t i, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* The vector dot_block accumulates in. AVX-512: a vf16 is one register. Elsewhere GCC 12 lowers an
 * array of 64-byte vectors to the stack, so every multiply-add of the accumulators went through
 * memory (perf annotate on an AVX2-only EPYC, 2026-12-04: the hot FMA read 0x26e0(%rsp); the
 * fused step ran 0.33x PyTorch's speed at 16 rows): there it accumulates in 8-float vf8s, one
 * ymm register each. The per-element sum order stays the same for every batch size. */
#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
typedef vf16 dvec;
#define DVEC_LANES 16
#define dvec_weights weights16
#define dvec_hsum hsum
#define dvec_fma(a, w, x) ((a) + (w) * (x))
#define dvec_load(p) (*(const vf16 *)(p))   /* vf16 is 4-byte aligned: an unaligned load */
#else
typedef vf8 dvec;
#define DVEC_LANES 8
static inline __attribute__((always_inline)) vf8 dvec_weights(const void *w, int64_t i, const int bf16) {
    if (!bf16) return (vf8)_mm256_loadu_ps((const float *)w + i);   /* rows: 4-byte aligned */
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return (vf8)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
/* an explicit FMA: contraction of a + w * x is the compiler's choice, and it chose differently
 * for one row and for several, which broke a row's independence from the rows beside it */
#define dvec_load(p) ((vf8)_mm256_loadu_ps(p))
#define dvec_fma(a, w, x) ((vf8)_mm256_fmadd_ps((__m256)(w), (__m256)(x), (__m256)(a)))
#define dvec_hsum hsum8
#endif

/* The rest of the step (attention's dot products and value sums, softmax's exps, SwiGLU) works at
 * the same width, for the same reason: in 16-float vectors on AVX2, GCC moved every key's dot
 * product through the stack (perf annotate, AVX2-only EPYC, batch 16 at 300 tokens of context:
 * attention 59 of a 146 ms step). */
#if DVEC_LANES == 16
#define dvec_exp vexp
#define dvec_int8 int8x16_to_float
#define dvec_store(p, v) (*(vf16 *)(p) = (v))
#else
#define dvec_exp vexp8
static inline vf8 dvec_int8(const int8_t *p) {   /* 8 int8 codes -> 8 floats */
    return (vf8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#define dvec_store(p, v) _mm256_storeu_ps((p), (__m256)(v))
#endif

/* pf: what to prefetch, in bytes past each weight vector as it is read (0: nothing); see
 * dense_matmul. */
static inline __attribute__((always_inline)) void
dot_block(const void *restrict W, int64_t in, int64_t r, const float *restrict x, int64_t ldx,
          float *restrict y, int64_t ldy, const int rb, const int nb, int accumulate, const int bf16,
          int64_t pf) {
    const int elt = bf16 ? 2 : 4;   /* bytes per weight */
    const char *w = (const char *)W + r * in * elt;
    dvec acc[DENSE_ROW_BLOCK][DENSE_BATCH_PASS];
    for (int k = 0; k < rb; k++)
        for (int b = 0; b < nb; b++) acc[k][b] = (dvec){0};
    int64_t i = 0;
    for (; i + DVEC_LANES <= in; i += DVEC_LANES) {
        dvec wv[DENSE_ROW_BLOCK];
        for (int k = 0; k < rb; k++) {
            if (pf) PREFETCH_AHEAD(w + (k * in + i) * elt + pf);
            wv[k] = dvec_weights(w, k * in + i, bf16);
        }
        for (int b = 0; b < nb; b++) {
            dvec xv = dvec_load(x + b * ldx + i);
            /* quant_dot.h's IN_REGISTER: GCC otherwise folds this load into each of the rb FMAs,
             * 28 loads per 24 FMAs, bound by the load ports (Zen 4 EPYC, 2026-12-06, one thread, a
             * 192 x 576 weight in L2: 16 rows 70 -> 89 GFLOP/s in a scratch ms_matmul loop; the
             * 16-row step 46 -> 33 ms; benchmarks/bench_roofline.py's kernel table afterwards:
             * 173-193 GFLOP/s at 16 rows on two threads, oneDNN 139-147) */
            IN_REGISTER(xv);
            for (int k = 0; k < rb; k++) acc[k][b] = dvec_fma(acc[k][b], wv[k], xv);
        }
    }
    for (int k = 0; k < rb; k++)
        for (int b = 0; b < nb; b++) {
            float s = dvec_hsum(acc[k][b]);
            for (int64_t j = i; j < in; j++) s += weight1(w, k * in + j, bf16) * x[b * ldx + j];
            if (accumulate) y[b * ldy + r + k] += s; else y[b * ldy + r + k] = s;
        }
}

#if defined(__AVX512BF16__)
/* dot_block for bf16 weights times inputs already rounded to bf16 (xb), on AVX-512 BF16 dot
 * products: one vdpbf16ps multiplies 32 weights by 32 inputs (exact bf16 x bf16 products, float32
 * sums), where the widening loop needs two conversions and two FMAs; per instruction the same rate
 * on the Zen 4 EPYC (bench_roofline.py: bf16 dot 469, fp32 FMA 234 GFLOP/s), so twice the
 * multiply-adds. bench_roofline.py's kernel table there (2026-12-06, 16 rows, two threads): 286-325
 * GFLOP/s against the widening loop's 176-198 and oneDNN bf16's 235-247. */
static inline __attribute__((always_inline)) void
dp_block(const uint16_t *restrict W, int64_t in, int64_t r, const uint16_t *restrict xb, int64_t ldx,
         float *restrict y, int64_t ldy, const int rb, const int nb, int accumulate, int64_t pf) {
    const uint16_t *w = W + r * in;
    __m512 acc[DENSE_ROW_BLOCK][DENSE_BATCH_PASS];
    for (int k = 0; k < rb; k++)
        for (int b = 0; b < nb; b++) acc[k][b] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= in; i += 32) {
        __m512bh wv[DENSE_ROW_BLOCK];
        for (int k = 0; k < rb; k++) {
            if (pf) PREFETCH_AHEAD((const char *)(w + k * in + i) + pf);
            wv[k] = (__m512bh)_mm512_loadu_si512(w + k * in + i);
        }
        for (int b = 0; b < nb; b++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + b * ldx + i);
            IN_REGISTER(xv);
            for (int k = 0; k < rb; k++) acc[k][b] = _mm512_dpbf16_ps(acc[k][b], wv[k], xv);
        }
    }
    for (int k = 0; k < rb; k++)
        for (int b = 0; b < nb; b++) {
            float s = hsum((vf16)acc[k][b]);
            for (int64_t j = i; j < in; j++) s += bf16_to_float(w[k * in + j]) * bf16_to_float(xb[b * ldx + j]);
            if (accumulate) y[b * ldy + r + k] += s; else y[b * ldy + r + k] = s;
        }
}

/* x [n floats] -> bf16, rounded to nearest even (as PyTorch's .to(torch.bfloat16)). */
static void round_to_bf16(const float *x, uint16_t *xb, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store_bf16x16(xb + i, dvec_load(x + i));
    for (; i < n; i++) xb[i] = float_to_bf16(x[i]);
}

static int bf16_dot_on = 1;   /* ms_bf16_dot */
#endif

/* The product a pass over a tile runs: float32 weights, bf16 weights widened to float32 in
 * registers, or bf16 weights times bf16-rounded inputs on dot products (dp_block). */
enum { DOT_F32 = 0, DOT_BF16 = 1, DOT_BF16_DP = 2 };

/* y[b, r] (+)= W[r, :] . x[b, :] for rows r in [r0, r1) and nb <= DENSE_BATCH_PASS inputs.
 *
 * Why blocks of rows: with one weight row at a time, every multiply-add needs its own load of an
 * input vector, so a batched step is bound by loads, not by the FMA units. DENSE_ROW_BLOCK = 4
 * rows reuse each loaded input vector four times and each weight vector nb times: 4 x 6
 * accumulators cost 10 loads per 24 multiply-adds (SmolLM2-135M, 16 rows, one thread: the step
 * 70.5 -> 59 ms, the LM head at two threads 133 -> 175 GFLOP/s). A single input (batch-1 decode)
 * streams one row at a time instead: it is bound by DRAM, and there four interleaved row streams
 * ran ~15 % slower than one. Tried and not kept: every input group per block of rows (the block's
 * weights reused from L1; 25 % slower: 16 rows of inputs do not fit in L1), and one transposing
 * reduction of four accumulators instead of four hsum calls (no change). */
static inline __attribute__((always_inline)) void
dot_block_any(const void *restrict W, int64_t in, int64_t r, const void *restrict x, int64_t ldx,
              float *restrict y, int64_t ldy, const int rb, const int nb, int accumulate, const int kind,
              int64_t pf) {
#if defined(__AVX512BF16__)
    if (kind == DOT_BF16_DP) {
        dp_block(W, in, r, x, ldx, y, ldy, rb, nb, accumulate, pf);
        return;
    }
#endif
    dot_block(W, in, r, x, ldx, y, ldy, rb, nb, accumulate, kind == DOT_BF16, pf);
}

static inline __attribute__((always_inline)) void
dot_rows(const void *restrict W, int64_t in, int64_t r0, int64_t r1, const void *restrict x,
         int64_t ldx, float *restrict y, int64_t ldy, const int nb, int accumulate, const int kind, int64_t pf) {
    const int rb = nb > 1 ? DENSE_ROW_BLOCK : 1;
    int64_t r = r0;
    for (; r + rb <= r1; r += rb) dot_block_any(W, in, r, x, ldx, y, ldy, rb, nb, accumulate, kind, pf);
    if (rb > 2 && r + 2 <= r1) {   /* a tile of 16 rows in blocks of 3 leaves 1; 3 x 5 + 1 */
        dot_block_any(W, in, r, x, ldx, y, ldy, 2, nb, accumulate, kind, pf);
        r += 2;
    }
    for (; r < r1; r++) dot_block_any(W, in, r, x, ldx, y, ldy, 1, nb, accumulate, kind, pf);
}

/* y[B, out] = x[B, in] @ W.T (+ bias), or y += that when accumulate (the residual add for free),
 * for a float32 W, or a bfloat16 one (bf16: widened in registers as it streams in, half the bytes;
 * the sums stay float32; two or more rows go to AMX tiles or, without them, to dp_block's dot
 * products, the inputs rounded to bf16 in xs first). Threads split the output rows; a row tile is re-read from cache for every group
 * of DENSE_BATCH_PASS inputs, so DRAM sees each weight once per step whatever the batch. Returns
 * the team size. */
static int64_t dense_matmul(const void *W, const float *bias, const float *x, float *xs, float *y,
                            int64_t B, int64_t in, int64_t out, int accumulate, int bf16, int nthreads) {
#ifdef HAVE_AMX_BF16
    if (bf16 && xs && B >= AMX_MIN_ROWS && in % AMX_K == 0 && amx_state > 0)
        return amx_matmul(W, NULL, bias, x, xs, y, B, in, out, accumulate, nthreads);
#endif
    int kind = bf16 ? DOT_BF16 : DOT_F32;
    const void *xin = x;
    int64_t xelt = 4;   /* bytes per input element */
#if defined(__AVX512BF16__)
    if (bf16 && xs && B >= 2 && bf16_dot_on) {   /* xs holds B * in floats: room for B * in bf16 */
        round_to_bf16(x, (uint16_t *)xs, B * in);
        kind = DOT_BF16_DP, xin = xs, xelt = 2;
    }
#endif
    (void)xs;
    int64_t tiles = (out + ROW_TILE - 1) / ROW_TILE, team = 1;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp master
        team = omp_get_num_threads();
        #pragma omp for schedule(static) nowait   /* the region's end is the one barrier */
        for (int64_t t = 0; t < tiles; t++) {
            int64_t r0 = t * ROW_TILE, r1 = r0 + ROW_TILE < out ? r0 + ROW_TILE : out;
            for (int64_t b = 0; b < B; b += DENSE_BATCH_PASS) {
                int64_t nb = B - b < DENSE_BATCH_PASS ? B - b : DENSE_BATCH_PASS;
                const void *xb = (const char *)xin + b * in * xelt;
                float *yb = y + b * out;
                /* The first pass streams the tile from DRAM (prefetching ahead in its rows); the
                 * later ones multiply it from cache while DRAM would idle, so the second one
                 * prefetches the next tile, which the first pass then finds in cache (batch 16,
                 * AVX2-only EPYC: the step's products 65 -> 59.5 ms). */
                int64_t elt = bf16 ? 2 : 4, pf = 0;
                if (b == 0)
                    pf = bf16 ? PREFETCH_BYTES_BF16 : B == 1 ? PREFETCH_BYTES_F32_ONE_ROW : PREFETCH_BYTES_F32;
                else if (b == DENSE_BATCH_PASS && t + 1 < tiles) pf = ROW_TILE * in * elt;
                /* a constant nb and format per case: the loops unroll into registers */
#define CASE(n) case n: { if (kind == DOT_BF16_DP) dot_rows(W, in, r0, r1, xb, in, yb, out, n, accumulate, DOT_BF16_DP, pf); \
                        else if (kind == DOT_BF16) dot_rows(W, in, r0, r1, xb, in, yb, out, n, accumulate, DOT_BF16, pf); \
                        else dot_rows(W, in, r0, r1, xb, in, yb, out, n, accumulate, DOT_F32, pf); } break;
                switch (nb) {   /* only the cases a pass can have: a case past DENSE_BATCH_PASS
                                 * would index past acc (dead code, but GCC warned of it on AVX2) */
                CASE(1) CASE(2) CASE(3) CASE(4)
#if DENSE_BATCH_PASS >= 6
                CASE(5) CASE(6)
#endif
                }
#undef CASE
                if (bias)   /* after the dot products: a residual row gets its bias too */
                    for (int64_t k = 0; k < nb; k++)
                        for (int64_t r = r0; r < r1; r++) yb[k * out + r] += bias[r];
            }
        }
    }
    return team;
}

/* ms_matmul with the caller's OpenMP default team (PyTorch's thread count). Exported for the tests. */
void ms_matmul(const float *W, const float *bias, const float *x, float *y, int64_t B, int64_t in,
               int64_t out, int accumulate) {
    dense_matmul(W, bias, x, NULL, y, B, in, out, accumulate, 0, omp_get_max_threads());
}

/* Use AVX-512 BF16 dot products for bf16 weights times two or more rows, each input rounded to
 * bf16 (want = 1, the default where built) or the widening float32 loop (want = 0). Returns 1 when
 * they are in use: never where this build or CPU lacks AVX-512 BF16. AMX tiles, where in use, come
 * first. */
int ms_bf16_dot(int want) {
#if defined(__AVX512BF16__)
    bf16_dot_on = want != 0;
    return bf16_dot_on;
#else
    (void)want;
    return 0;
#endif
}

/* Use AMX tiles for bf16 weights times several rows (want = 1; the first call asks Linux for the
 * tile state) or not (want = 0). Returns 1 when they are in use: never where this build or CPU
 * lacks AMX, or Linux refused. */
int ms_amx(int want) {
#ifdef HAVE_AMX_BF16
    return amx_enable(want);
#else
    (void)want;
    return 0;
#endif
}

/* The same product for a weight in any format. Quantized ones go through quant_dot.h's loops, which
 * dequantize in registers as the codes stream in (the same code kernels/quant.py runs), so a step
 * reads 1 (int8) or ~0.6 (int4, with scales and mins) bytes per weight instead of 4; or, with
 * act_int8, through quant_a8.h's integer loops on quantized inputs.
 * xs: scratch of B * in + B floats, where int4 needs x in order_columns's order (its nibble order)
 * and int8 activations their codes and scales. */
static int64_t matmul(const Weight *w, const float *x, float *xs, float *y, int64_t B, int64_t in,
                      int64_t out, int accumulate, int nthreads) {
#ifdef HAVE_AMX_BF16
    if (w->format == WEIGHT_F32 && w->split_hi && B >= AMX_MIN_ROWS && in % AMX_K == 0 && amx_state > 0)
        return amx_matmul(w->split_hi, w->split_lo, w->bias, x, xs, y, B, in, out, accumulate, nthreads);
#endif
    if (w->format == WEIGHT_F32 || w->format == WEIGHT_BF16)
        return dense_matmul(w->data, w->bias, x, xs, y, B, in, out, accumulate,
                            w->format == WEIGHT_BF16, nthreads);
    QWeight q = {w->format == WEIGHT_INT8 ? 8 : 4, w->data, w->scales, w->mins, w->bias,
                 w->group_size, in, out, w->act_int8 ? w->a8_tiles : NULL};
    if (w->act_int8)
        return qmatmul_a8(&q, x, a8_scratch(xs, B, in), y, B, accumulate, nthreads);
    if (w->format == WEIGHT_INT4) {
        order_columns(x, xs, B * in);
        x = xs;
    }
    return qmatmul(&q, x, y, B, accumulate, nthreads);
}

/* matmul for one bound Weight, with the caller's default team: exported so that the tests can
 * check each format's dispatch (and int8 activations' use of the scratch) against kernels/quant.py. */
int64_t ms_weight_matmul(const Weight *w, const float *x, float *xs, float *y, int64_t B, int64_t in,
                         int64_t out, int accumulate) {
    return matmul(w, x, xs, y, B, in, out, accumulate, omp_get_max_threads());
}

/* Whether w is a format this file implements for an [out, in] matrix (a last check: kernels/decode.py
 * validates every tensor first). A wrong group would make int4_rows read past the scales. */
static int weight_ok(const Weight *w, int64_t in) {
    if (!w->data) return 0;
    if (w->act_int8 && (w->format == WEIGHT_F32 || w->format == WEIGHT_BF16 || in % A8_BLOCK)) return 0;
    switch (w->format) {
    case WEIGHT_F32: case WEIGHT_BF16: return 1;
    case WEIGHT_INT8: return w->scales != NULL;
    case WEIGHT_INT4:
        return w->scales && w->mins && in % 32 == 0 && in % w->group_size == 0
               && (w->group_size == 32 || w->group_size == 64 || w->group_size == 128);
    default: return 0;
    }
}

static int model_ok(const ModelPtrs *m) {
    int64_t E = m->hidden, HD = m->num_heads * m->head_dim, I = m->intermediate;
    if (m->kv_format != KV_F32 && m->kv_format != KV_INT8 && m->kv_format != KV_BF16) return 0;
    if (!weight_ok(&m->lm_head, E)) return 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const LayerPtrs *L = &m->layers[l];
        if (!weight_ok(&L->qkv, E) || !weight_ok(&L->o_proj, HD) || !weight_ok(&L->gate_up, E)
            || !weight_ok(&L->down, I))
            return 0;
        if (m->kv_format == KV_INT8 && (!L->k_scales || !L->v_scales)) return 0;
    }
    return 1;
}

/* out = x / sqrt(mean(x^2) + eps) * w, per row (the mean of squares accumulated in fp32). */
void ms_rms_norm(const float *x, const float *w, float *out, int64_t B, int64_t dim, float eps) {
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * dim;
        float ss = 0.f;
        for (int64_t i = 0; i < dim; i++) ss += xb[i] * xb[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) out[b * dim + i] = w[i] * (xb[i] * inv);
    }
}

/* Rotate `heads` vectors of head_dim in place: v[d] = v[d] cos[d] + v[(d + half) % D] sin_signed[d]. */
static void rope(float *v, int64_t heads, int64_t D, const float *cos, const float *sin_signed) {
    int64_t half = D / 2;
    float tmp[1024];
    for (int64_t h = 0; h < heads; h++, v += D) {   /* each half pairs with the other: no modulo */
        memcpy(tmp, v, D * sizeof(float));
        for (int64_t d = 0; d < half; d++) v[d] = tmp[d] * cos[d] + tmp[d + half] * sin_signed[d];
        for (int64_t d = half; d < D; d++) v[d] = tmp[d] * cos[d] + tmp[d - half] * sin_signed[d];
    }
}

/* In-place exp(x - shift) over n floats; returns their sum. Exported for the tests. */
float ms_exp_shifted(float *x, int64_t n, float shift) {
    dvec acc = (dvec){0};
    int64_t i = 0;
    for (; i + DVEC_LANES <= n; i += DVEC_LANES) {
        dvec e = dvec_exp(dvec_load(x + i) - shift);
        dvec_store(x + i, e);
        acc += e;
    }
    float sum = dvec_hsum(acc);
    for (; i < n; i++) sum += (x[i] = expf(x[i] - shift));
    return sum;
}

/* Attention and the KV cache's reads and writes (float32 or int8): static functions that use the
 * structs and helpers above, kept in their own file to keep this one readable. */
#include "decode_attention.h"

/* SwiGLU: silu(gate) * up, with silu(g) = g / (1 + exp(-g)) as PyTorch computes it. */
static void silu_mul(const float *gate_up, float *out, int64_t B, int64_t inter) {
    for (int64_t b = 0; b < B; b++) {
        const float *g = gate_up + b * 2 * inter, *u = g + inter;
        float *o = out + b * inter;
        int64_t i = 0;
        for (; i + DVEC_LANES <= inter; i += DVEC_LANES) {
            dvec gv = dvec_load(g + i);
            dvec_store(o + i, gv / (1.0f + dvec_exp(-gv)) * dvec_load(u + i));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* One step over B rows (tokens; see the top of this file): embeddings in, logits of the given rows
 * out. The scratch buffers hold at least B rows, and n_logits <= B (checked in kernels/decode.py).
 * nthreads: the OpenMP team size of every parallel region (<= 0: the caller's default, PyTorch's
 * thread count). Returns the team size the regions ran with, so the caller can check it, -1
 * (nothing computed) when a weight or cache format is not one this file implements, or -2 when the
 * flash kernel (s->flash) declined a group (its cache format, its head sizes, or out of memory). */
int64_t ms_decode_step(const ModelPtrs *m, const Scratch *s, int64_t B, const int64_t *token_ids,
                       const int64_t *positions, const int64_t *tables, int64_t table_stride,
                       const int64_t *logit_rows, int64_t n_logits, float *logits, int64_t nthreads) {
    int64_t E = m->hidden, H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim;
    int64_t qkv_dim = (H + 2 * Hkv) * D, I = m->intermediate;
    int nt = nthreads > 0 ? (int)nthreads : omp_get_max_threads();
    if (!model_ok(m)) return -1;
    double step_start = clock_now(), t;
    for (int64_t b = 0; b < B; b++) {
        if (m->embed_bf16)
            for (int64_t e = 0; e < E; e++)
                s->h[b * E + e] = bf16_to_float(((const uint16_t *)m->embed)[token_ids[b] * E + e]);
        else
            memcpy(s->h + b * E, (const float *)m->embed + token_ids[b] * E, E * sizeof(float));
    }
    for (int64_t l = 0; l < m->num_layers; l++) {
        const LayerPtrs *L = &m->layers[l];
        ms_rms_norm(s->h, L->input_norm, s->x, B, E, m->eps);
        t = clock_now();
        matmul(&L->qkv, s->x, s->xs, s->qkv, B, E, qkv_dim, 0, nt);
        add_time(PART_WEIGHTS, t);
        t = clock_now();
        if (s->flash) {
            if (flash_attention_block(m, L, s, B, positions, tables, table_stride, nt)) return -2;
        } else {
            attention_block(m, L, s, B, positions, tables, table_stride, nt);
        }
        add_time(PART_ATTENTION, t);
        t = clock_now();
        matmul(&L->o_proj, s->attn, s->xs, s->h, B, H * D, E, 1, nt);      /* h += o_proj(attn) */
        add_time(PART_WEIGHTS, t);
        ms_rms_norm(s->h, L->post_norm, s->x, B, E, m->eps);
        t = clock_now();
        matmul(&L->gate_up, s->x, s->xs, s->gate_up, B, E, 2 * I, 0, nt);
        add_time(PART_WEIGHTS, t);
        silu_mul(s->gate_up, s->act, B, I);
        t = clock_now();
        matmul(&L->down, s->act, s->xs, s->h, B, I, E, 1, nt);               /* h += down(act) */
        add_time(PART_WEIGHTS, t);
    }
    for (int64_t r = 0; r < n_logits; r++)
        ms_rms_norm(s->h + logit_rows[r] * E, m->final_norm, s->x + r * E, 1, E, m->eps);
    if (s->flash && s->flash->final_hidden)   /* row by row, as the logit rows above */
        for (int64_t b = 0; b < B; b++)
            ms_rms_norm(s->h + b * E, m->final_norm, s->flash->final_hidden + b * E, 1, E, m->eps);
    t = clock_now();
    int64_t team = matmul(&m->lm_head, s->x, s->xs, logits, n_logits, E, m->vocab, 0, nt);
    add_time(PART_LM_HEAD, t);
    add_time(PART_STEP, step_start);
    return team;
}
