/* Causal prefill attention of bfloat16 queries, keys and values on AMX tiles (included by
 * prefill_attention.c, after its Buffers and alloc_buffers, which this file shares).
 *
 * Why: a dtype="bfloat16" engine on a CPU with AMX sent its prefill attention to PyTorch's bf16
 * flash SDPA (~360 GFLOP/s on the Intel Xeon, 2026-12-05): a third of a 1024-token prompt's time.
 * The float32 kernel above is slower still there (its products are vector FMAs). Here both
 * products run on the tiles (TDPBF16PS: 16 x 16 x 32 multiply-adds an instruction) and only the
 * online softmax stays in vector registers, so the softmax's exps become most of the work.
 *
 * The same work items and the same online softmax as the float32 kernel (one kv head x
 * QUERY_BLOCK positions of all its query heads), TILE_KEY_BLOCK keys at a time; what changes is
 * where the products run:
 *   scores  S [16 queries x 16 keys] += Q [16 x 32 of D] . K^T [32 of D x 16 keys]: Q rows load
 *           straight from a bf16 buffer (A tile); the keys are packed once per call into the B
 *           tiles' pair layout (pack_keys);
 *   output  O [16 queries x 16 of D] += P [16 x 32 keys] . V [32 keys x 16 of D]: the softmax's
 *           probabilities as two bf16 halves, p = hi + lo (two A tiles), the values packed once
 *           into pair rows (pack_values). Each block's product goes through memory and is added
 *           to the running float32 output with the softmax's rescale, as product_rows does.
 *
 * Precision: PyTorch's bf16 flash SDPA on CPU computes in float32 and rounds once: 99.97 % of its
 * outputs are the exact attention of the bf16 inputs rounded to bf16 (1024 causal tokens against
 * float64, 2026-12-06). Here the scores are exact products of bf16 values summed in float32, and
 * scaled in float32 (scaling the queries before the tiles would round them again where the scale
 * is not a power of two: D = 128 had 60 % correctly rounded outputs that way); the probabilities
 * go into the second product as hi + lo, 16 of float32's 24 bits, at the price of twice its tile
 * work: 99.9 % of the outputs are then the exact ones rounded, the rest one bf16 step off, on
 * random inputs and on SmolLM2's own (a first version rounded the probabilities to bf16 once:
 * 62 %, and a mean error 1.4x SDPA's). The sums, the running max and the softmax's normaliser
 * stay float32.
 *
 * Tiles: 0-3 accumulate (four key groups of a score block, or four 16-column groups of the
 * output), 4 (and 5, the probabilities' lo half) hold the A operand, 6 the B operand; all are
 * configured 16 rows x 64 bytes.
 */
#ifndef MINSERVE_PREFILL_ATTENTION_AMX_H
#define MINSERVE_PREFILL_ATTENTION_AMX_H
#include "amx_bf16.h"

#ifdef HAVE_AMX_BF16
#define PAIR_TILE 256      /* dwords in a B tile: 16 pair rows x 16 columns */
/* Keys per online-softmax block (a multiple of 64). Every block stores its output products and
 * folds them into the running output with the rescale: at 64 keys (the float32 kernel's
 * KEY_BLOCK) that bookkeeping cost as much as a fifth of the kernel; 1024 causal tokens, 9 / 3
 * heads of 64, 3.0 -> 2.6 ms (scratch A/B in one process, 2026-12-06). The scores and both
 * probability halves of a block stay in L2: rows x 256 x 8 bytes. */
#define TILE_KEY_BLOCK 256

/* Keys g * 16 .. + 15 of kv head kvh -> D / 32 B tiles at kp: tile c, pair row kk, column n holds
 * K[16g + n][32c + 2kk], K[16g + n][32c + 2kk + 1] (one dword). Keys at or past L are zeros. */
static void pack_keys(const uint16_t *k, int64_t L, int64_t ldkv, int64_t D, int64_t kvh, int64_t g,
                      uint32_t *kp) {
    const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64,
                                          48, 32, 16, 0);   /* dword kk goes to pair row kk */
    for (int64_t n = 0; n < 16; n++) {
        int64_t key = 16 * g + n;
        const uint16_t *src = k + key * ldkv + kvh * D;
        for (int64_t c = 0; c < D / 32; c++) {
            __m512i pairs = key < L ? _mm512_loadu_si512(src + 32 * c) : _mm512_setzero_si512();
            _mm512_i32scatter_epi32(kp + c * PAIR_TILE + n, rows, pairs, 4);
        }
    }
}

