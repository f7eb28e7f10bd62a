/* Attention of the fused decode step (decode.c) over the paged KV cache: float32, bfloat16 or int8.
 *
 * Included by decode.c after its structs (ModelPtrs, LayerPtrs, Scratch), rope and ms_exp_shifted:
 * every function here but the exported quantizer is static, one translation unit, split only to
 * keep each file readable.
 */

/* The int8 KV cache (kv_cache_dtype="int8"): a key or value vector of one kv head is stored as
 * head_dim int8 codes and one float32 scale. Reading folds the scale into the score (k . q =
 * scale_k * (codes . q)) and into the value's softmax weight, so no float copy of the cache exists:
 * attention reads a quarter of fp32's bytes. The bfloat16 cache (a dtype="bfloat16" engine) is
 * widened element by element as it is read. Both at the register's width (dvec, decode.c). */

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

/* Keys ahead that attention prefetches: the keys' K vectors while it scores them, their V
 * vectors while it sums them (each pass its own: V fetched during the key pass is evicted again
 * before the value pass at long contexts). A (row, kv head) walks its keys at a stride of
 * kv_heads * head_dim (the other kv heads sit between), which the hardware prefetcher follows
 * poorly: SmolLM2-135M, batch 16, context 300, fp32 KV: attention 18.5 -> 15 ms a step (8 and 24
 * keys ahead measure the same). K and V each in its own pass, on the AVX2 EPYC (2026-12-05, two
 * threads, fp32 KV, medians of 24 steps, alternating runs): batch 16 at 1000 tokens, with the
 * row-wide walk below, 70-73 -> 56-62 ms; batch 1 at 1000 tokens 7.7-8.7 -> 6.1-7.6 ms. */
#define KV_PREFETCH_KEYS 8

