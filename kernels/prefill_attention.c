/* Causal attention of one sequence's prefill chunk, float32, on the CPU: flash attention in C.
 *
 * Why this exists: after the weight products moved to oneDNN (minserve/models/gemm.py), PyTorch's
 * CPU flash SDPA was the slowest part of a long prefill: ~115 GFLOP/s, a quarter of this CPU's FMA
 * ceiling, about a third of a 1024-token prompt's time (benchmarks/bench_roofline.py). Here both
 * products of attention run as small register-blocked GEMMs whose loads are mostly reused
 * (MR x 4 accumulators per 4 + MR loads), and the softmax is computed online (flash attention), so
 * no [queries x keys] matrix ever exists.
 *
 * Shapes (checked on the Python side, minserve/attention/prefill_cpu.py):
 *   q   [T, H, D]   the chunk's queries, T positions q_offset .. q_offset + T - 1;
 *   k,v [L, Hkv, D] keys and values of positions 0 .. L - 1 (the cached context, then the chunk),
 *                   L = q_offset + T; query head h reads kv head h / (H / Hkv) (grouped queries);
 *   out [T, H, D].
 * D must be a multiple of 64 (64 and 128 are the common head sizes).
 *
 * Work items: one kv head x QUERY_BLOCK positions, all of that kv head's query heads together, so
 * a packed key block serves them all. Items are dealt dynamically: under a causal mask the later
 * query blocks see more keys.
 *
 * A second entry, ms_prefill_attention_paged (prefill_attention_paged.h), reads the keys and
 * values from the paged KV cache itself, for several sequences and any number of queries: the
 * batch-invariant mode's attention, since a row's bits here depend on nothing but its own query
 * and keys.
 */
#define _POSIX_C_SOURCE 200112L   /* posix_memalign under -std=c11 */
#define _DEFAULT_SOURCE           /* syscall (amx_bf16.h asks Linux for the AMX tile state) */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant_dot.h"   /* vf16, hsum, omp.h */
#include "vmath.h"       /* vexp */

#define KEY_BLOCK 64      /* keys per block: one row of scores is 4 vectors */
#define QUERY_BLOCK 32    /* positions per work item */
#define MR 6              /* rows per register block (product_rows says how many columns) */
#define MAX_GROUP 16      /* query heads per kv head this file takes */

/* C[rows, 64] = A[rows, K] @ B[K, 64], or C = C * alpha[row] + that (alpha != NULL): the online
 * softmax's rescale of the running output, folded into the store.
 *
 * The register block: acc[r][c] = sum_k A[r, k] * B[k, c-th vector of columns] for mr <= MR rows;
 * each B row's vectors are loaded once and each A element broadcast once, so a block does
 * NV + mr loads per NV * mr multiply-adds. With AVX-512 a block is 6 rows x 4 vf16 (the whole 64
 * columns; 24 accumulators + 4 loads of 32 zmm registers). AVX2 has 16 ymm registers: there GCC
 * kept 6 x 4 vf16 accumulators (48 ymm halves) on the stack, as it did in decode.c, so a block is
 * 6 rows x 2 vf8 (16 columns: 12 accumulators + 2 loads + the broadcast) and the 64 columns take
 * four passes over A (which stays in L1). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
typedef vf8 pvec;
#define NV 2
#define pvec_load(p) ((vf8)_mm256_loadu_ps(p))
#define pvec_store(p, v) _mm256_storeu_ps((p), (__m256)(v))
#define pvec_fma(acc, a, b) ((vf8)_mm256_fmadd_ps((__m256)(b), _mm256_set1_ps(a), (__m256)(acc)))
#else
typedef vf16 pvec;
#define NV 4
#define pvec_load(p) (*(const vf16 *)(p))
#define pvec_store(p, v) (*(vf16 *)(p) = (v))
#define pvec_fma(acc, a, b) ((acc) + (a) * (b))
#endif
#define PANEL ((int)(NV * sizeof(pvec) / sizeof(float)))   /* columns per register block */