/* Keys 32j .. 32j + 31 of kv head kvh -> D / 16 B tiles at vp: tile c, pair row kk, column n
 * holds V[32j + 2kk][16c + n], V[32j + 2kk + 1][16c + n]. Keys at or past L are zeros (their
 * probabilities are zero, and 0 x a stale NaN would not be). */
static void pack_values(const uint16_t *v, int64_t L, int64_t ldkv, int64_t D, int64_t kvh, int64_t j,
                        uint32_t *vp) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                                24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                                1, 16, 0);
    for (int64_t kk = 0; kk < 16; kk++) {
        int64_t a = 32 * j + 2 * kk;
        const uint16_t *ra = v + a * ldkv + kvh * D, *rb = ra + ldkv;
        for (int64_t c = 0; c < D / 16; c++) {
            __m256i lo = a < L ? _mm256_loadu_si256((const __m256i *)(ra + 16 * c)) : _mm256_setzero_si256();
            __m256i hi = a + 1 < L ? _mm256_loadu_si256((const __m256i *)(rb + 16 * c)) : _mm256_setzero_si256();
            __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm512_storeu_si512(vp + c * PAIR_TILE + kk * 16, _mm512_permutexvar_epi16(interleave, both));
        }
    }
}

/* The four accumulators to memory: tile t at columns 16t of dst (rows 16 apart by ld floats). */
#define STORE_FOUR(dst, ld) do { \
    _tile_stored(0, (dst), (ld) * 4); _tile_stored(1, (dst) + 16, (ld) * 4); \
    _tile_stored(2, (dst) + 32, (ld) * 4); _tile_stored(3, (dst) + 48, (ld) * 4); } while (0)
/* Accumulator t += tile 4 (A) . the B tile at b + t * PAIR_TILE * stride, for t = 0..3. */
#define PRODUCT_FOUR(b, stride) do { \
    _tile_loadd(6, (b), 64); _tile_dpbf16ps(0, 4, 6); \
    _tile_loadd(6, (b) + (stride) * PAIR_TILE, 64); _tile_dpbf16ps(1, 4, 6); \
    _tile_loadd(6, (b) + 2 * (stride) * PAIR_TILE, 64); _tile_dpbf16ps(2, 4, 6); \
    _tile_loadd(6, (b) + 3 * (stride) * PAIR_TILE, 64); _tile_dpbf16ps(3, 4, 6); } while (0)

typedef struct {        /* a thread's bf16 operands, beside its float32 Buffers */
    uint16_t *q;        /* [rows, D] the item's queries, head by head */
    float *s;           /* [rows, TILE_KEY_BLOCK] this block's scores */
    uint16_t *p, *p_lo; /* [rows, TILE_KEY_BLOCK] this block's probabilities in two bf16 halves */
    float *pv;          /* [16, 64] one output product before it joins the running output */
    float *max;         /* [rows] this block's new running max */
    __m512 *sum, *block_sum;   /* [rows] the running sums, and this block's, 16 lanes per row */
} TileBuffers;

/* Keys of key block key0 that rows r0 .. r0 + 15 (one query head, 16 positions of the item) may
 * see: the block's nk, less the causal tail past the group's last position. */
static inline int64_t group_keys(int64_t r0, int64_t first_pos, int64_t key0, int64_t nk) {
    int64_t last = first_pos + (r0 + 15) % QUERY_BLOCK - key0 + 1;
    return last < nk ? last : nk;
}

/* Scores of key block key0 for every row: tb->s [rows, TILE_KEY_BLOCK] float32, in 64-key groups
 * (four accumulator tiles) up to the keys each 16-row group may see. kh: this kv head's packed
 * keys. */
static void amx_scores(const TileBuffers *tb, const uint32_t *kh, int64_t D, int64_t rows, int64_t first_pos,
                       int64_t key0, int64_t nk) {
    int64_t DC = D / 32;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        int64_t n = group_keys(r0, first_pos, key0, nk);
        for (int64_t k0 = 0; k0 < n; k0 += 64) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t c = 0; c < DC; c++) {
                _tile_loadd(4, tb->q + r0 * D + 32 * c, D * 2);
                PRODUCT_FOUR(kh + ((key0 + k0) / 16 * DC + c) * PAIR_TILE, DC);
            }
            STORE_FOUR(tb->s + r0 * TILE_KEY_BLOCK + k0, TILE_KEY_BLOCK);
        }
    }
}