static inline void prefetch_span(const char *p, int64_t bytes) {   /* every cache line of it */
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

static inline void prefetch_entry(const ModelPtrs *m, const void *cache, int64_t e) {
    int64_t bytes = m->head_dim * (m->kv_format == KV_INT8 ? 1 : m->kv_format == KV_BF16 ? 2 : 4);
    prefetch_span((const char *)cache + e * bytes, bytes);
}

/* The query heads that share a kv head (GQA: SmolLM2-135M has 3 per kv head) attend together:
 * each key and value vector is read once for all of them, not once per head. ATTN_GROUP query
 * heads at most per pass; a model with more per kv head takes several passes. */
#define ATTN_GROUP 4
/* Row-wide attention (attend_row_group): query heads of one row at most, and rows per thread that
 * a step needs for it (fewer rows, e.g. batch 1, split each row by kv head to use the team). */
#define ROW_HEADS_MAX 128
#define ROW_ITEMS_PER_THREAD 4

/* Element i.. of a cached K or V vector as floats, in the cache's format (int8: the codes; the
 * caller applies the vector's scale). fmt and G below are constants at every call. */
static inline __attribute__((always_inline)) dvec kv_load(const void *v, int64_t i, const int fmt) {
    if (fmt == KV_INT8) return dvec_int8((const int8_t *)v + i);
    if (fmt == KV_BF16) return dvec_weights(v, i, 1);
    return dvec_load((const float *)v + i);
}
static inline __attribute__((always_inline)) float kv_elem(const void *v, int64_t i, const int fmt) {
    if (fmt == KV_INT8) return (float)((const int8_t *)v)[i];
    if (fmt == KV_BF16) return bf16_to_float(((const uint16_t *)v)[i]);
    return ((const float *)v)[i];
}

/* s[h] = q_h . k for the G query heads at q (D floats apart). */
static inline __attribute__((always_inline)) void
key_dots(const void *k, const float *q, int64_t D, const int G, const int fmt, float *s) {
    dvec acc[ATTN_GROUP];
    for (int h = 0; h < G; h++) acc[h] = (dvec){0};
    int64_t i = 0;
    for (; i + DVEC_LANES <= D; i += DVEC_LANES) {
        dvec kv = kv_load(k, i, fmt);
        for (int h = 0; h < G; h++) acc[h] = dvec_fma(acc[h], kv, dvec_load(q + h * D + i));
    }
    for (int h = 0; h < G; h++) {
        s[h] = dvec_hsum(acc[h]);
        for (int64_t j = i; j < D; j++) s[h] += kv_elem(k, j, fmt) * q[h * D + j];
    }
}

/* out_h += p[h] v for the G heads' outputs at out (D floats apart). */
static inline __attribute__((always_inline)) void
value_sums(const void *v, const float *p, int64_t D, const int G, const int fmt, float *out) {
    dvec pv[ATTN_GROUP];
    for (int h = 0; h < G; h++) pv[h] = (dvec){0} + p[h];
    int64_t i = 0;
    for (; i + DVEC_LANES <= D; i += DVEC_LANES) {
        dvec vv = kv_load(v, i, fmt);
        for (int h = 0; h < G; h++)
            dvec_store(out + h * D + i, dvec_fma(dvec_load(out + h * D + i), vv, pv[h]));
    }
    for (int h = 0; h < G; h++)
        for (int64_t j = i; j < D; j++) out[h * D + j] += p[h] * kv_elem(v, j, fmt);
}

/* Softmax attention of G query heads (q: G x D floats) over n_ctx cached keys/values of one kv
 * head; scores: G rows, sstride floats apart; out: G x D. Key t lives in block table[t / bs] at
 * offset t % bs: walked with counters (block, offset), not divided out per key (a 64-bit division
 * costs more than the key's dot product). Tried and not kept (batch 16, context 300, on the
 * AVX-512 host, one head at a time then): one work item per (row, kv head, 64 keys), chunks merged
 * flash-decoding style (1.4x slower); the values summed in registers instead of into `out` (no
 * change). Heads walking the keys together, one read of each vector per group: on the AVX2-only
 * EPYC attention at batch 16 / 300 tokens went from 42-48 to 27 ms a step (alternating runs). */
static inline __attribute__((always_inline)) void
attend_group(const ModelPtrs *m, const LayerPtrs *L, const float *q, const int64_t *table,
             int64_t n_ctx, int64_t kv_head, float *scores, int64_t sstride, float *out,
             const int G, const int fmt) {
    int64_t bs = m->block_size, Hkv = m->num_kv_heads, D = m->head_dim;
    int64_t elt = fmt == KV_INT8 ? 1 : fmt == KV_BF16 ? 2 : 4;
    const char *kc = (const char *)L->k_cache, *vc = (const char *)L->v_cache;
    float mx[ATTN_GROUP], s[ATTN_GROUP], inv[ATTN_GROUP];
    for (int h = 0; h < G; h++) mx[h] = -INFINITY;
    int64_t blk = 0, off = 0, pblk = KV_PREFETCH_KEYS / bs, poff = KV_PREFETCH_KEYS % bs;
    for (int64_t t = 0; t < n_ctx; t++) {
        int64_t e = (table[blk] * bs + off) * Hkv + kv_head;   /* (slot, kv head) entry */
        if (t + KV_PREFETCH_KEYS < n_ctx)
            prefetch_entry(m, L->k_cache, (table[pblk] * bs + poff) * Hkv + kv_head);
        key_dots(kc + e * D * elt, q, D, G, fmt, s);
        float scale = fmt == KV_INT8 ? m->scale * L->k_scales[e] : m->scale;
        for (int h = 0; h < G; h++) {
            float v = scores[h * sstride + t] = s[h] * scale;
            mx[h] = v > mx[h] ? v : mx[h];
        }
        if (++off == bs) off = 0, blk++;
        if (++poff == bs) poff = 0, pblk++;
    }
    for (int h = 0; h < G; h++) inv[h] = 1.0f / ms_exp_shifted(scores + h * sstride, n_ctx, mx[h]);
    memset(out, 0, G * D * sizeof(float));
    blk = off = 0, pblk = KV_PREFETCH_KEYS / bs, poff = KV_PREFETCH_KEYS % bs;
    for (int64_t t = 0; t < n_ctx; t++) {
        int64_t e = (table[blk] * bs + off) * Hkv + kv_head;
        if (t + KV_PREFETCH_KEYS < n_ctx)
            prefetch_entry(m, L->v_cache, (table[pblk] * bs + poff) * Hkv + kv_head);
        if (++poff == bs) poff = 0, pblk++;
        float vs = fmt == KV_INT8 ? L->v_scales[e] : 1.0f;
        for (int h = 0; h < G; h++) s[h] = scores[h * sstride + t] * vs;
        value_sums(vc + e * D * elt, s, D, G, fmt, out);
        if (++off == bs) off = 0, blk++;
    }
    for (int h = 0; h < G; h++)
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv[h];
}

/* CALL(g, fmt) with the group size G and the cache's format m->kv_format as compile-time
 * constants (one specialized copy of the walk each: its inner loops unroll over the heads). */
#define WITH_CONSTANT_G_AND_FORMAT(CALL) do { \
        switch (G) { \
        case 1: FORMAT_CASES(CALL, 1) break; \
        case 2: FORMAT_CASES(CALL, 2) break; \
        case 3: FORMAT_CASES(CALL, 3) break; \
        default: FORMAT_CASES(CALL, ATTN_GROUP) \
        } } while (0)
