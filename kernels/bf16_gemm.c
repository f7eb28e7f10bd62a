/* bfloat16 y [T, out] = x [T, in] @ W [out, in]^T (+ bias) on AMX tiles: the PyTorch path's products
 * of many rows (prefill chunks, mixed steps) for a dtype="bfloat16" engine.
 *
 * Why: PyTorch hands a bf16 F.linear to oneDNN, which on the Intel Xeon (2026-12-06) ran a 1024-token
 * prompt's 121 products at ~1.4-1.6 TFLOP/s (torch.profiler): a plain weight tensor is reordered
 * into oneDNN's blocked layout on every call, and at 1024 rows its second thread adds little. Here
 * the weights are the tiles' A operand exactly as they lie (row-major [out, in], one 64-byte row
 * piece per tile row), so no call reorders them and no second copy exists (the fused decode step
 * reads the same tensor, kernels/amx_bf16.h); only the activations are packed, once per call.
 *
 * Roles, as in amx_bf16.h: C [16 output features x 16 tokens] += A [16 features x 32 of in] .
 * B [32 of in x 16 tokens], B in the pair layout (pair row kk holds, for each token, the pair
 * x[token][2kk], x[token][2kk + 1]: a 16 x 16 transpose of 4-byte pairs, pack_tokens). A block is
 * 32 features x 32 tokens (four C tiles, two A, two B: each tile load serves two products). C comes
 * out features-major; store_block transposes it back to token rows, adds the bias and rounds to
 * bf16 once.
 *
 * Order: tokens in chunks of CHUNK_BYTES of packed activations, which stay in each core's L2; in a
 * chunk, work items of one token block times a panel of feature blocks (panel_count), dealt to
 * the threads statically, panel by panel, so a thread's consecutive items share their panel of
 * weights (from L2) and each item writes along its tokens' output rows.
 *
 * Precision: bf16 x bf16 products summed in float32 and rounded once (what oneDNN's bf16 product
 * does), in another order: results differ from F.linear's by bf16 rounding of the sums.
 *
 * ms_bf16x3_gemm, below, is the float32 product of an engine at fp32_matmul_precision "high": the
 * same blocks and order, each operand split into two bf16 halves and three tile products summed
 * (product_block_x3), the output kept in float32.
 */
#define _DEFAULT_SOURCE   /* syscall (amx_bf16.h asks Linux for the AMX tile state) */
#define _POSIX_C_SOURCE 200112L
#include <stdlib.h>

#include "vmath.h"      /* quant_dot.h (omp.h, vf16), bf16_to_float */
#include "amx_bf16.h"   /* HAVE_AMX_BF16, amx_enable, amx_configure_square, split_bf16x16 */

#ifdef HAVE_AMX_BF16
#define CHUNK_BYTES (1 << 20)   /* packed tokens per chunk: half of a core's L2 on the Xeon */
#define PANEL_BYTES (3 << 19)   /* weights per panel (panel_count): 1.5 MiB */

/* Rows r of a 16 x 16 matrix of 4-byte elements -> its columns, in registers (the usual three
 * rounds: 32-bit, 64-bit and 128-bit interleaves). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; j++) {   /* elements 2j and 2j + 1 of four rows */
            r[i + 2 * j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
            r[i + 2 * j + 1] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
        }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* Tokens g0 .. g0 + 15 of x [T, in] -> in / 32 B tiles at p (tile t, pair row kk, column n: the
 * pair x[g0 + n][32t + 2kk .. + 1]). Tokens at or past T are zeros. */
static void pack_tokens(const uint16_t *x, int64_t T, int64_t in, int64_t g0, uint32_t *p) {
    for (int64_t t = 0; t < in / 32; t++) {
        __m512i r[16];
        for (int n = 0; n < 16; n++)
            r[n] = g0 + n < T ? _mm512_loadu_si512(x + (g0 + n) * in + 32 * t) : _mm512_setzero_si512();
        transpose16(r);
        for (int kk = 0; kk < 16; kk++) _mm512_storeu_si512(p + t * 256 + kk * 16, r[kk]);
    }
}