/* b->o = b->o * alpha + P . V for key block key0 (probabilities in tb->p + tb->p_lo, each
 * multiplied by the same packed values: tiles 4 and 5), 32 keys a step up to the keys each 16-row
 * group may see; a group that sees none keeps its output (its alpha is 1). vh: this kv head's
 * packed values. */
static void amx_outputs(const TileBuffers *tb, const uint32_t *vh, int64_t D, int64_t rows, int64_t first_pos,
                        int64_t key0, int64_t nk, Buffers *b) {
    int64_t DG = D / 16;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        int64_t n = group_keys(r0, first_pos, key0, nk);
        for (int64_t c0 = 0; c0 < DG && n > 0; c0 += 4) {   /* 64 output columns per pass */
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t j = 0; 32 * j < n; j++) {
                _tile_loadd(4, tb->p + r0 * TILE_KEY_BLOCK + 32 * j, TILE_KEY_BLOCK * 2);
                _tile_loadd(5, tb->p_lo + r0 * TILE_KEY_BLOCK + 32 * j, TILE_KEY_BLOCK * 2);
                const uint32_t *v0 = vh + ((key0 / 32 + j) * DG + c0) * PAIR_TILE;
                _tile_loadd(6, v0, 64); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 6);
                _tile_loadd(6, v0 + PAIR_TILE, 64); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(1, 5, 6);
                _tile_loadd(6, v0 + 2 * PAIR_TILE, 64); _tile_dpbf16ps(2, 4, 6); _tile_dpbf16ps(2, 5, 6);
                _tile_loadd(6, v0 + 3 * PAIR_TILE, 64); _tile_dpbf16ps(3, 4, 6); _tile_dpbf16ps(3, 5, 6);
            }
            STORE_FOUR(tb->pv, 64);
            for (int64_t r = 0; r < 16; r++) {
                vf16 *o = (vf16 *)(b->o + (r0 + r) * D + 16 * c0);
                const vf16 *pv = (const vf16 *)(tb->pv + r * 64);
                float a = b->alpha[r0 + r];
                for (int c = 0; c < 4; c++) o[c] = o[c] * a + pv[c];
            }
        }
    }
}

/* exp(x) for the probabilities the tiles multiply: exp(x) = 2^n * exp(r), n = round(x / ln 2),
 * |r| <= ln(2) / 2, exp(r) by its Taylor series to r^5 (relative error < 4e-6: the remainder
 * r^6 e^|r| / 720, 3.3e-6 measured; about the 2^-17 the probabilities' two bf16 halves keep),
 * 2^n applied by vscalefps (no clamps: it saturates to 0 and inf). Ten operations against
 * vexp's eighteen; the softmax's exps are most of this file's vector work. */
static inline __m512 exp_for_bf16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182f), x);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 120), _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The largest of v's lanes, in every lane: a butterfly of four shuffles (no trip through a
 * scalar register, which the row loop then waited on). */
static inline __m512 max_all_lanes(__m512 v) {
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));   /* 256-bit halves */
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));   /* 128-bit quarters */
    v = _mm512_max_ps(v, _mm512_permute_ps(v, 0x4e));         /* pairs */
    return _mm512_max_ps(v, _mm512_permute_ps(v, 0xb1));      /* neighbours */
}

/* The lanes of a 16-key vector a row may see when n keys remain visible (n > 0). */
static inline __mmask16 visible_lanes(int64_t n) {
    return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
}

/* softmax_block for the tiles: scores (tb->s, float32) -> probabilities as bf16 halves (tb->p,
 * p_lo), with the same running max and rescale per row. Keys a row may not see (causal, or past
 * the block's end) get probability 0 through a lane mask, up to the 32-key step amx_outputs reads
 * to. The running sum stays 16 lanes wide per row (tb->sum) and is added up once, at the item's
 * end; the rescale (one exp per row) runs after the rows, 16 rows to a vector. Per-row horizontal
 * sums and a libm expf per row had stalled the row loop (perf). */
