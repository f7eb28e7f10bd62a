/* The tiles W4A8 and W8A8 read at every size: a weight laid out in the integer loops' tile order,
 * once at load (ms_a8_tile; a layer with int8 activations keeps the result as `a8_tiles`,
 * minserve/quant/schemes.py), or one tile at a time per call into a per-thread buffer (a weight
 * without tiles, at 32 inputs or more). Included by quant_a8.h, in its AVX-512 VNNI section, after
 * quant_a8_packed.h (the interleaved inputs, int8's layout and pass).
 *
 * Why at load: int4_a8_tile and int8_a8_tile transpose a tile's 16 rows into vpdpbusd's lane order
 * (transpose16: 16 loads and 8 unpacks per 16 bytes of each row; int4 also its groups' scales and
 * mins into vectors, columns16) on every pass of inputs, and packing per call pays only at prefill
 * sizes. At decode sizes (1-16 input rows: one or two passes) that work is as large as the dot
 * products it feeds; laid out at load, every call reads the tiles as they lie. Scratch harness,
 * SmolLM2's shapes, int4, two threads, weights streamed from memory (40 copies cycled), 2026-12-07
 * on the Zen 4 EPYC: 576 -> 1536 at 12-16 inputs 1.20x, 1536 -> 576 1.25-1.38x, the 576 -> 49152
 * head 1.14-1.53x at 1-16 inputs; 1-8 inputs of the small layers 0.96-1.17x. Per call, int4 tiles
 * once split their nibbles into bytes (twice the bytes); split in registers as here, prefill's
 * products read the same (bench_roofline.py's kernel table: 1024 rows 500-547 GOP/s either way).
 *
 * Layout: tile after tile of 16 rows (the last tile's rows past `out` repeat its last row);
 *   int4: blocks x 4 vectors, transpose16 of the block's 16 bytes of each row (lane rr: row rr's
 *         dword j), the nibbles split in registers as they are read; then groups x 2 vectors, the
 *         16 rows' scales and their mins (int4_group_levels);
 *   int8: blocks x 8 vectors, int8_a8_pack's (each code + 128); the row scales stay in w->scales.
 * The same bytes as the row-major weight (a copy beside it: the other paths still read that). The
 * integer sums and the order of the float operations are those of int4_a8_tile and int8_a8_tile,
 * so the outputs are bit for bit the same (tests/test_quant_a8.py).
 */
#ifndef MINSERVE_QUANT_A8_TILES_H
#define MINSERVE_QUANT_A8_TILES_H

/* Bytes of tiles below which a call prefetches at any input count (a8_tiled_rows). */
#define A8_PREFETCH_SHORT ((int64_t)4 << 20)

/* 64-byte vectors of one tile. */
static inline int64_t a8_tile_vectors(int bits, int64_t in, int64_t group) {
    return bits == 4 ? 4 * (in / A8_BLOCK) + 2 * (in / group) : 8 * (in / A8_BLOCK);
}

/* Tile t of w (rows 16t .. 16t + 15) into dst (a8_tile_vectors vectors, 64-byte aligned). */
static void a8_tile_one(const QWeight *w, int64_t t, __m512i *dst) {
    const uint8_t *rows[ROW_TILE];
    int64_t row_ids[ROW_TILE];
    int64_t r1 = t * ROW_TILE + ROW_TILE < w->out ? t * ROW_TILE + ROW_TILE : w->out;
    tile_rows(w->codes, w->bits == 4 ? w->in / 2 : w->in, t * ROW_TILE, r1, rows, row_ids);
    if (w->bits == 8) {
        int8_a8_pack(w, rows, dst);
        return;
    }
    const int64_t blocks = w->in / A8_BLOCK;
    for (int64_t k = 0; k < blocks; k++) {
        __m512i T[4];
        transpose16(rows, k * (A8_BLOCK / 2), T);
        for (int j = 0; j < 4; j++) _mm512_store_si512(dst + 4 * k + j, T[j]);
    }
    int4_group_levels(w, row_ids, (__m512 *)(dst + 4 * blocks));
}

