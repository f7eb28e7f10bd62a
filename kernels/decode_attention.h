/* Attention of the fused decode step (decode.c) over the paged KV cache, float32 or int8.
 *
 * Included by decode.c after its structs (ModelPtrs, LayerPtrs, Scratch), rope and ms_exp_shifted:
 * every function here but the exported quantizer is static, one translation unit, split only to
 * keep each file readable.
 */

/* Keys and values at the register's width (dvec, decode.c): a key's dot product in two
 * accumulators, so its multiply-adds form two chains instead of one (64 floats are 8 AVX2 FMAs). */
static inline float dot(const float *a, const float *b, int64_t n) {
    dvec acc0 = (dvec){0}, acc1 = (dvec){0};
    int64_t i = 0;
    for (; i + 2 * DVEC_LANES <= n; i += 2 * DVEC_LANES) {
        acc0 = dvec_fma(acc0, dvec_load(a + i), dvec_load(b + i));
        acc1 = dvec_fma(acc1, dvec_load(a + i + DVEC_LANES), dvec_load(b + i + DVEC_LANES));
    }
    for (; i + DVEC_LANES <= n; i += DVEC_LANES) acc0 = dvec_fma(acc0, dvec_load(a + i), dvec_load(b + i));
    float s = dvec_hsum(acc0 + acc1);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float a, const float *x, float *y, int64_t n) {   /* y += a x */
    const dvec av = (dvec){0} + a;
    int64_t i = 0;
    for (; i + DVEC_LANES <= n; i += DVEC_LANES) dvec_store(y + i, dvec_fma(dvec_load(y + i), dvec_load(x + i), av));
    for (; i < n; i++) y[i] += a * x[i];
}

/* The int8 KV cache (kv_cache_dtype="int8"): a key or value vector of one kv head is stored as
 * head_dim int8 codes and one float32 scale. Reading folds the scale into the score (k . q =
 * scale_k * (codes . q)) and into the value's softmax weight, so no float copy of the cache exists:
 * attention reads a quarter of fp32's bytes. */
static inline float dot_i8(const float *q, const int8_t *codes, int64_t n) {
    dvec acc = (dvec){0};
    int64_t i = 0;
    for (; i + DVEC_LANES <= n; i += DVEC_LANES) acc = dvec_fma(acc, dvec_int8(codes + i), dvec_load(q + i));
    float s = dvec_hsum(acc);
    for (; i < n; i++) s += (float)codes[i] * q[i];
    return s;
}

static inline void axpy_i8(float a, const int8_t *codes, float *y, int64_t n) {   /* y += a codes */
    const dvec av = (dvec){0} + a;
    int64_t i = 0;
    for (; i + DVEC_LANES <= n; i += DVEC_LANES)
        dvec_store(y + i, dvec_fma(dvec_load(y + i), dvec_int8(codes + i), av));
    for (; i < n; i++) y[i] += a * (float)codes[i];
}

/* The bfloat16 KV cache (a dtype="bfloat16" engine): the same loops, each element widened. */
static inline float dot_bf16(const float *q, const uint16_t *k, int64_t n) {
    dvec acc = (dvec){0};
    int64_t i = 0;
    for (; i + DVEC_LANES <= n; i += DVEC_LANES) acc = dvec_fma(acc, dvec_weights(k, i, 1), dvec_load(q + i));
    float s = dvec_hsum(acc);
    for (; i < n; i++) s += bf16_to_float(k[i]) * q[i];
    return s;
}

static inline void axpy_bf16(float a, const uint16_t *x, float *y, int64_t n) {   /* y += a x */
    const dvec av = (dvec){0} + a;
    int64_t i = 0;
    for (; i + DVEC_LANES <= n; i += DVEC_LANES)
        dvec_store(y + i, dvec_fma(dvec_load(y + i), dvec_weights(x, i, 1), av));
    for (; i < n; i++) y[i] += a * bf16_to_float(x[i]);
}

static void store_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16(x[i]);
}

/* Quantize n vectors of D floats on write, bit for bit as kernels/triton/reference.py's
 * quantize_kv_int8 (the torch path's writer): scale = max|x| / 127 in float32 (0 for an all-zero
 * vector), code = x / max(scale, 1e-30) rounded half to even (rintf in the default rounding mode,
 * as torch.round), clamped to [-127, 127]. A true division, not a multiply by 1/scale: the two
 * round differently. Exported for tests/test_fused_quant.py. */
