/* Attention of the fused decode step (decode.c) over the paged KV cache, float32 or int8.
 *
 * Included by decode.c after its structs (ModelPtrs, LayerPtrs, Scratch) and ms_exp_shifted: every
 * function here is static, one translation unit, split only to keep each file readable.
 *
 * Work split (flash-decoding): a work item is one row's keys [c * KEY_CHUNK, (c + 1) * KEY_CHUNK)
 * of one kv head, for all G = heads / kv_heads query heads that share it (grouped-query attention).
 * - Each key and value is read from memory once per step, not once per query head: at batch 16
 *   and a context of 300 the float32 cache read per step is 220 MB, as much as the int8 weights.
 * - A batch of one still gives every thread work (one kv head per thread would leave two threads
 *   with 3 kv heads unbalanced, and a long context on one thread).
 * Each item leaves, per query head, the chunk's max score m, its sum of exp(score - m) and the
 * unnormalized sum of exp(score - m) * value; merge() rescales the chunks to their common max and
 * divides: the same softmax as one pass, computed in pieces.
 */

#define KEY_CHUNK 64   /* keys per work item: enough to amortise the item, small enough to spread */
const int64_t ms_key_chunk = KEY_CHUNK;   /* kernels/decode.py sizes the scratch with it */

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

/* The int8 KV cache (kv_cache_dtype="int8"): a key or value vector of one kv head is stored as
 * head_dim int8 codes and one float32 scale. Reading folds the scale into the score (k . q =
 * scale_k * (codes . q)) and into the value's softmax weight, so no float copy of the cache exists:
 * attention reads a quarter of fp32's bytes. */
static inline float dot_i8(const float *q, const int8_t *codes, int64_t n) {
    vf16 acc = (vf16){0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += int8x16_to_float(codes + i) * *(const vf16 *)(q + i);
    float s = hsum(acc);
    for (; i < n; i++) s += (float)codes[i] * q[i];
    return s;
}

static inline void axpy_i8(float a, const int8_t *codes, float *y, int64_t n) {   /* y += a codes */
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) *(vf16 *)(y + i) += a * int8x16_to_float(codes + i);
    for (; i < n; i++) y[i] += a * (float)codes[i];
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
    } else {
        memcpy((float *)L->k_cache + slot * Hkv * D, k, Hkv * D * sizeof(float));
        memcpy((float *)L->v_cache + slot * Hkv * D, v, Hkv * D * sizeof(float));
    }
}

/* Scores of G query heads q [G, D] against keys [t0, t1) of kv head g, into scores[j * stride + t]. */
static void chunk_scores(const ModelPtrs *m, const LayerPtrs *L, const float *q, const int64_t *slots,
                         int64_t t0, int64_t t1, int64_t g, int64_t G, float *scores, int64_t stride) {
    int64_t Hkv = m->num_kv_heads, D = m->head_dim;
    for (int64_t t = t0; t < t1; t++) {
        int64_t e = slots[t] * Hkv + g;   /* the (slot, kv head) entry of key t */
        if (m->kv_format == KV_INT8) {
            float ks = L->k_scales[e] * m->scale;
            const int8_t *k = (const int8_t *)L->k_cache + e * D;
            for (int64_t j = 0; j < G; j++) scores[j * stride + t] = dot_i8(q + j * D, k, D) * ks;
        } else {
            const float *k = (const float *)L->k_cache + e * D;
            for (int64_t j = 0; j < G; j++) scores[j * stride + t] = dot(q + j * D, k, D) * m->scale;
        }
    }
}

/* part[j] = (sum of p_t * value_t over the chunk [D floats], max, sum of p_t), p_t = exp(s_t - max). */
static void chunk_values(const ModelPtrs *m, const LayerPtrs *L, const int64_t *slots, int64_t t0,
                         int64_t t1, int64_t g, int64_t G, float *scores, int64_t stride, float *part) {
    int64_t Hkv = m->num_kv_heads, D = m->head_dim;
    for (int64_t j = 0; j < G; j++) {
        float *s = scores + j * stride, *pj = part + j * (D + 2), mx = -INFINITY;
        for (int64_t t = t0; t < t1; t++) mx = s[t] > mx ? s[t] : mx;
        pj[D] = mx;
        pj[D + 1] = ms_exp_shifted(s + t0, t1 - t0, mx);
        memset(pj, 0, D * sizeof(float));
    }
    for (int64_t t = t0; t < t1; t++) {   /* one value at a time: it stays in L1 for the G heads */
        int64_t e = slots[t] * Hkv + g;
        for (int64_t j = 0; j < G; j++) {
            float p = scores[j * stride + t];
            if (m->kv_format == KV_INT8)
                axpy_i8(p * L->v_scales[e], (const int8_t *)L->v_cache + e * D, part + j * (D + 2), D);
            else
                axpy(p, (const float *)L->v_cache + e * D, part + j * (D + 2), D);
        }
    }
}

