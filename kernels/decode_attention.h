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

/* The PyTorch path's writes into an int8 cache (kernels/paged_attention.py's write_kv_int8): T
 * tokens' vectors x [T, Hkv, D], quantized as ms_quantize_kv_int8 does (bit for bit the torch
 * reference), straight into their slots of codes [slots, Hkv, D] and scales [slots, Hkv]; in
 * PyTorch the rounding, the clamp and two index_copy_ took ~0.4 s of a 10-s mixed workload. The
 * slots are checked on the Python side. */
void ms_write_kv_int8(const float *x, int64_t T, int64_t Hkv, int64_t D, const int64_t *slots,
                      int8_t *codes, float *scales) {
    #pragma omp parallel for schedule(static) if (T * Hkv * D >= 65536)
    for (int64_t t = 0; t < T; t++)
        ms_quantize_kv_int8(x + t * Hkv * D, Hkv, D, codes + slots[t] * Hkv * D, scales + slots[t] * Hkv);
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
    for (int64_t off = 0; off < bytes; off += 64) PREFETCH_AHEAD(p + off);
}

/* The query heads that share a kv head (GQA: SmolLM2-135M has 3 per kv head) attend together:
 * each key and value vector is read once for all of them, not once per head. ATTN_GROUP query
 * heads at most per pass; a model with more per kv head takes several passes. */
#define ATTN_GROUP 4
/* Row-wide attention (attend_row): query heads of one row at most, and rows per thread that
 * a step needs for it (fewer rows, e.g. batch 1, split each row by kv head to use the team). */
#define ROW_HEADS_MAX 128
#define ROW_ITEMS_PER_THREAD 4

/* Bytes per cached K or V element in the cache's format. */
static inline int64_t kv_elt(const int fmt) { return fmt == KV_INT8 ? 1 : fmt == KV_BF16 ? 2 : 4; }

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

/* Lane j of the result = dvec_hsum(a[j]), with the same additions in the same order (so the same
 * bits): DVEC_LANES keys' dot products reduced together by one tree of shuffles, instead of one
 * horizontal sum each, a chain of dependent shuffles per key that left the score pass waiting on
 * latency. Level by level the tree adds lane i and lane i + 8, then i + 4, i + 2, i + 1 of every
 * key, as hsum does; the lanes come out interleaved and one permute puts key j in lane j. */
