/* bfloat16 weights times several input rows on AMX tiles: the batched fused step's products.
 *
 * Why: a bf16 weight widened to float32 in registers (decode.c's dot_block) costs the same vector
 * multiply-adds as a float32 one. At batch 1 that is free (the step waits on DRAM), but a batch of
 * 16 rows multiplies every weight 16 times, and on 2 cores the vector units reach ~135 GFLOP/s
 * where AMX's tile multiply (TDPBF16PS, Sapphire Rapids and later) does 16 x 16 x 32 multiply-adds
 * per instruction: the batched step becomes a weight stream again, as batch 1 is.
 *
 * Roles: a tile product is C[M x N] += A[M x K] . B[K x N]. A is 16 weight rows x 32 columns,
 * loaded straight from the row-major [out, in] matrix with its row stride, so the weights need no
 * new layout. B is the input rows, transposed into AMX's pair layout (row kk holds, for each input
 * row n, the pair x[n][2kk], x[n][2kk + 1]); C is 16 output features x N input rows, float32.
 *
 * Precision: the tiles multiply bf16 by bf16, but the step's contract is float32 inputs (decode.c:
 * "widened ... so the step computes in float32"). So each input is split in two bf16 halves,
 * x = hi + lo (hi = x rounded to bf16, lo = the rest rounded again), and both are multiplied: the
 * input keeps 16 of float32's 24 mantissa bits (relative error <= 2^-17) instead of 8, at twice the
 * tile work, which is still far below the time the weights take to arrive from DRAM.
 *
 * Linux hands out AMX's tile state only to a process that asks (arch_prctl); amx_enable asks once.
 * Every thread loads its tile configuration at the start of its share and releases the tiles at its
 * end: PyTorch's oneDNN configures the same registers in the same threads between our calls.
 */
#ifndef MINSERVE_AMX_BF16_H
#define MINSERVE_AMX_BF16_H
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__) \
    && defined(__x86_64__)
#define HAVE_AMX_BF16 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16        /* weight rows (output features) per C tile: ROW_TILE */
#define AMX_K 32           /* bf16 columns per A tile row (64 bytes) */
#define AMX_MAX_N 16       /* input rows per B / C tile */
#define AMX_MIN_ROWS 2     /* fewer input rows: the vector loop (one row streams at DRAM speed) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_granted;    /* 0: not asked yet, 1: Linux granted the tile state, -1: refused */
static int amx_state;      /* 1: products use the tiles (granted and wanted) */

/* Ask Linux for the tile state once (the first call, in the caller's thread); 1 if granted.
 * want = 0 turns AMX off for this process (MINSERVE_AMX=off, and the tests' comparison). */
static int amx_enable(int want) {
    if (want && !amx_granted)
        amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    amx_state = want && amx_granted > 0;
    return amx_state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

/* Tiles 0 / 4: C (two blocks of 16 output rows), 1 / 5: A (their weights), 2 / 3: B (the hi / lo
 * halves of n input rows). */
static void amx_configure(int n) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = AMX_ROWS, cfg.colsb[0] = (uint16_t)(n * 4);
    cfg.rows[1] = AMX_ROWS, cfg.colsb[1] = AMX_K * 2;
    for (int t = 2; t <= 3; t++) cfg.rows[t] = AMX_K / 2, cfg.colsb[t] = (uint16_t)(n * 4);
    cfg.rows[4] = AMX_ROWS, cfg.colsb[4] = (uint16_t)(n * 4);
    cfg.rows[5] = AMX_ROWS, cfg.colsb[5] = AMX_K * 2;
    _tile_loadconfig(&cfg);
}

/* Every tile 16 rows x 64 bytes: the layout of the prefill kernels (bf16_gemm.c,
 * prefill_attention_amx.h), whose operands are all whole tiles. */
