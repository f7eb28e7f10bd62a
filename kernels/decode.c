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
 * - weights are row-major [out_features, in_features] fp32, q/k/v and gate/up fused as in llama.py;
 * - the KV cache of a layer is [num_blocks, block_size, kv_heads, head_dim], addressed through
 *   one block table per query row (int64, [rows, table_stride]);
 * - RoPE uses the model's tables cos and sin_signed [max_positions, head_dim] (half-split layout,
 *   the sign of rotate_half folded into the sin table).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* 16 floats: one AVX-512 register, or two AVX2 registers; unaligned loads are fine (aligned(4)). */
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi16 __attribute__((vector_size(64)));

#define MAX_BATCH_PASS 8      /* input rows multiplied per pass over a weight tile */

#define PREFETCH_FLOATS 256   /* software prefetch 1 KiB ahead of the weight stream */
#define ROW_TILE 16           /* weight rows per OpenMP work item: 16 x hidden floats stay in L2 */

typedef struct {
    const float *input_norm, *qkv, *qkv_bias, *o_proj, *post_norm, *gate_up, *down;
    float *k_cache, *v_cache;
} LayerPtrs;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, block_size;
    float eps, scale;
    const float *embed, *final_norm, *lm_head, *cos, *sin_signed;
    const LayerPtrs *layers;
} ModelPtrs;

typedef struct {   /* caller-owned scratch, sized for the most rows and the longest context */
    float *h, *x, *qkv, *attn, *gate_up, *act, *scores;
    int64_t scores_stride;   /* floats per (row, head) of scores: >= longest context */
} Scratch;

/* Sum of the 16 lanes as a tree of vector adds: a lane-by-lane loop would be a chain of 15
 * dependent additions per output row, which dominates once several inputs share a weight load. */
static inline float hsum(vf16 v) {
    union { vf16 whole; vf8 half[2]; } u = {v};      /* unions, not shuffles: any GCC or clang */
    union { vf8 whole; vf4 half[2]; } w = {u.half[0] + u.half[1]};
    vf4 b = w.half[0] + w.half[1];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline vf16 splat(float v) { return (vf16){0} + v; }

static inline vf16 vselect(vi16 mask, vf16 a, vf16 b) {
    return (vf16)(((vi16)a & mask) | ((vi16)b & ~mask));
}

/* exp of 16 floats at once (libm's expf is one scalar call per element; softmax and SiLU need
 * many). Cephes' method: exp(x) = 2^n * exp(r) with n = round(x / ln 2), |r| <= ln(2) / 2, exp(r)
 * from a degree-6 polynomial, ln 2 split in two parts so r is exact. Relative error < 1e-6 against
 * float64 exp (tests/test_fused_decode.py). */
static inline vf16 vexp(vf16 x) {
    x = vselect(x > 88.0f, splat(88.0f), x);
    x = vselect(x < -87.0f, splat(-87.0f), x);
    vf16 t = x * 1.44269504088896341f + 0.5f;
    vi16 n = __builtin_convertvector(t, vi16);
    vf16 nf = __builtin_convertvector(n, vf16);
    vi16 too_big = nf > t;                   /* truncation rounded a negative t up: floor it */
    n += too_big;                            /* the mask is -1 where true */
    nf = __builtin_convertvector(n, vf16);
    vf16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf16)((n + 127) << 23);      /* 2^n built from its exponent bits */
}

/* y[b, r] (+)= W[r, :] . x[b, :] for rows r in [r0, r1) and nb <= MAX_BATCH_PASS inputs.
 * Each weight vector is loaded once and multiplied into every input row. */
static inline __attribute__((always_inline)) void
dot_rows(const float *restrict W, int64_t in, int64_t r0, int64_t r1, const float *restrict x,
         int64_t ldx, float *restrict y, int64_t ldy, const int nb, int accumulate) {
    for (int64_t r = r0; r < r1; r++) {
        const float *w = W + r * in;
        vf16 acc[MAX_BATCH_PASS];
        for (int b = 0; b < nb; b++) acc[b] = (vf16){0};
        int64_t i = 0;
        for (; i + 16 <= in; i += 16) {
            __builtin_prefetch(w + i + PREFETCH_FLOATS);
            vf16 wv = *(const vf16 *)(w + i);
            for (int b = 0; b < nb; b++) acc[b] += wv * *(const vf16 *)(x + b * ldx + i);
        }
        for (int b = 0; b < nb; b++) {
            float s = hsum(acc[b]);
            for (int64_t j = i; j < in; j++) s += w[j] * x[b * ldx + j];
            if (accumulate) y[b * ldy + r] += s; else y[b * ldy + r] = s;
        }
    }
}