#if DVEC_LANES == 16 && defined(__AVX512F__)
static inline dvec dvec_hsum_lanes(const dvec a[16]) {
    __m512 c[8], e[4], g[2];
    for (int j = 0; j < 8; j++)   /* keys 2j, 2j+1: lanes 0-7 and 8-15, i + (i + 8) */
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4((__m512)a[2 * j], (__m512)a[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4((__m512)a[2 * j], (__m512)a[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++)   /* keys 4j .. 4j+3, one per 128-bit lane: i + (i + 4) */
        e[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++)   /* i + (i + 2) */
        g[j] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * j], e[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(e[2 * j], e[2 * j + 1], 0xEE));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
    /* r[4k + m] holds key 4m + k */
    return (dvec)_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}
/* v > mx ? v : mx in each lane (a NaN score leaves the max alone, as the one-key loop does) */
static inline dvec dvec_max(dvec mx, dvec v) { return (dvec)_mm512_max_ps((__m512)v, (__m512)mx); }
#elif DVEC_LANES == 8
static inline dvec dvec_hsum_lanes(const dvec a[8]) {
    __m256 c[4], e[2];
    for (int j = 0; j < 4; j++)   /* keys 2j, 2j+1: lanes 0-3 and 4-7, i + (i + 4) */
        c[j] = _mm256_add_ps(_mm256_permute2f128_ps((__m256)a[2 * j], (__m256)a[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps((__m256)a[2 * j], (__m256)a[2 * j + 1], 0x31));
    for (int j = 0; j < 2; j++)   /* i + (i + 2) */
        e[j] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * j], c[2 * j + 1], 0x44),
                             _mm256_shuffle_ps(c[2 * j], c[2 * j + 1], 0xEE));
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(e[0], e[1], 0x88), _mm256_shuffle_ps(e[0], e[1], 0xDD));
    /* r[4l + m] holds key 2m + l */
    return (dvec)_mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline dvec dvec_max(dvec mx, dvec v) { return (dvec)_mm256_max_ps((__m256)v, (__m256)mx); }
#else
static inline dvec dvec_hsum_lanes(const dvec a[DVEC_LANES]) {
    dvec r;
    for (int j = 0; j < DVEC_LANES; j++) r[j] = dvec_hsum(a[j]);
    return r;
}
static inline dvec dvec_max(dvec mx, dvec v) {
    for (int j = 0; j < DVEC_LANES; j++) mx[j] = v[j] > mx[j] ? v[j] : mx[j];
    return mx;
}
#endif

/* A walk over one row's keys through its block table: key t lives in block table[t / bs] at
 * offset t % bs, followed with counters (block, offset), not divided out per key (a 64-bit
 * division costs more than the key's dot product); a second pair of counters runs
 * KV_PREFETCH_KEYS ahead. key_walk_run gives the slots of the next n keys and prefetches, for
 * each, the span of `bytes` at `first` bytes into the slot that far ahead (the kv heads a pass
 * reads sit side by side in a slot). */
typedef struct { int64_t blk, off, pblk, poff; } KeyWalk;

static inline KeyWalk key_walk(int64_t bs) {
    return (KeyWalk){0, 0, KV_PREFETCH_KEYS / bs, KV_PREFETCH_KEYS % bs};
}

static inline __attribute__((always_inline)) void
key_walk_run(KeyWalk *w, const int64_t *table, int64_t bs, int64_t t, int n, int64_t n_ctx,
             const char *cache, int64_t slot_bytes, int64_t first, int64_t bytes, int64_t *slots) {
    for (int j = 0; j < n; j++) {
        slots[j] = table[w->blk] * bs + w->off;
        if (t + j + KV_PREFETCH_KEYS < n_ctx)
            prefetch_span(cache + (table[w->pblk] * bs + w->poff) * slot_bytes + first, bytes);
        if (++w->off == bs) w->off = 0, w->blk++;
        if (++w->poff == bs) w->poff = 0, w->pblk++;
    }
}

/* DVEC_LANES keys (entries ents[j]: slot * Hkv + kv head) scored against the G heads at q:
 * scores[h * sstride + j] = kscale[j] * (q_h . k_j), exactly what key_dots and the scale give one
 * key at a time, and mxv[h] the lane-wise running max. */
static inline __attribute__((always_inline)) void
score_key_lanes(const char *kc, const int64_t *ents, const float *q, const float *kscale, int64_t D,
                float *scores, int64_t sstride, dvec *mxv, const int G, const int fmt) {
    const int64_t elt = kv_elt(fmt);
    dvec part[ATTN_GROUP][DVEC_LANES];
    for (int j = 0; j < DVEC_LANES; j++) {
        const char *k = kc + ents[j] * D * elt;
        dvec acc[ATTN_GROUP];
        for (int h = 0; h < G; h++) acc[h] = (dvec){0};
        for (int64_t i = 0; i < D; i += DVEC_LANES) {
            dvec kv = kv_load(k, i, fmt);
            for (int h = 0; h < G; h++) acc[h] = dvec_fma(acc[h], kv, dvec_load(q + h * D + i));
        }
        for (int h = 0; h < G; h++) part[h][j] = acc[h];
    }
    dvec scale = dvec_load(kscale);
    for (int h = 0; h < G; h++) {
        dvec sc = dvec_hsum_lanes(part[h]) * scale;
        dvec_store(scores + h * sstride, sc);
        mxv[h] = dvec_max(mxv[h], sc);
    }
}

/* The score pass of one row over n_ctx keys, for its kv heads g0 .. g0 + ng - 1 (query heads
 * (g - g0) * G + h at q, D floats apart): scores[((g - g0) * G + h) * sstride + t] = scale * q . k
 * and mx[] each head's largest. Keys DVEC_LANES at a time (score_key_lanes) while whole groups
 * remain and D is a multiple of the width, then one at a time (key_dots); the same bits either
 * way. */
static inline __attribute__((always_inline)) void
score_pass(const ModelPtrs *m, const LayerPtrs *L, const float *q, const int64_t *table,
           int64_t n_ctx, int64_t g0, int64_t ng, float *scores, int64_t sstride, float *mx,
           const int G, const int fmt) {
    int64_t bs = m->block_size, Hkv = m->num_kv_heads, D = m->head_dim;
    int64_t elt = kv_elt(fmt), t = 0;
    int64_t slot_bytes = Hkv * D * elt, first = g0 * D * elt, span = ng * D * elt;
    const char *kc = (const char *)L->k_cache;
    KeyWalk w = key_walk(bs);
    float s[ATTN_GROUP];
    for (int64_t h = 0; h < ng * G; h++) mx[h] = -INFINITY;
    if (D % DVEC_LANES == 0 && n_ctx >= DVEC_LANES) {
        dvec mxv[ROW_HEADS_MAX];
        for (int64_t h = 0; h < ng * G; h++) mxv[h] = (dvec){0} - INFINITY;
        for (; t + DVEC_LANES <= n_ctx; t += DVEC_LANES) {
            int64_t slots[DVEC_LANES], ents[DVEC_LANES];
            float ks[DVEC_LANES];
            key_walk_run(&w, table, bs, t, DVEC_LANES, n_ctx, kc, slot_bytes, first, span, slots);
            for (int64_t g = 0; g < ng; g++) {
                for (int j = 0; j < DVEC_LANES; j++) {
                    ents[j] = slots[j] * Hkv + g0 + g;
                    ks[j] = fmt == KV_INT8 ? m->scale * L->k_scales[ents[j]] : m->scale;
                }
                score_key_lanes(kc, ents, q + g * G * D, ks, D, scores + g * G * sstride + t, sstride,
                                mxv + g * G, G, fmt);
            }
        }
        for (int64_t h = 0; h < ng * G; h++)
            for (int j = 0; j < DVEC_LANES; j++) mx[h] = mxv[h][j] > mx[h] ? mxv[h][j] : mx[h];
    }
    for (; t < n_ctx; t++) {
        int64_t slot;
        key_walk_run(&w, table, bs, t, 1, n_ctx, kc, slot_bytes, first, span, &slot);
        for (int64_t g = 0; g < ng; g++) {
            int64_t e = slot * Hkv + g0 + g;
            key_dots(kc + e * D * elt, q + g * G * D, D, G, fmt, s);
            float scale = fmt == KV_INT8 ? m->scale * L->k_scales[e] : m->scale;
            for (int h = 0; h < G; h++) {
                float v = scores[(g * G + h) * sstride + t] = s[h] * scale;
                mx[g * G + h] = v > mx[g * G + h] ? v : mx[g * G + h];
            }
        }
    }
}

#define KEY_RUN 16
#define VALUE_CHUNKS (DVEC_LANES == 16 ? 4 : 2)   /* AVX2's 16 registers: G x 2 sums, not G x 4 */

/* value_key_run's sums for `chunks` vectors of D from column i (chunks: a constant at each call). */
static inline __attribute__((always_inline)) void
value_chunks(const char *vc, const int64_t *ents, int n, const float *p, int64_t D, float *out,
             int64_t i, const int chunks, const int G, const int fmt) {
    const int64_t elt = kv_elt(fmt);
    dvec acc[ATTN_GROUP][VALUE_CHUNKS];
    for (int h = 0; h < G; h++)
        for (int c = 0; c < chunks; c++) acc[h][c] = dvec_load(out + h * D + i + c * DVEC_LANES);
    for (int j = 0; j < n; j++) {
        const char *v = vc + ents[j] * D * elt;
        dvec vv[VALUE_CHUNKS];
        for (int c = 0; c < chunks; c++) vv[c] = kv_load(v, i + c * DVEC_LANES, fmt);
        for (int h = 0; h < G; h++) {
            dvec pj = (dvec){0} + p[h * KEY_RUN + j];
            for (int c = 0; c < chunks; c++) acc[h][c] = dvec_fma(acc[h][c], vv[c], pj);
        }
    }
    for (int h = 0; h < G; h++)
        for (int c = 0; c < chunks; c++) dvec_store(out + h * D + i + c * DVEC_LANES, acc[h][c]);
}

/* out_h += p_j v_j over the keys of one run (entries ents[j], p_j = p[h * KEY_RUN + j]) for the G
 * heads at out (D floats apart), in key order: the same sums as one key at a time, with the G
 * outputs held in registers across the run instead of loaded and stored at every key. Up to
 * VALUE_CHUNKS vectors of D at once, keys inner: each key's p_j is broadcast once for them all,
 * and the G x VALUE_CHUNKS sums are independent chains of multiply-adds (one chunk at a time, the
 * G chains of 16 dependent multiply-adds waited on their latency; docs/performance/vllm-zen4.md
 * has the profile and the timings). Each sum still adds its keys in order: the same bits. */
static inline __attribute__((always_inline)) void
value_key_run(const char *vc, const int64_t *ents, int n, const float *p, int64_t D, float *out,
              const int G, const int fmt) {
    const int64_t elt = kv_elt(fmt);
    int64_t i = 0;
    for (; i + VALUE_CHUNKS * DVEC_LANES <= D; i += VALUE_CHUNKS * DVEC_LANES)
        value_chunks(vc, ents, n, p, D, out, i, VALUE_CHUNKS, G, fmt);
    for (; i + DVEC_LANES <= D; i += DVEC_LANES)
        value_chunks(vc, ents, n, p, D, out, i, 1, G, fmt);
    for (; i < D; i++)
        for (int j = 0; j < n; j++)
            for (int h = 0; h < G; h++) out[h * D + i] += p[h * KEY_RUN + j] * kv_elem(vc + ents[j] * D * elt, i, fmt);
}

/* Softmax attention of one row's query heads over its n_ctx cached keys and values, for kv heads
 * g0 .. g0 + ng - 1 (G query heads each, (g - g0) * G + h at q and out, D floats apart; scores:
 * one row of sstride floats per head). attend() takes one kv head per work item; attend_row()
 * every kv head of the row at once: a slot keeps its Hkv key vectors side by side and a block's
 * slots follow each other, so the row reads each block of K (then of V) as one forward stream,
 * where Hkv walks at a stride of Hkv * D each take a third of every line group (SmolLM2-135M),
 * which the hardware prefetcher follows poorly. Both compute each head in the same order: the
 * same bits. Measured on the AVX2 EPYC (2026-12-05, two threads, fp32 KV, batch 16, medians of 24
 * steps, three alternating runs): the row-wide walk took attention 31-34 -> 25-28 ms a step at 300
 * tokens, 88-102 -> 70-78 ms at 1000. Both passes go in runs of keys (score_key_lanes,
 * value_key_run). On the Intel Xeon with AMX (2026-12-05, bf16 KV, batch 16, FusedDecoder.
 * step_profile in a scratch script, medians of 15 steps), the runs, register shuffles in hsum
 * and phase 1 split over the team (attention_block) took attention from 16.2 to 14.2 ms a step
 * at 600 tokens, 8.5 -> 7.3 at 300 and 3.2 -> 1.9 at 64; what remains at long contexts waits on
 * memory (perf: the prefetches' line fills), and 8, 24 or 2 keys ahead measure the same. Tried
 * and not kept earlier (batch 16, context 300, AVX-512, one head at a time then): one work item
 * per (row, kv head, 64 keys), merged flash-decoding style (1.4x slower). */
static inline __attribute__((always_inline)) void
attend_heads(const ModelPtrs *m, const LayerPtrs *L, const float *q, const int64_t *table,
             int64_t n_ctx, int64_t g0, int64_t ng, float *scores, int64_t sstride, float *out,
             const int G, const int fmt) {
    int64_t bs = m->block_size, Hkv = m->num_kv_heads, D = m->head_dim, H = ng * G;
    int64_t elt = kv_elt(fmt);
    const char *vc = (const char *)L->v_cache;
    float mx[ROW_HEADS_MAX], inv[ROW_HEADS_MAX], p[ATTN_GROUP * KEY_RUN];
    score_pass(m, L, q, table, n_ctx, g0, ng, scores, sstride, mx, G, fmt);
    for (int64_t h = 0; h < H; h++) inv[h] = 1.0f / ms_exp_shifted(scores + h * sstride, n_ctx, mx[h]);
    memset(out, 0, H * D * sizeof(float));
    KeyWalk w = key_walk(bs);
    for (int64_t t = 0; t < n_ctx; t += KEY_RUN) {
        int n = n_ctx - t < KEY_RUN ? (int)(n_ctx - t) : KEY_RUN;
        int64_t slots[KEY_RUN], ents[KEY_RUN];
        key_walk_run(&w, table, bs, t, n, n_ctx, vc, Hkv * D * elt, g0 * D * elt, ng * D * elt, slots);
        for (int64_t g = 0; g < ng; g++) {
            for (int j = 0; j < n; j++) {
                ents[j] = slots[j] * Hkv + g0 + g;
                float vs = fmt == KV_INT8 ? L->v_scales[ents[j]] : 1.0f;
                for (int h = 0; h < G; h++) p[h * KEY_RUN + j] = scores[(g * G + h) * sstride + t + j] * vs;
            }
            value_key_run(vc, ents, n, p, D, out + g * G * D, G, fmt);
        }
    }
    for (int64_t h = 0; h < H; h++)
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
#define ATTEND(g, f) attend_heads(m, L, q, table, n_ctx, kv_head, 1, scores, sstride, out, g, f)
    WITH_CONSTANT_G_AND_FORMAT(ATTEND);
#undef ATTEND
}

static void attend_row(const ModelPtrs *m, const LayerPtrs *L, const float *q, const int64_t *table,
                       int64_t n_ctx, float *scores, int64_t sstride, float *out, int G) {
#define ATTEND(g, f) attend_heads(m, L, q, table, n_ctx, 0, m->num_kv_heads, scores, sstride, out, g, f)
    WITH_CONSTANT_G_AND_FORMAT(ATTEND);
#undef ATTEND
}

/* Phase 2 of attention_block, and the whole of ms_paged_attention: every row b (query heads at
 * q + b * q_stride, out at out + b * H * D) attends to its keys 0 .. positions[b] through its block
 * table (tables + b * table_stride). Called inside a parallel region: its loops are shared out over
 * the team, and it reads only. Rows enough to keep every thread busy (ROW_ITEMS_PER_THREAD each),
 * and each kv head's query heads one group: one work item per row, every kv head together
 * (attend_heads says why); dynamic, as rows' contexts differ. Else one work item per (row, kv
 * head, group of its query heads). */
static void attend_rows(const ModelPtrs *m, const LayerPtrs *L, const float *q, int64_t q_stride, int64_t B,
                        const int64_t *positions, const int64_t *tables, int64_t table_stride,
                        float *scores, int64_t scores_stride, float *out, int nthreads) {
    int64_t H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim;
    int64_t per_kv = H / Hkv, passes = (per_kv + ATTN_GROUP - 1) / ATTN_GROUP;
    if (per_kv <= ATTN_GROUP && H <= ROW_HEADS_MAX && B >= ROW_ITEMS_PER_THREAD * nthreads) {
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t b = 0; b < B; b++)
            attend_row(m, L, q + b * q_stride, tables + b * table_stride, positions[b] + 1,
                       scores + b * H * scores_stride, scores_stride, out + b * H * D, (int)per_kv);
    } else {
        #pragma omp for schedule(static) nowait
        for (int64_t item = 0; item < B * Hkv * passes; item++) {
            int64_t b = item / (Hkv * passes), g = item / passes % Hkv, pass = item % passes;
            int64_t h = g * per_kv + pass * ATTN_GROUP;   /* the pass's first query head */
            int G = (int)(per_kv - pass * ATTN_GROUP < ATTN_GROUP ? per_kv - pass * ATTN_GROUP : ATTN_GROUP);
            attend(m, L, q + b * q_stride + h * D, tables + b * table_stride, positions[b] + 1, g,
                   scores + (b * H + h) * scores_stride, scores_stride, out + b * H * D + h * D, G);
        }
    }
}