static inline __attribute__((always_inline)) void
block_product(const float *restrict A, int64_t lda, const float *restrict B, int64_t ldb, int64_t K,
              const int mr, pvec acc[MR][NV]) {
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = (pvec){0};
    for (int64_t k = 0; k < K; k++) {
        pvec b[NV];
        for (int c = 0; c < NV; c++) b[c] = pvec_load(B + k * ldb + c * (PANEL / NV));
        for (int r = 0; r < mr; r++) {
            float a = A[r * lda + k];
            for (int c = 0; c < NV; c++) acc[r][c] = pvec_fma(acc[r][c], a, b[c]);
        }
    }
}

static void product_rows(const float *A, int64_t lda, const float *B, int64_t ldb, int64_t K,
                         int64_t rows, float *C, int64_t ldc, const float *alpha) {
    const int lanes = PANEL / NV;
    pvec acc[MR][NV];
    for (int64_t col = 0; col < 64; col += PANEL)
        for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            int mr = rows - r0 < MR ? (int)(rows - r0) : MR;
            switch (mr) {   /* a constant row count per case: the accumulators stay in registers */
#define CASE(n) case n: block_product(A + r0 * lda, lda, B + col, ldb, K, n, acc); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
            }
            for (int r = 0; r < mr; r++)
                for (int j = 0; j < NV; j++) {
                    float *c = C + (r0 + r) * ldc + col + j * lanes;
                    pvec_store(c, alpha ? pvec_load(c) * alpha[r0 + r] + acc[r][j] : acc[r][j]);
                }
        }
}

typedef struct {   /* one thread's buffers for a work item: rows = group * QUERY_BLOCK */
    float *q;      /* [rows, D] the item's queries, pre-scaled */
    float *p;      /* [rows, KEY_BLOCK] scores, then probabilities */
    float *o;      /* [rows, D] running output */
    float *m, *l, *alpha;   /* [rows] running max, running sum, this block's rescale */
    float *tk, *tv;         /* a paged key block: keys transposed [D, KEY_BLOCK], values [KEY_BLOCK, D] */
} Buffers;

/* The softmax works at the register's width too: 16 floats with AVX-512, 8 with AVX2, where 16-float
 * vectors of masks and exps became scalar lane moves through the stack (perf: the softmax took
 * twice the time of both products together). */
#if defined(__AVX2__) && !defined(__AVX512F__)
typedef vf8 svec;
typedef vi8 sivec;
#define SVEC_LANE_IDS {0, 1, 2, 3, 4, 5, 6, 7}
#define svexp vexp8
#define svsum hsum8
#else
typedef vf16 svec;
typedef vi16 sivec;
#define SVEC_IS_VF16
#define SVEC_LANE_IDS {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#define svexp vexp
#define svsum hsum
#endif
#define SLANES ((int)(sizeof(svec) / sizeof(float)))
#define SVECS (KEY_BLOCK / SLANES)   /* vectors in one row of scores */

/* The largest lane: halves folded onto each other (unions, not shuffles: any GCC or clang). */
static inline float hmax(svec v) {
#ifdef SVEC_IS_VF16
    union { vf16 whole; vf8 half[2]; } u = {v};
    vf8 w = VSELECT(vi8, vf8, u.half[0] > u.half[1], u.half[0], u.half[1]);
#else
    vf8 w = v;
#endif
    union { vf8 whole; vf4 half[2]; } h = {w};
    vf4 a = VSELECT(vi4, vf4, h.half[0] > h.half[1], h.half[0], h.half[1]);
    float m0 = a[0] > a[1] ? a[0] : a[1], m1 = a[2] > a[3] ? a[2] : a[3];
    return m0 > m1 ? m0 : m1;
}

/* Scores -> probabilities for one key block, updating each row's running max and sum (the online
 * softmax). Keys past a row's own position (causal) or past the block's end get probability 0.
 * Most rows see the whole block (every block but the diagonal one): those skip the masks. The
 * softmax was about a third of this file's time on the AVX2 EPYC (a copy without it: 52.7 -> 36.3
 * ms for 1024 positions, 9 heads, one thread), most of it vexp; with the mask-free rows, the
 * vector hmax and vmath.h's rounding by addition: 26.5 -> 24.7 ms at two threads, 51.9 -> 49.0 at
 * one (medians of 12 alternating rounds). */