#define FORMAT_CASES(CALL, g) switch (m->kv_format) { \
        case KV_INT8: CALL(g, KV_INT8); break; \
        case KV_BF16: CALL(g, KV_BF16); break; \
        default: CALL(g, KV_F32); }

static void attend(const ModelPtrs *m, const LayerPtrs *L, const float *q, const int64_t *table,
                   int64_t n_ctx, int64_t kv_head, float *scores, int64_t sstride, float *out, int G) {
#define ATTEND(g, f) attend_group(m, L, q, table, n_ctx, kv_head, scores, sstride, out, g, f)
    WITH_CONSTANT_G_AND_FORMAT(ATTEND);
#undef ATTEND
}

/* Every kv head of one row walks the keys together (the GQA groups of attend_group, one group per
 * kv head, G = query heads per kv head). A slot keeps its Hkv key vectors side by side, and a
 * block's slots follow each other, so the row reads each block of K (then of V) as one forward
 * stream; one work item per (row, kv head) reads the same bytes as Hkv walks at a stride of
 * Hkv * D, each taking a third of every line group (SmolLM2-135M), which the hardware prefetcher
 * follows poorly. Same arithmetic per head, in the same order, as attend_group: the same bits.
 * Measured on the AVX2 EPYC (2026-12-05, two threads, fp32 KV, batch 16, medians of 24 steps,
 * three alternating runs, /tmp scratch around FusedDecoder.step_profile): attention 31-34 -> 25-28
 * ms a step at 300 tokens, 88-102 -> 70-78 ms at 1000 (before each pass prefetched its own). */