/* c [2][16 features][16 tokens] (two C tiles: features f0 .. f0 + 31) -> y rows tok0 .. (< T),
 * columns f0 .. f0 + 31, plus the bias: rounded to bf16 into y16, or kept float32 in y32 (the
 * split product's; the other pointer is NULL). */
static void store_block(float c[2][16][16], uint16_t *y16, float *y32, int64_t out, int64_t T, int64_t tok0,
                        int64_t f0, const float *bias) {
    __m512i lo[16], hi[16];
    for (int i = 0; i < 16; i++) lo[i] = _mm512_load_si512(c[0][i]), hi[i] = _mm512_load_si512(c[1][i]);
    transpose16(lo);
    transpose16(hi);
    __m512 b0 = bias ? _mm512_loadu_ps(bias + f0) : _mm512_setzero_ps();
    __m512 b1 = bias ? _mm512_loadu_ps(bias + f0 + 16) : _mm512_setzero_ps();
    for (int n = 0; n < 16 && tok0 + n < T; n++) {
        __m512 v0 = _mm512_castsi512_ps(lo[n]) + b0, v1 = _mm512_castsi512_ps(hi[n]) + b1;
        int64_t at = (tok0 + n) * out + f0;
        if (y32) _mm512_storeu_ps(y32 + at, v0), _mm512_storeu_ps(y32 + at + 16, v1);
        else _mm512_storeu_si512(y16 + at, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
}

/* The four accumulator tiles of a 32 x 32 block -> its outputs (store_block). */
static void finish_block(uint16_t *y16, float *y32, int64_t out, int64_t T, int64_t tok0, int64_t f0,
                         const float *bias) {
    float c[2][2][16][16] __attribute__((aligned(64)));
    _tile_stored(0, c[0][0], 64); _tile_stored(1, c[0][1], 64);
    _tile_stored(2, c[1][0], 64); _tile_stored(3, c[1][1], 64);
    store_block(c[0], y16, y32, out, T, tok0, f0, bias);
    store_block(c[1], y16, y32, out, T, tok0 + 16, f0, bias);
}

/* One block: features f0 .. f0 + 31 times the 32 packed tokens at b0 (tokens tok0 ..). */
static void product_block(const uint16_t *W, int64_t in, int64_t out, const uint32_t *b0, int64_t T,
                          int64_t tok0, int64_t f0, const float *bias, uint16_t *y) {
    const uint16_t *w0 = W + f0 * in, *w1 = w0 + 16 * in;
    const uint32_t *b1 = b0 + 16 * in / 2;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t t = 0; t < in / 32; t++) {
        _tile_loadd(4, w0 + 32 * t, in * 2);
        _tile_loadd(5, w1 + 32 * t, in * 2);
        _tile_loadd(6, b0 + 256 * t, 64);
        _tile_loadd(7, b1 + 256 * t, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
    }
    finish_block(y, NULL, out, T, tok0, f0, bias);
}

/* Tokens g0 .. g0 + 15 of float32 x [T, in] -> the pair-layout B tiles of their two bf16 halves,
 * x = hi + lo (hi = x rounded to bf16, lo = the rest rounded again: 16 of float32's 24 mantissa
 * bits), at ph and pl as pack_tokens lays them out. */
static void pack_tokens_split(const float *x, int64_t T, int64_t in, int64_t g0, uint32_t *ph, uint32_t *pl) {
    for (int64_t t = 0; t < in / 32; t++) {
        __m512i h[16], l[16];
        for (int n = 0; n < 16; n++) {
            const float *row = x + (g0 + n < T ? g0 + n : 0) * in + 32 * t;   /* past T: zeros below */
            __m256i ah, al, bh, bl;
            split_bf16x16(g0 + n < T ? _mm512_loadu_ps(row) : _mm512_setzero_ps(), &ah, &al);
            split_bf16x16(g0 + n < T ? _mm512_loadu_ps(row + 16) : _mm512_setzero_ps(), &bh, &bl);
            h[n] = _mm512_inserti64x4(_mm512_castsi256_si512(ah), bh, 1);
            l[n] = _mm512_inserti64x4(_mm512_castsi256_si512(al), bl, 1);
        }
        transpose16(h);
        transpose16(l);
        for (int kk = 0; kk < 16; kk++) {
            _mm512_storeu_si512(ph + t * 256 + kk * 16, h[kk]);
            _mm512_storeu_si512(pl + t * 256 + kk * 16, l[kk]);
        }
    }
}

/* One float32 block from three bf16 products: W x = Wh xh + Wl xh + Wh xl (+ Wl xl, below the
 * rest's rounding, dropped). Ordered so that 8 tile loads serve the 12 products: Wl with xh,
 * then Wh over the same xh, then xl under the same Wh. */
static void product_block_x3(const uint16_t *Wh, const uint16_t *Wl, int64_t in, int64_t out,
                             const uint32_t *bh0, const uint32_t *bl0, int64_t T, int64_t tok0, int64_t f0,
                             const float *bias, float *y) {
    const uint16_t *h0 = Wh + f0 * in, *h1 = h0 + 16 * in, *l0 = Wl + f0 * in, *l1 = l0 + 16 * in;
    const uint32_t *bh1 = bh0 + 16 * in / 2, *bl1 = bl0 + 16 * in / 2;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t t = 0; t < in / 32; t++) {
        _tile_loadd(4, l0 + 32 * t, in * 2);
        _tile_loadd(5, l1 + 32 * t, in * 2);
        _tile_loadd(6, bh0 + 256 * t, 64);
        _tile_loadd(7, bh1 + 256 * t, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, h0 + 32 * t, in * 2);
        _tile_loadd(5, h1 + 32 * t, in * 2);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(6, bl0 + 256 * t, 64);
        _tile_loadd(7, bl1 + 256 * t, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
    }
    finish_block(NULL, y, out, T, tok0, f0, bias);
}

/* How many panels the fblocks feature blocks are cut into for a chunk of tblocks token blocks.
 * A work item is one token block times one panel's feature blocks, in feature order, so the
 * item's outputs are written along each token's row; and its panel of weights, at most
 * PANEL_BYTES, is read from L2 by the item after it. More panels where there would be fewer than
 * four items a thread. Against the earlier order (each feature block over all token blocks), in
 * alternating runs of the four SmolLM2 shapes at 256 and 1024 rows: 3-21 % faster
 * (2026-12-06). row_bytes: one feature's weights (both halves for the split product). */
static int64_t panel_count(int64_t fblocks, int64_t tblocks, int64_t row_bytes, int nt) {
    int64_t cap = PANEL_BYTES / (32 * row_bytes), want = fblocks * tblocks / (4 * nt);
    int64_t per = want < cap ? want : cap;
    if (per < 1) per = 1;
    return (fblocks + per - 1) / per;
}

/* Both products' shared driver: the tokens packed once (bf16 x, or float32 x split into two
 * halves when Wl is given), then chunks of them in L2, each dealt out as panels of feature blocks
 * (panel_count). Wl NULL: bf16 x, W, y (y16). Wl given: float32 x and y (y32), W = Wh + Wl. */
static int64_t tile_gemm(const uint16_t *W, const uint16_t *Wl, const void *x, const float *bias, uint16_t *y16,
                         float *y32, int64_t T, int64_t in, int64_t out, int64_t nthreads) {
    if (T < 1 || in < 32 || in % 32 || out < 32 || out % 32 || !amx_enable(1)) return -1;
    int halves = Wl ? 2 : 1;
    int64_t padded = (T + 31) / 32 * 32, fblocks = out / 32, half = padded * in / 2;
    uint32_t *packed = NULL;   /* the tokens' hi (or only) half, then their lo half */
    if (posix_memalign((void **)&packed, 64, (size_t)(halves * half) * sizeof(uint32_t))) return -2;
    int nt = nthreads > 0 ? (int)nthreads : omp_get_max_threads();
    int64_t chunk = CHUNK_BYTES / (2 * halves * in) / 32 * 32;   /* a chunk's packed tokens in L2 */
    chunk = chunk < 32 ? 32 : chunk;
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < padded / 16; g++) {
            uint32_t *p = packed + 16 * g * in / 2;
            if (Wl) pack_tokens_split((const float *)x, T, in, 16 * g, p, p + half);
            else pack_tokens((const uint16_t *)x, T, in, 16 * g, p);
        }
        amx_configure_square();   /* after the loop's barrier: every token is packed */
        for (int64_t c0 = 0; c0 < padded; c0 += chunk) {
            int64_t tblocks = (padded - c0 < chunk ? padded - c0 : chunk) / 32;
            int64_t panels = panel_count(fblocks, tblocks, 2 * halves * in, nt), per = (fblocks + panels - 1) / panels;
            #pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < panels * tblocks; i++) {   /* a panel's blocks for one token block */
                int64_t tok0 = c0 + i % tblocks * 32, f0 = i / tblocks * per;
                const uint32_t *p = packed + tok0 * in / 2;
                for (int64_t f = f0; f < f0 + per && f < fblocks; f++) {
                    if (Wl) product_block_x3(W, Wl, in, out, p, p + half, T, tok0, f * 32, bias, y32);
                    else product_block(W, in, out, p, T, tok0, f * 32, bias, y16);
                }
            }
        }
        _tile_release();
    }
    free(packed);
    return 0;
}