/* RoPE on q and k, every row's new k/v written to its slot, then every (row, head) attends.
 * Two phases on purpose: ALL rows' K/V of this layer are in the cache before ANY row attends, so
 * row j of a sequence (position c + j) finds rows 0..j-1 of the same step among its keys 0..c+j,
 * exactly as the PyTorch path writes the cache first and masks causally. The barrier between
 * the two loops is that guarantee. (Writing inside the attention loop would race: row j could
 * read row j-1's slot before that row's thread wrote it.) Phase 1 is split over the team too:
 * every row writes its own slot. Serial, it left one core spinning while the other rotated and
 * wrote 16 rows, in each of 30 layers (perf, Intel Xeon, batch 16). */
static inline void rope_and_write_row(const ModelPtrs *m, const LayerPtrs *L, const Scratch *s, int64_t b,
                                      const int64_t *positions, const int64_t *tables, int64_t table_stride) {
    int64_t H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, bs = m->block_size;
    float *row = s->qkv + b * (H + 2 * Hkv) * D;
    int64_t pos = positions[b];
    rope(row, H + Hkv, D, m->cos + pos * D, m->sin_signed + pos * D);  /* q and k heads adjoin */
    write_kv(m, L, tables[b * table_stride + pos / bs] * bs + pos % bs, row + H * D, row + (H + Hkv) * D);
}