static void softmax_block(Buffers *b, int64_t rows, int64_t per_head, int64_t first_pos, int64_t key0,
                          int64_t nk) {
    const sivec lane = SVEC_LANE_IDS;
    for (int64_t r = 0; r < rows; r++) {
        svec *s = (svec *)(b->p + r * KEY_BLOCK);
        int64_t pos = first_pos + r % per_head;
        int64_t visible = pos - key0 + 1 < nk ? pos - key0 + 1 : nk;   /* keys this row may see */
        if (visible <= 0) {   /* the whole block is in this row's future */
            memset(s, 0, KEY_BLOCK * sizeof(float));
            b->alpha[r] = 1.0f;
            continue;
        }
        float mx;
        svec sum = (svec){0};
        if (visible == KEY_BLOCK) {
            svec mv = s[0];
            for (int c = 1; c < SVECS; c++) mv = VSELECT(sivec, svec, s[c] > mv, s[c], mv);
            mx = hmax(mv);
            mx = b->m[r] > mx ? b->m[r] : mx;
            for (int c = 0; c < SVECS; c++) {
                s[c] = svexp(s[c] - mx);
                sum += s[c];
            }
        } else {
            sivec seen[SVECS];
            svec mv = (svec){0} + b->m[r];
            for (int c = 0; c < SVECS; c++) {
                seen[c] = lane + SLANES * c < (int32_t)visible;
                mv = VSELECT(sivec, svec, seen[c] & (s[c] > mv), s[c], mv);
            }
            mx = hmax(mv);
            for (int c = 0; c < SVECS; c++) {   /* vexp clamps, so masked lanes are zeroed, not -inf */
                s[c] = VSELECT(sivec, svec, seen[c], svexp(s[c] - mx), (svec){0});
                sum += s[c];
            }
        }
        float a = b->m[r] == -INFINITY ? 0.0f : expf(b->m[r] - mx);
        b->alpha[r] = a;
        b->l[r] = b->l[r] * a + svsum(sum);
        b->m[r] = mx;
    }
}

/* Where a work item reads its keys and values: either laid out for the whole call (kt: the keys
 * transposed [Hkv, D, ldkt]; v: [L, Hkv, D]), or (paged != NULL) straight from the paged KV cache, a
 * key block at a time into the thread's tiles, the same floats either way. */
typedef struct {
    const float *kt, *v;
    int64_t ldkt;
    const void *k_cache, *v_cache;   /* paged: [blocks, block_size, Hkv, D], float32 or int8 codes */
    const float *k_scales, *v_scales;   /* int8: [blocks, block_size, Hkv] */
    const int64_t *paged;            /* paged: the sequence's block table (NULL: kt and v above) */
    int64_t block_size, kv_int8;
} KeySource;

#if defined(__AVX512F__)
/* r[0..15] (rows) -> their transpose in place: r[c] = column c. Two rounds of unpacks put, in
 * each 128-bit lane L of r[4g + m], column 4L + m of rows 4g .. 4g + 3; two rounds of lane
 * shuffles gather each column's four lanes. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int m = 0; m < 4; m++) {   /* lanes: 0x88 takes a's 0, 2 and b's 0, 2; 0xdd the odd ones */
        t[m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);
        t[4 + m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);
        t[8 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
        t[12 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
    }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
        r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd);
        r[4 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0x88);
        r[12 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0xdd);
    }
}

/* paged_key_block's transpose in 16 x 16 register tiles: tk[d, j] = key j's element d (an int8
 * code times its key's scale: one float32 rounding, as the scalar loop), zero for j >= nk. The
 * scalar loop read a key's D values once per column; this reads each once and shuffles in
 * registers (the decode rows of the batch-invariant mode spent most of their attention here:
 * bench_batch_invariance.py --attention). */