static void softmax_block_bf16(Buffers *b, const TileBuffers *tb, int64_t rows, int64_t first_pos,
                               int64_t key0, int64_t nk, float scale) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < rows; r++) {
        const float *s = tb->s + r * TILE_KEY_BLOCK;
        uint16_t *dst = tb->p + r * TILE_KEY_BLOCK, *dst_lo = tb->p_lo + r * TILE_KEY_BLOCK;
        int64_t pos = first_pos + r % QUERY_BLOCK;
        int64_t visible = pos - key0 + 1 < nk ? pos - key0 + 1 : nk;   /* keys this row may see */
        int64_t written = (group_keys(r / 16 * 16, first_pos, key0, nk) + 31) / 32 * 32;
        __m512 mx = _mm512_set1_ps(b->m[r]), sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < visible; c += 16)
            mx = _mm512_mask_max_ps(mx, visible_lanes(visible - c), mx, _mm512_loadu_ps(s + c) * sc);
        mx = max_all_lanes(mx);
        int64_t c = 0;
        for (; c < visible; c += 16) {   /* p = hi + lo: 16 of float32's 24 bits reach the product */
            __m512 e = _mm512_maskz_mov_ps(visible_lanes(visible - c),
                                           exp_for_bf16(_mm512_loadu_ps(s + c) * sc - mx));
            sum += e;
            /* hi widened back in registers (reading it back from dst waited on the store) */
            __m256i hi = (__m256i)_mm512_cvtneps_pbh(e);
            __m512 widened = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16);
            _mm256_storeu_si256((__m256i *)(dst + c), hi);
            _mm256_storeu_si256((__m256i *)(dst_lo + c), (__m256i)_mm512_cvtneps_pbh(e - widened));
        }
        for (; c < written; c += 16) {   /* the rest of the 32-key step the product reads */
            _mm256_storeu_si256((__m256i *)(dst + c), _mm256_setzero_si256());
            _mm256_storeu_si256((__m256i *)(dst_lo + c), _mm256_setzero_si256());
        }
        tb->max[r] = mx[0], tb->block_sum[r] = sum;
    }
    /* alpha = exp(old max - new max): 1 for a row whose max stayed, 0 at a row's first block (no
     * old max, -inf, whose difference would be NaN). rows is a multiple of 16 (QUERY_BLOCK is). */
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        __m512 old = _mm512_loadu_ps(b->m + r0), mx = _mm512_loadu_ps(tb->max + r0);
        __mmask16 seen = _mm512_cmp_ps_mask(old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
        _mm512_storeu_ps(b->alpha + r0, _mm512_maskz_mov_ps(seen, exp_for_bf16(old - mx)));
        _mm512_storeu_ps(b->m + r0, mx);
        for (int64_t r = r0; r < r0 + 16; r++)
            tb->sum[r] = tb->sum[r] * b->alpha[r] + tb->block_sum[r];
    }
}

/* One work item (attend_item's, on the tiles): kv head kvh, positions q_offset + t0 .. of its
 * query heads. kh, vh: the kv head's packed keys and values. */
static void attend_item_amx(const uint16_t *q, const uint32_t *kh, const uint32_t *vh, uint16_t *out,
                            int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t q_offset, float scale,
                            int64_t kvh, int64_t t0, Buffers *b, const TileBuffers *tb) {
    int64_t G = H / Hkv, nq = T - t0 < QUERY_BLOCK ? T - t0 : QUERY_BLOCK;
    int64_t rows = G * QUERY_BLOCK, first_pos = q_offset + t0, last_pos = first_pos + nq - 1;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < QUERY_BLOCK; i++) {
            uint16_t *dst = tb->q + (g * QUERY_BLOCK + i) * D;
            const uint16_t *src = q + ((t0 + (i < nq ? i : 0)) * H + kvh * G + g) * D;
            memcpy(dst, src, D * sizeof(uint16_t));   /* unscaled: the scale goes on the float scores */
        }
    for (int64_t r = 0; r < rows; r++) b->m[r] = -INFINITY, tb->sum[r] = _mm512_setzero_ps();
    memset(b->o, 0, rows * D * sizeof(float));
    for (int64_t key0 = 0; key0 <= last_pos; key0 += TILE_KEY_BLOCK) {
        int64_t nk = last_pos + 1 - key0 < TILE_KEY_BLOCK ? last_pos + 1 - key0 : TILE_KEY_BLOCK;
        amx_scores(tb, kh, D, rows, first_pos, key0, nk);
        softmax_block_bf16(b, tb, rows, first_pos, key0, nk, scale);
        amx_outputs(tb, vh, D, rows, first_pos, key0, nk, b);
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            int64_t r = g * QUERY_BLOCK + i;
            float inv = 1.0f / _mm512_reduce_add_ps(tb->sum[r]);
            uint16_t *dst = out + ((t0 + i) * H + kvh * G + g) * D;
            for (int64_t d = 0; d < D; d += 16)
                _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(
                    _mm512_loadu_ps(b->o + r * D + d) * inv));
        }
}