static inline void amx_configure_square(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* 16 floats -> their bf16 halves, a ~= hi + lo: hi is a rounded to bf16, lo the rest rounded
 * again (16 of float32's 24 mantissa bits). Also kernels/bf16_gemm.c's split products. */
static inline void split_bf16x16(__m512 a, __m256i *hi, __m256i *lo) {
    __m256bh h = _mm512_cvtneps_pbh(a);
    /* back to float32 (a bf16 is the top half of a float32) for the remainder */
    __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
    *hi = (__m256i)h;
    *lo = (__m256i)_mm512_cvtneps_pbh(a - back);
}

/* x [B, in] (float32, in % 32 == 0) -> hi and lo [B * in] bf16 each, in the B tiles' pair layout:
 * input rows in groups of 16 (the last may be smaller), and within a group of n rows, for each
 * 32-column block t: 16 pair rows of n pairs, i.e. hi[g0 * in + (t * 16 + kk) * 2n + 2b + j] =
 * bf16(x[g0 + b][32t + 2kk + j]). Done once per product, in the caller's thread. */
static void amx_pack_inputs(const float *x, int64_t B, int64_t in, uint16_t *hi, uint16_t *lo) {
    const __m512i pair = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t g0 = 0; g0 < B; g0 += AMX_MAX_N) {
        int64_t n = B - g0 < AMX_MAX_N ? B - g0 : AMX_MAX_N;
        const __m512i at = _mm512_mullo_epi32(pair, _mm512_set1_epi32((int)n));  /* pair kk's dword */
        for (int64_t b = 0; b < n; b++) {
            const float *row = x + (g0 + b) * in;
            for (int64_t t = 0; t < in / AMX_K; t++) {
                __m256i ah, al, ch, cl;
                split_bf16x16(_mm512_loadu_ps(row + t * AMX_K), &ah, &al);
                split_bf16x16(_mm512_loadu_ps(row + t * AMX_K + 16), &ch, &cl);
                /* 32 bf16 in column order are 16 dwords, pair kk in dword kk: scatter to pair rows */
                __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(ah), ch, 1);
                __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(al), cl, 1);
                int64_t at_pair0 = g0 * in + t * AMX_K * n + 2 * b;   /* pair row 0, this row */
                _mm512_i32scatter_epi32(hi + at_pair0, at, h, 4);
                _mm512_i32scatter_epi32(lo + at_pair0, at, l, 4);
            }
        }
    }
}

/* y[b, r + i] (+)= W[r + i, :] . x[b, :] for 16 rows from r (tiles = 1) or 32 (tiles = 2, a
 * compile-time constant at each call) and the n packed input rows of one group (hi, lo from
 * amx_pack_inputs, at the group's offset); the tiles are configured for n. Two weight tiles per
 * pass share each load of the inputs' halves (one scratch timing of a SmolLM2-135M step's 121
 * products at 16 rows, 2026-12-03: 25-28 ms against 31-37 with one tile per pass). While a pass
 * multiplies, it prefetches the same columns of the next_rows rows that follow its own (the next
 * pass's weights, 32 lines per column block): 32 rows read side by side are 32 streams, more
 * than the hardware prefetcher follows. With it a batch-16 bf16 step's products took 14.2-14.6 ms
 * against 17.3-18.1 (alternating runs on a slow phase of the Intel Xeon, 2026-12-05,
 * step_profile). Into L2 (prefetcht1) rather than L1: the step at 16 rows and 64 tokens of
 * context 17.2 against 17.9 ms, at 12 rows 15.5 against 16.2 (means of eight and five alternating
 * runs, 2026-12-06); the pass's own tile loads bring the lines the last step up. */