/* Whether this process may use the tiles (asks Linux once). */
int64_t ms_bf16_gemm_available(void) { return amx_enable(1); }

/* y = x @ W^T (+ bias): 0 on success, -1 for shapes it does not take (in or out not a multiple
 * of 32, no tiles), -2 out of memory. nthreads <= 0: the OpenMP default (PyTorch's count). */
int64_t ms_bf16_gemm(const uint16_t *W, const uint16_t *x, const float *bias, uint16_t *y, int64_t T,
                     int64_t in, int64_t out, int64_t nthreads) {
    return tile_gemm(W, NULL, x, bias, y, NULL, T, in, out, nthreads);
}

/* float32 y = x @ W^T (+ bias) from W's two bf16 halves Wh, Wl (W = Wh + Wl, as x is split in
 * pack_tokens_split): three bf16 products summed in float32, about 16 mantissa bits of each
 * operand where float32 has 24. Returns as ms_bf16_gemm. */
int64_t ms_bf16x3_gemm(const uint16_t *Wh, const uint16_t *Wl, const float *x, const float *bias, float *y,
                       int64_t T, int64_t in, int64_t out, int64_t nthreads) {
    if (!Wl) return -1;
    return tile_gemm(Wh, Wl, x, bias, NULL, y, T, in, out, nthreads);
}
#else
int64_t ms_bf16_gemm_available(void) { return 0; }
int64_t ms_bf16_gemm(const void *W, const void *x, const float *bias, void *y, int64_t T, int64_t in,
                     int64_t out, int64_t nthreads) {
    (void)W, (void)x, (void)bias, (void)y, (void)T, (void)in, (void)out, (void)nthreads;
    return -1;   /* built without AMX: the caller runs F.linear */
}
int64_t ms_bf16x3_gemm(const void *Wh, const void *Wl, const float *x, const float *bias, float *y, int64_t T,
                       int64_t in, int64_t out, int64_t nthreads) {
    (void)Wh, (void)Wl, (void)x, (void)bias, (void)y, (void)T, (void)in, (void)out, (void)nthreads;
    return -1;
}
#endif /* HAVE_AMX_BF16 */