static void transpose_keys16(const char *const *krow, const float *sk, int64_t kv_int8, int64_t D,
                             int64_t nk, float *tk) {
    for (int64_t j0 = 0; j0 < KEY_BLOCK; j0 += 16) {
        if (j0 >= nk) {
            for (int64_t d = 0; d < D; d++) memset(tk + d * KEY_BLOCK + j0, 0, 16 * sizeof(float));
            continue;
        }
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                int64_t j = j0 + i;
                if (j >= nk)
                    r[i] = _mm512_setzero_ps();
                else if (kv_int8)
                    r[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128((const __m128i *)(krow[j] + d0)))), _mm512_set1_ps(sk[j]));
                else
                    r[i] = _mm512_loadu_ps((const float *)krow[j] + d0);
            }
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_ps(tk + (d0 + c) * KEY_BLOCK + j0, r[c]);
        }
    }
}
#endif

/* Keys key0 .. key0 + nk - 1 of kv head kvh from the paged cache: transposed into tk [D, KEY_BLOCK]
 * (columns past nk zero, as kt's past L) and rows into tv [KEY_BLOCK, D]; an int8 code times its
 * scale is one float32 rounding, as PyTorch's dequantization. */
static void paged_key_block(const KeySource *ks, int64_t Hkv, int64_t D, int64_t kvh, int64_t key0,
                            int64_t nk, float *tk, float *tv) {
    const char *krow[KEY_BLOCK];   /* each key's row of D codes or floats, and its scale */
    float sk[KEY_BLOCK];
    const int64_t esz = ks->kv_int8 ? 1 : 4;
    int64_t bs = ks->block_size, blk = key0 / bs, off = key0 % bs;   /* walked, not divided per key */
    for (int64_t j = 0; j < nk; j++, off++) {   /* values as rows; keys found, read below */
        if (off == bs) blk++, off = 0;
        int64_t slot = ks->paged[blk] * bs + off, at = (slot * Hkv + kvh) * D;
        krow[j] = (const char *)ks->k_cache + at * esz;
        if (ks->kv_int8) {
            const int8_t *vc = (const int8_t *)ks->v_cache + at;
            float sv = ks->v_scales[slot * Hkv + kvh];
            sk[j] = ks->k_scales[slot * Hkv + kvh];
            for (int64_t d = 0; d < D; d++) tv[j * D + d] = (float)vc[d] * sv;
        } else {
            memcpy(tv + j * D, (const float *)ks->v_cache + at, D * sizeof(float));
        }
    }
#if defined(__AVX512F__)
    transpose_keys16(krow, sk, ks->kv_int8, D, nk, tk);
#else
    /* The transpose a column of KEY_BLOCK keys at a time: contiguous stores, the rows' reads in L1
     * after the first column (writing a row's D values a column apart spilled L1: 2000-token
     * contexts of float32 keys ran 5x the decode kernel's time, bench_batch_invariance.py --attention). */
    for (int64_t d = 0; d < D; d++) {
        float *col = tk + d * KEY_BLOCK;
        if (ks->kv_int8)
            for (int64_t j = 0; j < nk; j++) col[j] = (float)((const int8_t *)krow[j])[d] * sk[j];
        else
            for (int64_t j = 0; j < nk; j++) col[j] = ((const float *)krow[j])[d];
        for (int64_t j = nk; j < KEY_BLOCK; j++) col[j] = 0.0f;
    }
#endif
}

/* One work item: kv head kvh, positions q_offset + t0 .. + nq - 1 (nq <= QUERY_BLOCK) of query
 * heads kvh * G .. kvh * G + G - 1, as rows g * nq + i. Only the item's own rows are computed (a
 * chunk of one query costs one row, not QUERY_BLOCK), and each row's arithmetic is the same
 * whatever the other rows are and wherever its keys were read from. */