static inline __attribute__((always_inline)) void
amx_tile_rows(const uint16_t *W, const uint16_t *Wl, int64_t in, int64_t r, const uint16_t *hi,
              const uint16_t *lo, int n, float *y, int64_t ldy, int accumulate, const int tiles,
              int64_t next_rows) {
    float c[AMX_ROWS][AMX_MAX_N];
    _tile_zero(0);
    if (tiles == 2) _tile_zero(4);
    /* With a float32 weight's halves (Wl), only the hi half's next rows are prefetched: the lo
     * half's too made a batch-16 step's products 26-28 ms against 21-22, prefetching neither 27-35
     * (alternating processes, 2026-12-06). */
    const uint16_t *next = W + (r + tiles * AMX_ROWS) * in;
    for (int64_t t = 0; t < in / AMX_K; t++) {
        for (int64_t i = 0; i < next_rows; i++) __builtin_prefetch(next + i * in + t * AMX_K, 0, 2);
        _tile_loadd(2, hi + t * AMX_K * n, n * 4);
        _tile_loadd(3, lo + t * AMX_K * n, n * 4);
        _tile_loadd(1, W + r * in + t * AMX_K, in * 2);
        if (tiles == 2) _tile_loadd(5, W + (r + AMX_ROWS) * in + t * AMX_K, in * 2);
        _tile_dpbf16ps(0, 1, 2);
        if (tiles == 2) _tile_dpbf16ps(4, 5, 2);
        _tile_dpbf16ps(0, 1, 3);
        if (tiles == 2) _tile_dpbf16ps(4, 5, 3);
        if (Wl) {   /* a float32 weight's bf16 rest times the input's hi half (amx_matmul) */
            _tile_loadd(1, Wl + r * in + t * AMX_K, in * 2);
            if (tiles == 2) _tile_loadd(5, Wl + (r + AMX_ROWS) * in + t * AMX_K, in * 2);
            _tile_dpbf16ps(0, 1, 2);
            if (tiles == 2) _tile_dpbf16ps(4, 5, 2);
        }
    }
    for (int k = 0; k < tiles; k++) {
        if (k) _tile_stored(4, c, sizeof c[0]); else _tile_stored(0, c, sizeof c[0]);
        float *yk = y + r + k * AMX_ROWS;
        for (int b = 0; b < n; b++)
            for (int i = 0; i < AMX_ROWS; i++) {
                if (accumulate) yk[b * ldy + i] += c[i][b]; else yk[b * ldy + i] = c[i][b];
            }
    }
}

/* y[B, out] (+)= x[B, in] @ W.T (+ bias) for a bf16 W, in % 32 == 0, on the tiles: dense_matmul's
 * contract. xs: scratch of B * in floats (the packed halves). Threads split the 16-row tiles as
 * dense_matmul does, two at a time; rows past the last whole tile (none in SmolLM2's shapes) go a
 * plain loop. Wl non-NULL: W is a float32 weight's bf16 hi half and Wl its rest (an engine at
 * fp32_matmul_precision "high"), and the product is W xh + W xl + Wl xh, the weight streamed as two
 * bf16 halves: the same bytes as float32, at a third more tile work. */
static int64_t amx_matmul(const uint16_t *W, const uint16_t *Wl, const float *bias, const float *x,
                          float *xs, float *y, int64_t B, int64_t in, int64_t out, int accumulate,
                          int nthreads) {
    uint16_t *hi = (uint16_t *)xs, *lo = hi + B * in;
    amx_pack_inputs(x, B, in, hi, lo);
    int64_t tiles = out / AMX_ROWS, pairs = (tiles + 1) / 2, team = 1;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp master
        team = omp_get_num_threads();
        int configured = 0;   /* the group width the tiles are configured for */
        #pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t g0 = 0; g0 < B; g0 += AMX_MAX_N) {
                int n = (int)(B - g0 < AMX_MAX_N ? B - g0 : AMX_MAX_N);
                if (n != configured) amx_configure(configured = n);
                int64_t r = 2 * p * AMX_ROWS;
                const uint16_t *gh = hi + g0 * in, *gl = lo + g0 * in;
                int64_t ahead = g0 ? 0 : out - r - 2 * AMX_ROWS;   /* the next pair's rows, first pass */
                ahead = ahead < 0 ? 0 : ahead > 2 * AMX_ROWS ? 2 * AMX_ROWS : ahead;
                if (2 * p + 1 < tiles) amx_tile_rows(W, Wl, in, r, gh, gl, n, y + g0 * out, out, accumulate, 2, ahead);
                else amx_tile_rows(W, Wl, in, r, gh, gl, n, y + g0 * out, out, accumulate, 1, 0);
            }
        if (configured) _tile_release();
    }
    for (int64_t r = tiles * AMX_ROWS; r < out; r++)
        for (int64_t b = 0; b < B; b++) {
            float s = 0.f;
            for (int64_t i = 0; i < in; i++)
                s += (bf16_to_float(W[r * in + i]) + (Wl ? bf16_to_float(Wl[r * in + i]) : 0.f)) * x[b * in + i];
            if (accumulate) y[b * out + r] += s; else y[b * out + r] = s;
        }
    if (bias)
        for (int64_t b = 0; b < B; b++)
            for (int64_t r = 0; r < out; r++) y[b * out + r] += bias[r];
    return team;
}

#endif /* HAVE_AMX_BF16 */
#endif /* MINSERVE_AMX_BF16_H */