/* y[B, out] = x[B, in] @ W.T (+ bias), or y += that when accumulate (the residual add for free).
 * Threads split the output rows; a row tile is re-read from cache for every group of 8 inputs,
 * so DRAM sees each weight once per step whatever the batch. Returns the team size that ran it. */
static int64_t matmul(const float *W, const float *bias, const float *x, float *y, int64_t B,
                      int64_t in, int64_t out, int accumulate, int nthreads) {
    int64_t tiles = (out + ROW_TILE - 1) / ROW_TILE, team = 1;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp master
        team = omp_get_num_threads();
        #pragma omp for schedule(static) nowait   /* the region's end is the one barrier */
        for (int64_t t = 0; t < tiles; t++) {
            int64_t r0 = t * ROW_TILE, r1 = r0 + ROW_TILE < out ? r0 + ROW_TILE : out;
            for (int64_t b = 0; b < B; b += MAX_BATCH_PASS) {
                int64_t nb = B - b < MAX_BATCH_PASS ? B - b : MAX_BATCH_PASS;
                const float *xb = x + b * in;
                float *yb = y + b * out;
                switch (nb) {   /* a constant nb per case: the loop over inputs unrolls into registers */
#define CASE(n) case n: dot_rows(W, in, r0, r1, xb, in, yb, out, n, accumulate); break;
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
                }
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
    matmul(W, bias, x, y, B, in, out, accumulate, omp_get_max_threads());
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
    for (int64_t h = 0; h < heads; h++, v += D) {
        memcpy(tmp, v, D * sizeof(float));
        for (int64_t d = 0; d < D; d++) v[d] = tmp[d] * cos[d] + tmp[(d + half) % D] * sin_signed[d];
    }
}

/* In-place exp(x - shift) over n floats; returns their sum. Exported for the tests. */
float ms_exp_shifted(float *x, int64_t n, float shift) {
    vf16 acc = (vf16){0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        vf16 e = vexp(*(vf16 *)(x + i) - shift);
        *(vf16 *)(x + i) = e;
        acc += e;
    }
    float sum = hsum(acc);
    for (; i < n; i++) sum += (x[i] = expf(x[i] - shift));
    return sum;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    vf16 acc = (vf16){0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += *(const vf16 *)(a + i) * *(const vf16 *)(b + i);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float a, const float *x, float *y, int64_t n) {   /* y += a x */
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) *(vf16 *)(y + i) += a * *(const vf16 *)(x + i);
    for (; i < n; i++) y[i] += a * x[i];
}

/* Softmax attention of one query head over n_ctx cached keys/values of one kv head. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                   int64_t n_ctx, int64_t bs, int64_t kv_head, int64_t Hkv, int64_t D, float scale,
                   float *scores, float *out) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < n_ctx; t++) {
        float s = dot(q, k_cache + ((table[t / bs] * bs + t % bs) * Hkv + kv_head) * D, D) * scale;
        scores[t] = s;
        mx = s > mx ? s : mx;
    }
    float inv = 1.0f / ms_exp_shifted(scores, n_ctx, mx);
    memset(out, 0, D * sizeof(float));
    for (int64_t t = 0; t < n_ctx; t++)
        axpy(scores[t], v_cache + ((table[t / bs] * bs + t % bs) * Hkv + kv_head) * D, out, D);
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* RoPE on q and k, every row's new k/v written to its slot, then every (row, head) attends.
 * Two phases on purpose: ALL rows' K/V of this layer are in the cache before ANY row attends, so
 * row j of a sequence (position c + j) finds rows 0..j-1 of the same step among its keys 0..c+j,
 * exactly as the PyTorch path writes the cache first and masks causally. (Writing inside the
 * parallel loop would race: row j could read row j-1's slot before that row's thread wrote it.) */
static void attention_block(const ModelPtrs *m, const LayerPtrs *L, const Scratch *s, int64_t B,
                            const int64_t *positions, const int64_t *tables, int64_t table_stride,
                            int nthreads) {
    int64_t H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, bs = m->block_size;
    int64_t qkv_dim = (H + 2 * Hkv) * D;
    for (int64_t b = 0; b < B; b++) {   /* phase 1, serial: writes never race */
        float *row = s->qkv + b * qkv_dim;
        int64_t pos = positions[b];
        rope(row, H + Hkv, D, m->cos + pos * D, m->sin_signed + pos * D);  /* q and k heads adjoin */
        int64_t slot = tables[b * table_stride + pos / bs] * bs + pos % bs;
        memcpy(L->k_cache + slot * Hkv * D, row + H * D, Hkv * D * sizeof(float));
        memcpy(L->v_cache + slot * Hkv * D, row + (H + Hkv) * D, Hkv * D * sizeof(float));
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads)   /* phase 2: reads only */
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        attend(s->qkv + b * qkv_dim + h * D, L->k_cache, L->v_cache, tables + b * table_stride,
               positions[b] + 1, bs, h / (H / Hkv), Hkv, D, m->scale, s->scores + bh * s->scores_stride,
               s->attn + b * H * D + h * D);
    }
}

/* SwiGLU: silu(gate) * up, with silu(g) = g / (1 + exp(-g)) as PyTorch computes it. */
static void silu_mul(const float *gate_up, float *out, int64_t B, int64_t inter) {
    for (int64_t b = 0; b < B; b++) {
        const float *g = gate_up + b * 2 * inter, *u = g + inter;
        float *o = out + b * inter;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16) {
            vf16 gv = *(const vf16 *)(g + i);
            *(vf16 *)(o + i) = gv / (1.0f + vexp(-gv)) * *(const vf16 *)(u + i);
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* One step over B rows (tokens; see the top of this file): embeddings in, logits of the given rows
 * out. The scratch buffers hold at least B rows, and n_logits <= B (checked in kernels/decode.py).
 * nthreads: the OpenMP team size of every parallel region (<= 0: the caller's default, PyTorch's
 * thread count). Returns the team size the regions ran with, so the caller can check it. */
int64_t ms_decode_step(const ModelPtrs *m, const Scratch *s, int64_t B, const int64_t *token_ids,
                       const int64_t *positions, const int64_t *tables, int64_t table_stride,
                       const int64_t *logit_rows, int64_t n_logits, float *logits, int64_t nthreads) {
    int64_t E = m->hidden, H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim;
    int64_t qkv_dim = (H + 2 * Hkv) * D, I = m->intermediate;
    int nt = nthreads > 0 ? (int)nthreads : omp_get_max_threads();
    for (int64_t b = 0; b < B; b++) memcpy(s->h + b * E, m->embed + token_ids[b] * E, E * sizeof(float));
    for (int64_t l = 0; l < m->num_layers; l++) {
        const LayerPtrs *L = &m->layers[l];
        ms_rms_norm(s->h, L->input_norm, s->x, B, E, m->eps);
        matmul(L->qkv, L->qkv_bias, s->x, s->qkv, B, E, qkv_dim, 0, nt);
        attention_block(m, L, s, B, positions, tables, table_stride, nt);
        matmul(L->o_proj, NULL, s->attn, s->h, B, H * D, E, 1, nt);          /* h += o_proj(attn) */
        ms_rms_norm(s->h, L->post_norm, s->x, B, E, m->eps);
        matmul(L->gate_up, NULL, s->x, s->gate_up, B, E, 2 * I, 0, nt);
        silu_mul(s->gate_up, s->act, B, I);
        matmul(L->down, NULL, s->act, s->h, B, I, E, 1, nt);                 /* h += down(act) */
    }
    for (int64_t r = 0; r < n_logits; r++)
        ms_rms_norm(s->h + logit_rows[r] * E, m->final_norm, s->x + r * E, 1, E, m->eps);
    return matmul(m->lm_head, NULL, s->x, logits, n_logits, E, m->vocab, 0, nt);
}