static void attend_item(const float *q, const KeySource *ks, float *out, int64_t T, int64_t H,
                        int64_t Hkv, int64_t D, int64_t q_offset, float scale, int64_t kvh, int64_t t0,
                        Buffers *b) {
    int64_t G = H / Hkv, nq = T - t0 < QUERY_BLOCK ? T - t0 : QUERY_BLOCK;
    int64_t rows = G * nq, first_pos = q_offset + t0, last_pos = first_pos + nq - 1;
    for (int64_t g = 0; g < G; g++)          /* rows g * nq + i: head kvh * G + g */
        for (int64_t i = 0; i < nq; i++) {
            float *dst = b->q + (g * nq + i) * D;
            const float *src = q + ((t0 + i) * H + kvh * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d] * scale;
        }
    for (int64_t r = 0; r < rows; r++) b->m[r] = -INFINITY, b->l[r] = 0.0f;
    memset(b->o, 0, rows * D * sizeof(float));
    for (int64_t key0 = 0; key0 <= last_pos; key0 += KEY_BLOCK) {
        int64_t nk = last_pos + 1 - key0 < KEY_BLOCK ? last_pos + 1 - key0 : KEY_BLOCK;
        const float *kb = ks->kt + kvh * D * ks->ldkt + key0, *vb = ks->v + key0 * Hkv * D + kvh * D;
        int64_t ldk = ks->ldkt, ldv = Hkv * D;
        if (ks->paged) {
            paged_key_block(ks, Hkv, D, kvh, key0, nk, b->tk, b->tv);
            kb = b->tk, ldk = KEY_BLOCK, vb = b->tv, ldv = D;
        }
        product_rows(b->q, D, kb, ldk, D, rows, b->p, KEY_BLOCK, NULL);
        softmax_block(b, rows, nq, first_pos, key0, nk);
        for (int64_t c = 0; c < D; c += 64)  /* o = o * alpha + p @ v, 64 output columns at a time */
            product_rows(b->p, KEY_BLOCK, vb + c, ldv, nk, rows, b->o + c, D, b->alpha);
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            int64_t r = g * nq + i;
            float inv = 1.0f / b->l[r];
            float *dst = out + ((t0 + i) * H + kvh * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = b->o[r * D + d] * inv;
        }
}

/* attend_item for one query (a decode row) at position pos, every kv head, the heads of a key
 * block one after another: the rows of kv head h are rows h * G .. h * G + G - 1 of the buffers
 * (H <= G * QUERY_BLOCK rows: Hkv <= QUERY_BLOCK), and each head's arithmetic is attend_item's for
 * nq = 1, step for step, so its bits are the same. Paged keys only. */
static void attend_row_all_heads(const float *q, const KeySource *ks, float *out, int64_t H, int64_t Hkv,
                                 int64_t D, int64_t pos, float scale, Buffers *b) {
    int64_t G = H / Hkv;
    for (int64_t r = 0; r < H; r++) {
        for (int64_t d = 0; d < D; d++) b->q[r * D + d] = q[r * D + d] * scale;
        b->m[r] = -INFINITY, b->l[r] = 0.0f;
    }
    memset(b->o, 0, H * D * sizeof(float));
    for (int64_t key0 = 0; key0 <= pos; key0 += KEY_BLOCK) {
        int64_t nk = pos + 1 - key0 < KEY_BLOCK ? pos + 1 - key0 : KEY_BLOCK;
        for (int64_t h = 0; h < Hkv; h++) {
            Buffers w = {.q = b->q + h * G * D, .p = b->p + h * G * KEY_BLOCK, .o = b->o + h * G * D,
                         .m = b->m + h * G, .l = b->l + h * G, .alpha = b->alpha + h * G, .tk = b->tk, .tv = b->tv};
            paged_key_block(ks, Hkv, D, h, key0, nk, b->tk, b->tv);
            product_rows(w.q, D, b->tk, KEY_BLOCK, D, G, w.p, KEY_BLOCK, NULL);
            softmax_block(&w, G, 1, pos, key0, nk);
            for (int64_t c = 0; c < D; c += 64)
                product_rows(w.p, KEY_BLOCK, b->tv + c, D, nk, G, w.o + c, D, w.alpha);
        }
    }
    for (int64_t r = 0; r < H; r++) {
        float inv = 1.0f / b->l[r];
        for (int64_t d = 0; d < D; d++) out[r * D + d] = b->o[r * D + d] * inv;
    }
}

static int alloc_buffers(Buffers *b, int64_t G, int64_t D) {
    int64_t rows = G * QUERY_BLOCK;
    size_t floats = (size_t)(2 * rows * D + rows * KEY_BLOCK + 3 * rows + 2 * KEY_BLOCK * D + 16);
    void *mem = NULL;
    if (posix_memalign(&mem, 64, floats * sizeof(float))) return 0;
    float *f = mem;
    b->q = f; f += rows * D;
    b->o = f; f += rows * D;
    b->p = f; f += rows * KEY_BLOCK;
    b->m = f; f += rows;
    b->l = f; f += rows;
    b->alpha = f; f += rows;
    b->tk = f + (16 - (f - (float *)mem) % 16) % 16;   /* 64-byte aligned: read as vectors */
    b->tv = b->tk + KEY_BLOCK * D;
    return 1;
}

#include "prefill_attention_amx.h"   /* bf16 on AMX tiles: ms_prefill_attention_bf16 */

/* The exported entry: 0 on success, -1 for shapes this file does not take (the caller falls back
 * to PyTorch's SDPA), -2 when a thread could not allocate its buffers. nthreads <= 0: the caller's
 * OpenMP default (PyTorch's thread count). */
int64_t ms_prefill_attention(const float *q, const float *k, const float *v, float *out, int64_t T,
                             int64_t H, int64_t Hkv, int64_t D, int64_t q_offset, float scale,
                             int64_t nthreads) {
    if (T < 1 || Hkv < 1 || H % Hkv || H / Hkv > MAX_GROUP || D < 64 || D % 64 || q_offset < 0)
        return -1;
    int64_t blocks = (T + QUERY_BLOCK - 1) / QUERY_BLOCK, items = Hkv * blocks, failed = 0;
    int64_t L = q_offset + T, ldkt = (L + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK, ldkv = Hkv * D;
    int nt = nthreads > 0 ? (int)nthreads : omp_get_max_threads();
    /* The keys transposed once, [Hkv, D, L rounded up to a block, zeros past L]: the score
     * product reads them as rows of keys. Transposed per work item instead, every query block
     * would redo it for the same keys. */
    float *kt = NULL;
    if (posix_memalign((void **)&kt, 64, (size_t)(Hkv * D * ldkt) * sizeof(float))) return -2;
    #pragma omp parallel num_threads(nt) reduction(+ : failed)
    {
        #pragma omp for schedule(static)
        for (int64_t hd = 0; hd < Hkv * D; hd++) {
            float *row = kt + hd * ldkt;
            for (int64_t t = 0; t < L; t++) row[t] = k[t * ldkv + hd];
            for (int64_t t = L; t < ldkt; t++) row[t] = 0.0f;
        }   /* the loop's barrier: every row is written before any item reads one */
        Buffers b = {0};
        int ok = alloc_buffers(&b, H / Hkv, D);
        failed += !ok;
        /* Every thread enters the loop (a work-sharing loop must be met by the whole team); one
         * without buffers skips its items, and the caller, told so, falls back. The last query
         * blocks go first: they see the most keys, so the uneven tail is short. */
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t it = 0; it < items; it++) {
            int64_t block = blocks - 1 - it / Hkv, kvh = it % Hkv;
            KeySource ks = {.kt = kt, .v = v, .ldkt = ldkt};
            if (ok) attend_item(q, &ks, out, T, H, Hkv, D, q_offset, scale, kvh, block * QUERY_BLOCK, &b);
        }
        if (ok) free(b.q);
    }
    free(kt);
    return failed ? -2 : 0;
}

#include "prefill_attention_paged.h"   /* the same kernel over the paged KV cache: ms_prefill_attention_paged */