static int alloc_tile_buffers(TileBuffers *tb, int64_t G, int64_t D) {
    int64_t rows = G * QUERY_BLOCK;
    void *mem = NULL;
    size_t bytes = (size_t)(rows * D + 2 * rows * TILE_KEY_BLOCK) * 2
                   + (16 * 64 + rows + 32 * rows + rows * TILE_KEY_BLOCK) * sizeof(float);
    if (posix_memalign(&mem, 64, bytes)) return 0;
    tb->pv = mem;
    tb->sum = (__m512 *)(tb->pv + 16 * 64);
    tb->block_sum = tb->sum + rows;
    tb->max = (float *)(tb->block_sum + rows);
    tb->s = tb->max + rows;
    tb->q = (uint16_t *)(tb->s + rows * TILE_KEY_BLOCK);
    tb->p = tb->q + rows * D;
    tb->p_lo = tb->p + rows * TILE_KEY_BLOCK;
    return 1;
}

/* exp_for_bf16 over n floats in place (n % 16 == 0), for tests/test_prefill_attention.py's check
 * of its error bound. */
void ms_exp_for_bf16(float *x, int64_t n) {
    for (int64_t i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp_for_bf16(_mm512_loadu_ps(x + i)));
}

/* Whether this process may use the tiles (asks Linux once); 0 where the build has no AMX. */
int64_t ms_prefill_attention_amx(void) { return amx_enable(1); }

/* ms_prefill_attention's contract for bf16 q, k, v, out; -1 also where the tiles are unavailable. */
int64_t ms_prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                  int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t q_offset,
                                  float scale, int64_t nthreads) {
    if (T < 1 || Hkv < 1 || H % Hkv || H / Hkv > MAX_GROUP || D < 64 || D % 64 || q_offset < 0
        || !amx_enable(1))
        return -1;
    int64_t blocks = (T + QUERY_BLOCK - 1) / QUERY_BLOCK, items = Hkv * blocks, failed = 0;
    int64_t L = q_offset + T, ldk = (L + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK, ldkv = Hkv * D;
    int64_t per_head = ldk * D / 2;   /* dwords of one kv head's packed keys (and values) */
    int nt = nthreads > 0 ? (int)nthreads : omp_get_max_threads();
    uint32_t *kp = NULL;
    if (posix_memalign((void **)&kp, 64, (size_t)(2 * Hkv * per_head) * sizeof(uint32_t))) return -2;
    uint32_t *vp = kp + Hkv * per_head;
    #pragma omp parallel num_threads(nt) reduction(+ : failed)
    {
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < Hkv * (ldk / 16); i++) {
            int64_t h = i / (ldk / 16), g = i % (ldk / 16);
            pack_keys(k, L, ldkv, D, h, g, kp + h * per_head + g * (D / 32) * PAIR_TILE);
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < Hkv * (ldk / 32); i++) {
            int64_t h = i / (ldk / 32), j = i % (ldk / 32);
            pack_values(v, L, ldkv, D, h, j, vp + h * per_head + j * (D / 16) * PAIR_TILE);
        }   /* the loop's barrier: every key and value is packed before any item reads one */
        Buffers b;
        TileBuffers tb;
        int ok = alloc_buffers(&b, H / Hkv, D);
        int tok = ok && alloc_tile_buffers(&tb, H / Hkv, D);
        failed += !tok;
        if (tok) amx_configure_square();
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t it = 0; it < items; it++) {
            int64_t block = blocks - 1 - it / Hkv, kvh = it % Hkv;
            if (tok)
                attend_item_amx(q, kp + kvh * per_head, vp + kvh * per_head, out, T, H, Hkv, D, q_offset,
                                scale, kvh, block * QUERY_BLOCK, &b, &tb);
        }
        if (tok) _tile_release(), free(tb.pv);
        if (ok) free(b.q);
    }
    free(kp);
    return failed ? -2 : 0;
}
#else
int64_t ms_prefill_attention_amx(void) { return 0; }
int64_t ms_prefill_attention_bf16(const void *q, const void *k, const void *v, void *out, int64_t T,
                                  int64_t H, int64_t Hkv, int64_t D, int64_t q_offset, float scale,
                                  int64_t nthreads) {
    (void)q, (void)k, (void)v, (void)out, (void)T, (void)H, (void)Hkv, (void)D, (void)q_offset;
    (void)scale, (void)nthreads;
    return -1;   /* built without AMX: the caller widens to float32 or runs SDPA */
}
#endif /* HAVE_AMX_BF16 */
#endif /* MINSERVE_PREFILL_ATTENTION_AMX_H */