/* Every tile of w into tiles ((out + 15) / 16 * a8_tile_vectors vectors, 64-byte aligned). */
static void a8_tile_weight(const QWeight *w, __m512i *tiles, int nthreads) {
    const int64_t n = (w->out + ROW_TILE - 1) / ROW_TILE, per = a8_tile_vectors(w->bits, w->in, w->group);
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < n; t++) a8_tile_one(w, t, tiles + t * per);
}

/* A block's int4 sums into the pass's float sums, in int4_a8_tile's order: each int32 sum
 * converted, times its group's scale times the input's block scale, then the min times the
 * block's float sum. d, xsum: the block's values for the pass's inputs. */
static inline __attribute__((always_inline)) void
int4_scale_block(const int nb, const __m512i *dot, __m512 s, __m512 m, const float *d, const float *xsum,
                 __m512 *out) {
    for (int b = 0; b < nb; b++) {
        __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(d[b]));
        out[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[b]), sd, out[b]);
        out[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[b]), out[b]);
    }
}

/* One pass of nb inputs (a constant at each call site) over an int4 tile: out[b] = its 16 rows for
 * input b, before the bias (int8 tiles are int8_a8_pack's: int8_a8_pass reads them). codes, d,
 * xsum: the pass's interleaved inputs (a8_interleave). */
static inline __attribute__((always_inline)) void
a8_tiled_pass(const int nb, const __m512i *tile, int64_t blocks, int64_t per_group, const int32_t *codes,
              const float *d, const float *xsum, __m512 out[A8_PACKED_PASS], int64_t prefetch_bytes) {
    enum { P = A8_PACKED_PASS };
    const __m512 *sm = (const __m512 *)(tile + 4 * blocks);
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int b = 0; b < nb; b++) out[b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        if (prefetch_bytes) prefetch_share((const uint8_t *)tile, prefetch_bytes, k, blocks);
        __m512i dot[P];
        for (int b = 0; b < nb; b++) dot[b] = _mm512_setzero_si512();
        const int32_t *a = codes + k * 8 * P;
        _Pragma("GCC unroll 4")   /* unrolled, the pass's sums stay in registers */
        for (int j = 0; j < 4; j++) {   /* dword j: low nibbles meet group j, high ones group 4 + j */
            const __m512i T = _mm512_load_si512(tile + 4 * k + j);
            const __m512i lo = _mm512_and_si512(T, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(T, 4), nibble);
            for (int b = 0; b < nb; b++) dot[b] = _mm512_dpbusd_epi32(dot[b], lo, _mm512_set1_epi32(a[j * P + b]));
            for (int b = 0; b < nb; b++) dot[b] = _mm512_dpbusd_epi32(dot[b], hi, _mm512_set1_epi32(a[(4 + j) * P + b]));
        }
        int4_scale_block(nb, dot, sm[2 * (k / per_group)], sm[2 * (k / per_group) + 1], d + k * P, xsum + k * P, out);
    }
}

/* One pass of `left` inputs over a tile in the pass size just above it (12, 8, 4, 2 or 1: batch 1
 * computes one row, not four); each size and format compiles into registers of its own. */
#define A8_TILED_PASS(n) (bits == 4 ? a8_tiled_pass(n, tile, blocks, per_group, codes, d, xsum, out, pf) \
                                    : int8_a8_pass(n, tile, blocks, codes, d, out, pf))
static inline __attribute__((always_inline)) void
a8_tiled_pass_of(const int bits, int64_t left, const __m512i *tile, int64_t blocks, int64_t per_group,
                 const int32_t *codes, const float *d, const float *xsum, __m512 out[A8_PACKED_PASS],
                 int64_t pf) {
    if (left > 8) A8_TILED_PASS(A8_PACKED_PASS);
    else if (left > 4) A8_TILED_PASS(8);
    else if (left > 2) A8_TILED_PASS(4);
    else if (left > 1) A8_TILED_PASS(2);
    else A8_TILED_PASS(1);
}
#undef A8_TILED_PASS

/* Tile t of y's rows for all B inputs from `tile` (tile t laid out), passes of up to
 * A8_PACKED_PASS; the first pass prefetches `ahead` bytes two tiles on (0: none). act: the inputs
 * as quantize_a8 left them (int8's shifts); p: interleaved. */