static void attention_block(const ModelPtrs *m, const LayerPtrs *L, const Scratch *s, int64_t B,
                            const int64_t *positions, const int64_t *tables, int64_t table_stride,
                            int nthreads) {
    int64_t qkv_dim = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)   /* phase 1; the loop's end is a barrier */
            rope_and_write_row(m, L, s, b, positions, tables, table_stride);
        attend_rows(m, L, s->qkv, qkv_dim, B, positions, tables, table_stride, s->scores, s->scores_stride,
                    s->attn, nthreads);
    }
}

/* attention_block for the batch-invariant mode (FlashPlan, in decode.c): the same phase 1, then
 * each group of sequences with equal query counts through the paged flash kernel, its queries
 * gathered into one buffer and its output put back in the step's rows. Returns 0, or 1 when the
 * kernel declined a group (nothing is left half-written that a caller would read: the step fails). */
static int flash_attention_block(const ModelPtrs *m, const LayerPtrs *L, const Scratch *s, int64_t B,
                                 const int64_t *positions, const int64_t *tables, int64_t table_stride,
                                 int nthreads) {
    const FlashPlan *f = s->flash;
    if (m->kv_format != KV_F32 && m->kv_format != KV_INT8) return 1;   /* the kernel reads these two */
    int64_t HD = m->num_heads * m->head_dim, qkv_dim = HD + 2 * m->num_kv_heads * m->head_dim;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < B; b++)
        rope_and_write_row(m, L, s, b, positions, tables, table_stride);
    for (int64_t g = 0; g < f->n_groups; g++) {
        int64_t first = f->groups[3 * g], n = f->groups[3 * g + 1], T = f->groups[3 * g + 2];
        for (int64_t i = 0; i < n; i++)
            for (int64_t t = 0; t < T; t++)
                memcpy(f->q + (i * T + t) * HD, s->qkv + (f->first_row[first + i] + t) * qkv_dim,
                       HD * sizeof(float));
        if (f->attend(f->q, L->k_cache, L->v_cache, L->k_scales, L->v_scales, m->kv_format == KV_INT8,
                      m->block_size, f->tables + first * f->table_stride, f->table_stride,
                      f->context_lens + first, n, T, m->num_heads, m->num_kv_heads, m->head_dim,
                      m->scale, f->out, nthreads) != 0)
            return 1;
        for (int64_t i = 0; i < n; i++)
            memcpy(s->attn + f->first_row[first + i] * HD, f->out + i * T * HD, T * HD * sizeof(float));
    }
    return 0;
}