void ms_quantize_kv_int8(const float *x, int64_t n, int64_t D, int8_t *codes, float *scales) {
    for (int64_t v = 0; v < n; v++, x += D, codes += D) {
        float amax = 0.f;
        for (int64_t d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        float scale = amax / 127.0f, div = scale > 1e-30f ? scale : 1e-30f;
        for (int64_t d = 0; d < D; d++) {
            float c = rintf(x[d] / div);
            codes[d] = (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
        }
        scales[v] = scale;
    }
}

/* One row's new key and value (every kv head) into cache slot `slot`, quantized for an int8 cache. */
static void write_kv(const ModelPtrs *m, const LayerPtrs *L, int64_t slot, const float *k,
                     const float *v) {
    int64_t Hkv = m->num_kv_heads, D = m->head_dim;
    if (m->kv_format == KV_INT8) {
        ms_quantize_kv_int8(k, Hkv, D, (int8_t *)L->k_cache + slot * Hkv * D, L->k_scales + slot * Hkv);
        ms_quantize_kv_int8(v, Hkv, D, (int8_t *)L->v_cache + slot * Hkv * D, L->v_scales + slot * Hkv);
    } else if (m->kv_format == KV_BF16) {
        store_bf16(k, Hkv * D, (uint16_t *)L->k_cache + slot * Hkv * D);
        store_bf16(v, Hkv * D, (uint16_t *)L->v_cache + slot * Hkv * D);
    } else {
        memcpy((float *)L->k_cache + slot * Hkv * D, k, Hkv * D * sizeof(float));
        memcpy((float *)L->v_cache + slot * Hkv * D, v, Hkv * D * sizeof(float));
    }
}

/* Keys ahead whose K and V rows attend() prefetches. A (row, head) walks its keys at a stride of
 * kv_heads * head_dim (the other kv heads sit between), which the hardware prefetcher follows
 * poorly: SmolLM2-135M, batch 16, context 300, fp32 KV: attention 18.5 -> 15 ms a step (8 and 24
 * keys ahead measure the same). */
#define KV_PREFETCH_KEYS 8

static inline void prefetch_kv(const ModelPtrs *m, const LayerPtrs *L, int64_t e) {
    int64_t bytes = m->head_dim * (m->kv_format == KV_INT8 ? 1 : m->kv_format == KV_BF16 ? 2 : 4);
    for (int64_t off = 0; off < bytes; off += 64) {   /* every cache line of entry e's K and V */
        __builtin_prefetch((const char *)L->k_cache + e * bytes + off);
        __builtin_prefetch((const char *)L->v_cache + e * bytes + off);
    }
}

/* Softmax attention of one query head over n_ctx cached keys/values of one kv head. Tried and not
 * kept (SmolLM2-135M, batch 16, context 300): one work item per (row, kv head, 64 keys) serving
 * the kv head's query heads together, chunks merged flash-decoding style (1.4x slower); the
 * values summed in registers instead of axpy into `out` (no change); the query heads of a kv head
 * walking the keys together, and a row's heads walking each cache block whole (query and value
 * sums in registers, the next block prefetched, no division per key): 32 ms of a one-thread step
 * before, 34-39 ms after (CPU time). Kept: walking the keys with counters instead of dividing
 * t by the block size (33.9 -> 31.5-32.6 ms, same loop otherwise). At batch 16 this part reads 222 MB of fp32 K/V per step
 * (more than int4's weights); kv_cache_dtype="int8" reads 59 MB and takes 18 ms instead of 33
 * (benchmarks/bench_quant.py --profile-clock cpu): fewer bytes helped where reordering did not. */
static void attend(const ModelPtrs *m, const LayerPtrs *L, const float *q, const int64_t *table,
                   int64_t n_ctx, int64_t kv_head, float *scores, float *out) {
    int64_t bs = m->block_size, Hkv = m->num_kv_heads, D = m->head_dim;
    int kv_int8 = m->kv_format == KV_INT8, kv_bf16 = m->kv_format == KV_BF16;
    float mx = -INFINITY;
    /* Key t lives in block table[t / bs] at offset t % bs: walked with counters (block, offset),
     * not divided out per key (a 64-bit division costs more than the key's dot product). */
    int64_t blk = 0, off = 0, pblk = KV_PREFETCH_KEYS / bs, poff = KV_PREFETCH_KEYS % bs;
    for (int64_t t = 0; t < n_ctx; t++) {
        int64_t e = (table[blk] * bs + off) * Hkv + kv_head;   /* (slot, kv head) entry */
        if (t + KV_PREFETCH_KEYS < n_ctx)
            prefetch_kv(m, L, (table[pblk] * bs + poff) * Hkv + kv_head);
        float s = kv_int8 ? dot_i8(q, (const int8_t *)L->k_cache + e * D, D) * L->k_scales[e]
                : kv_bf16 ? dot_bf16(q, (const uint16_t *)L->k_cache + e * D, D)
                          : dot(q, (const float *)L->k_cache + e * D, D);
        scores[t] = s * m->scale;
        mx = scores[t] > mx ? scores[t] : mx;
        if (++off == bs) off = 0, blk++;
        if (++poff == bs) poff = 0, pblk++;
    }
    float inv = 1.0f / ms_exp_shifted(scores, n_ctx, mx);
    memset(out, 0, D * sizeof(float));
    blk = off = 0;
    for (int64_t t = 0; t < n_ctx; t++) {
        int64_t e = (table[blk] * bs + off) * Hkv + kv_head;
        if (kv_int8)
            axpy_i8(scores[t] * L->v_scales[e], (const int8_t *)L->v_cache + e * D, out, D);
        else if (kv_bf16)
            axpy_bf16(scores[t], (const uint16_t *)L->v_cache + e * D, out, D);
        else
            axpy(scores[t], (const float *)L->v_cache + e * D, out, D);
        if (++off == bs) off = 0, blk++;
    }
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
        write_kv(m, L, tables[b * table_stride + pos / bs] * bs + pos % bs, row + H * D,
                 row + (H + Hkv) * D);
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads)   /* phase 2: reads only */
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        attend(m, L, s->qkv + b * qkv_dim + h * D, tables + b * table_stride, positions[b] + 1,
               h / (H / Hkv), s->scores + bh * s->scores_stride, s->attn + b * H * D + h * D);
    }
}