/* out = softmax-weighted values of one (row, head) from its n_chunks partial results, `step`
 * floats apart (the chunks of one item list the G heads side by side). */
static void merge(const float *parts, int64_t n_chunks, int64_t step, int64_t D, float *out) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t c = 0; c < n_chunks; c++) mx = parts[c * step + D] > mx ? parts[c * step + D] : mx;
    memset(out, 0, D * sizeof(float));
    for (int64_t c = 0; c < n_chunks; c++) {
        const float *p = parts + c * step;
        float w = expf(p[D] - mx);   /* 1 for the chunk holding the max */
        sum += w * p[D + 1];
        axpy(w, p, out, D);
    }
    for (int64_t d = 0; d < D; d++) out[d] /= sum;
}

static inline int64_t max_chunks(const Scratch *s) { return (s->scores_stride + KEY_CHUNK - 1) / KEY_CHUNK; }

/* Every row's cache slot of each of its keys 0..pos, and the list of work items (row, kv head,
 * chunk), once per step: attention then reads slots[t] instead of dividing t by the block size
 * per key, head and layer. Returns the number of items. */
static int64_t plan_attention(const ModelPtrs *m, const Scratch *s, int64_t B, const int64_t *positions,
                              const int64_t *tables, int64_t table_stride) {
    int64_t bs = m->block_size, Hkv = m->num_kv_heads, n_items = 0, mc = max_chunks(s);
    for (int64_t b = 0; b < B; b++) {
        int64_t *out = s->slots + b * s->scores_stride, n = positions[b] + 1;
        for (int64_t t0 = 0; t0 < n; t0 += bs) {
            int64_t base = tables[b * table_stride + t0 / bs] * bs;
            for (int64_t j = 0; j < bs && t0 + j < n; j++) out[t0 + j] = base + j;
        }
        for (int64_t g = 0; g < Hkv; g++)
            for (int64_t c = 0; c * KEY_CHUNK < n; c++) s->items[n_items++] = (b * Hkv + g) * mc + c;
    }
    return n_items;
}

/* RoPE on q and k, every row's new k/v written to its slot, then the attention items, then the
 * merge of each (row, head). Writing comes first on purpose: ALL rows' K/V of this layer are in
 * the cache before ANY row attends, so row j of a sequence (position c + j) finds rows 0..j-1 of
 * the same step among its keys 0..c+j, exactly as the PyTorch path writes the cache first and
 * masks causally. (Writing inside the parallel loop would race: row j could read row j-1's slot
 * before that row's thread wrote it.) */
static void attention_block(const ModelPtrs *m, const LayerPtrs *L, const Scratch *s, int64_t B,
                            const int64_t *positions, int64_t n_items, int nthreads) {
    int64_t H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, G = H / Hkv;
    int64_t qkv_dim = (H + 2 * Hkv) * D, mc = max_chunks(s), stride = s->scores_stride;
    for (int64_t b = 0; b < B; b++) {   /* serial: writes never race */
        float *row = s->qkv + b * qkv_dim;
        int64_t pos = positions[b];
        rope(row, H + Hkv, D, m->cos + pos * D, m->sin_signed + pos * D);  /* q and k heads adjoin */
        write_kv(m, L, s->slots[b * stride + pos], row + H * D, row + (H + Hkv) * D);
    }
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)   /* reads only; the loop's end is the barrier before merge */
        for (int64_t i = 0; i < n_items; i++) {
            int64_t item = s->items[i], c = item % mc, b = item / mc / Hkv, g = item / mc % Hkv;
            int64_t t0 = c * KEY_CHUNK, n = positions[b] + 1, t1 = t0 + KEY_CHUNK < n ? t0 + KEY_CHUNK : n;
            float *scores = s->scores + (b * H + g * G) * stride;
            float *part = s->partials + ((b * Hkv + g) * mc + c) * G * (D + 2);
            chunk_scores(m, L, s->qkv + b * qkv_dim + g * G * D, s->slots + b * stride, t0, t1, g, G,
                         scores, stride);
            chunk_values(m, L, s->slots + b * stride, t0, t1, g, G, scores, stride, part);
        }
        #pragma omp for schedule(static) nowait
        for (int64_t bh = 0; bh < B * H; bh++) {
            int64_t b = bh / H, h = bh % H, g = h / G, n = positions[b] + 1;
            const float *parts = s->partials + (b * Hkv + g) * mc * G * (D + 2) + (h % G) * (D + 2);
            merge(parts, (n + KEY_CHUNK - 1) / KEY_CHUNK, G * (D + 2), D, s->attn + bh * D);
        }
    }
}