/* Attention of B query rows (float32 [B, H, D]) over a paged KV cache whose new keys and values
 * are already written, for the PyTorch path's decode rows (kernels/paged_attention.py): the fused
 * step's own attention, so a mixed step's decode rows read the cache in place instead of
 * gathering a copy of their blocks for SDPA. Row b sees keys 0 .. positions[b] through tables +
 * b * table_stride (block ids). The cache: [blocks, block_size, Hkv, D] in kv_format (KV_F32,
 * KV_BF16, or KV_INT8 with its scales [blocks, block_size, Hkv]). out: float32 [B, H, D]. Returns
 * 0; -1 for what it does not take (H not a multiple of Hkv, more than ROW_HEADS_MAX heads); -2
 * out of memory. nthreads <= 0: the OpenMP default. */
int64_t ms_paged_attention(const float *q, int64_t B, int64_t H, int64_t Hkv, int64_t D, void *k_cache,
                           void *v_cache, float *k_scales, float *v_scales, int64_t kv_format,
                           int64_t block_size, const int64_t *tables, int64_t table_stride,
                           const int64_t *positions, float scale, float *out, int64_t nthreads) {
    if (B < 1 || Hkv < 1 || H % Hkv || H > ROW_HEADS_MAX || D < 1 || block_size < 1
        || (kv_format == KV_INT8 && (!k_scales || !v_scales)))
        return -1;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = positions[b] + 1 > longest ? positions[b] + 1 : longest;
    float *scores = malloc((size_t)(B * H * longest) * sizeof(float));
    if (!scores) return -2;
    ModelPtrs m = {0};
    m.num_heads = H, m.num_kv_heads = Hkv, m.head_dim = D, m.block_size = block_size;
    m.kv_format = kv_format, m.scale = scale;
    LayerPtrs L = {0};
    L.k_cache = k_cache, L.v_cache = v_cache, L.k_scales = k_scales, L.v_scales = v_scales;
    int nt = nthreads > 0 ? (int)nthreads : omp_get_max_threads();
    #pragma omp parallel num_threads(nt)
    attend_rows(&m, &L, q, H * D, B, positions, tables, table_stride, scores, longest, out, nt);
    free(scores);
    return 0;
}