static inline __attribute__((always_inline)) void
attend_row_group(const ModelPtrs *m, const LayerPtrs *L, const float *q, const int64_t *table,
                 int64_t n_ctx, float *scores, int64_t sstride, float *out, const int G,
                 const int fmt) {
    int64_t bs = m->block_size, Hkv = m->num_kv_heads, D = m->head_dim, H = Hkv * G;
    int64_t elt = fmt == KV_INT8 ? 1 : fmt == KV_BF16 ? 2 : 4, slot_bytes = Hkv * D * elt;
    const char *kc = (const char *)L->k_cache, *vc = (const char *)L->v_cache;
    float mx[ROW_HEADS_MAX], s[ATTN_GROUP];
    for (int64_t h = 0; h < H; h++) mx[h] = -INFINITY;
    int64_t blk = 0, off = 0, pblk = KV_PREFETCH_KEYS / bs, poff = KV_PREFETCH_KEYS % bs;
    for (int64_t t = 0; t < n_ctx; t++) {
        int64_t slot = table[blk] * bs + off;
        if (t + KV_PREFETCH_KEYS < n_ctx)
            prefetch_span(kc + (table[pblk] * bs + poff) * slot_bytes, slot_bytes);
        for (int64_t g = 0; g < Hkv; g++) {
            int64_t e = slot * Hkv + g;
            key_dots(kc + e * D * elt, q + g * G * D, D, G, fmt, s);
            float scale = fmt == KV_INT8 ? m->scale * L->k_scales[e] : m->scale;
            for (int h = 0; h < G; h++) {
                float v = scores[(g * G + h) * sstride + t] = s[h] * scale;
                mx[g * G + h] = v > mx[g * G + h] ? v : mx[g * G + h];
            }
        }
        if (++off == bs) off = 0, blk++;
        if (++poff == bs) poff = 0, pblk++;
    }
    float inv[ROW_HEADS_MAX];
    for (int64_t h = 0; h < H; h++) inv[h] = 1.0f / ms_exp_shifted(scores + h * sstride, n_ctx, mx[h]);
    memset(out, 0, H * D * sizeof(float));
    blk = off = 0, pblk = KV_PREFETCH_KEYS / bs, poff = KV_PREFETCH_KEYS % bs;
    for (int64_t t = 0; t < n_ctx; t++) {
        int64_t slot = table[blk] * bs + off;
        if (t + KV_PREFETCH_KEYS < n_ctx)
            prefetch_span(vc + (table[pblk] * bs + poff) * slot_bytes, slot_bytes);
        if (++poff == bs) poff = 0, pblk++;
        for (int64_t g = 0; g < Hkv; g++) {
            int64_t e = slot * Hkv + g;
            float vs = fmt == KV_INT8 ? L->v_scales[e] : 1.0f;
            for (int h = 0; h < G; h++) s[h] = scores[(g * G + h) * sstride + t] * vs;
            value_sums(vc + e * D * elt, s, D, G, fmt, out + g * G * D);
        }
        if (++off == bs) off = 0, blk++;
    }
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv[h];
}

static void attend_row(const ModelPtrs *m, const LayerPtrs *L, const float *q, const int64_t *table,
                       int64_t n_ctx, float *scores, int64_t sstride, float *out, int G) {
#define ATTEND(g, f) attend_row_group(m, L, q, table, n_ctx, scores, sstride, out, g, f)
    WITH_CONSTANT_G_AND_FORMAT(ATTEND);
#undef ATTEND
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
    /* phase 2, reads only. Rows enough to keep every thread busy (ROW_ITEMS_PER_THREAD each), and
     * each kv head's query heads one group: one work item per row, every kv head together
     * (attend_row_group says why); dynamic, as rows' contexts differ. Else one work item per
     * (row, kv head, group of its query heads). */
    int64_t per_kv = H / Hkv, passes = (per_kv + ATTN_GROUP - 1) / ATTN_GROUP;
    if (per_kv <= ATTN_GROUP && H <= ROW_HEADS_MAX && B >= ROW_ITEMS_PER_THREAD * nthreads) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t b = 0; b < B; b++)
            attend_row(m, L, s->qkv + b * qkv_dim, tables + b * table_stride, positions[b] + 1,
                       s->scores + b * H * s->scores_stride, s->scores_stride, s->attn + b * H * D,
                       (int)per_kv);
        return;
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t item = 0; item < B * Hkv * passes; item++) {
        int64_t b = item / (Hkv * passes), g = item / passes % Hkv, pass = item % passes;
        int64_t h = g * per_kv + pass * ATTN_GROUP;   /* the pass's first query head */
        int G = (int)(per_kv - pass * ATTN_GROUP < ATTN_GROUP ? per_kv - pass * ATTN_GROUP : ATTN_GROUP);
        attend(m, L, s->qkv + b * qkv_dim + h * D, tables + b * table_stride, positions[b] + 1, g,
               s->scores + (b * H + h) * s->scores_stride, s->scores_stride,
               s->attn + b * H * D + h * D, G);
    }
}