static void a8_tile_rows(const QWeight *w, const __m512i *tile, int64_t t, Activations8 act, A8Passes p,
                         float *y, int64_t B, int accumulate, int64_t ahead) {
    const int64_t blocks = w->in / A8_BLOCK, per_group = w->bits == 4 ? w->group / A8_BLOCK : 1, P = A8_PACKED_PASS;
    const int64_t r0 = t * ROW_TILE, r1 = r0 + ROW_TILE < w->out ? r0 + ROW_TILE : w->out;
    __mmask16 mask = r1 - r0 >= 16 ? 0xFFFF : (__mmask16)((1u << (r1 - r0)) - 1);
    const __m512 scale = w->bits == 8 ? _mm512_maskz_loadu_ps(mask, w->scales + r0) : _mm512_setzero_ps();
    for (int64_t pass = 0; pass < p.passes; pass++) {
        __m512 out[A8_PACKED_PASS];
        const int32_t *codes = p.codes + pass * blocks * 8 * P;
        const float *d = p.d + pass * blocks * P, *xsum = p.xsum + pass * blocks * P;
        int nb = B - pass * P < P ? (int)(B - pass * P) : (int)P;
        int64_t pf = pass == 0 ? ahead : 0;
        if (w->bits == 4) {
            a8_tiled_pass_of(4, nb, tile, blocks, per_group, codes, d, xsum, out, pf);
        } else {
            a8_tiled_pass_of(8, nb, tile, blocks, 1, codes, d, xsum, out, pf);
            for (int b = 0; b < nb; b++)
                out[b] = _mm512_mul_ps(_mm512_sub_ps(out[b], _mm512_set1_ps(act.shift[pass * P + b])), scale);
        }
        store_tile(out, w->bias, r0, r1, y + pass * P * w->out, w->out, nb, accumulate);
    }
}

/* Tile t through the tiles laid out at load (w->tiles). The tile A8_PREFETCH_TILES ahead is
 * fetched during the first pass, where more than 4 inputs make a pass long enough to cover it
 * (scratch harness, weights streamed from memory: 1.2-1.4x at 8-16 inputs), or where the whole
 * weight is a short stream (at most A8_PREFETCH_SHORT), on which the hardware prefetcher has no
 * time to get going. A long stream at 1-4 inputs (an LM head) it follows better alone. SmolLM2
 * W4A8 on the Zen 4 EPYC, the fused step's clock, rounds alternating with the build before
 * (2026-12-07): prefetching at every size took the int4 layers (at most 1.3 MB each) at one row
 * from 4.1-4.8 to 3.2 ms a step, but the 28-MB int8 head from 0.74-0.89 to 0.92-1.05 ms; with
 * this rule the layers at 1, 2 and 4 rows were faster in 3, 4 and 4 rounds of 4 (e.g. 4 rows
 * 5.1-6.8 -> 4.1-5.8 ms). */
static void a8_tiled_rows(const QWeight *w, int64_t t, Activations8 act, A8Passes p, float *y, int64_t B,
                          int accumulate) {
    const int64_t tile_bytes = a8_tile_vectors(w->bits, w->in, w->group) * 64;
    const int64_t tiles = (w->out + ROW_TILE - 1) / ROW_TILE;
    const int64_t ahead = (B > 4 || tiles * tile_bytes <= A8_PREFETCH_SHORT) && t + A8_PREFETCH_TILES < tiles
                          ? tile_bytes : 0;
    a8_tile_rows(w, (const __m512i *)w->tiles + t * (tile_bytes / 64), t, act, p, y, B, accumulate, ahead);
}

/* Tile t through one copy of it packed for this call into scratch (a8_tile_vectors vectors,
 * 64-byte aligned): a call of A8_PACKED_MIN_ROWS inputs or more on a weight without tiles. */
static void a8_packed_rows(const QWeight *w, int64_t t, Activations8 act, A8Passes p, float *y, int64_t B,
                           int accumulate, __m512i *scratch) {
    a8_tile_one(w, t, scratch);
    a8_tile_rows(w, scratch, t, act, p, y, B, accumulate, 0);
}

#endif /* MINSERVE_QUANT_A8_TILES_H */
