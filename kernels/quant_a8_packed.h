/* W4A8 at prefill sizes: each weight tile unpacked once per call, then every input row reuses it
 * (included by quant_a8.h, in its AVX-512 VNNI section, after int4_a8_tile).
 *
 * Why: int4_a8_tile transposes its 16 rows' bytes into vpdpbusd's lane order (transpose16), splits
 * the nibbles and transposes each group's scales and mins (columns16) for every pass of
 * A8_BATCH_PASS inputs. At decode sizes that is one or two passes; a 1024-token prefill chunk
 * makes 128. Here a tile is unpacked into a per-thread buffer once per call (16 rows x in bytes,
 * plus two vectors per group), which stays in L1 / L2 while every input row of the call passes
 * over it, A8_PACKED_PASS inputs at a time. What it measured, and why int8 weights (no nibbles, no
 * group scales: their transposes run beside the dot products) keep their passes, is on
 * docs/performance/vllm-zen4.md; benchmarks/bench_roofline.py's kernel table times both formats.
 *
 * The integers and the order of the float operations are int4_a8_tile's (each block's exact int32
 * dot product, converted and scaled into the row's running sum block by block, then the min
 * term), so both paths give bit-identical outputs (tests/test_quant_a8.py).
 */
#ifndef MINSERVE_QUANT_A8_PACKED_H
#define MINSERVE_QUANT_A8_PACKED_H

#define A8_PACKED_MIN_ROWS 32   /* fewer inputs: int4_a8_tile's own passes (one to three) */
#define A8_PACKED_PASS 12       /* inputs per pass: 12 int32 sums + 12 float sums + a weight vector */

/* The int4 tile in vpdpbusd's lane order, nibbles as bytes: 8 vectors per block of 32 columns
 * (the 4 low-nibble vectors, then the 4 high), then each group's scales and mins as vectors
 * (columns16), after the blocks: packed[8 * blocks + 2 * g] and [8 * blocks + 2 * g + 1]. */
static void int4_a8_pack(const QWeight *w, const uint8_t *const rows[ROW_TILE], const int64_t row_ids[ROW_TILE],
                         __m512i *packed) {
    const int64_t in = w->in, groups = in / w->group, blocks = in / A8_BLOCK;
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int64_t k = 0; k < blocks; k++) {
        __m512i T[4];
        transpose16(rows, k * (A8_BLOCK / 2), T);
        for (int j = 0; j < 4; j++) {
            _mm512_store_si512(packed + 8 * k + j, _mm512_and_si512(T[j], nibble));
            _mm512_store_si512(packed + 8 * k + 4 + j, _mm512_and_si512(_mm512_srli_epi16(T[j], 4), nibble));
        }
    }
    __m512 *sm = (__m512 *)(packed + 8 * blocks);
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        __m512 scale[16], min[16];
        int ng = groups - g0 < 16 ? (int)(groups - g0) : 16;
        columns16(w->scales, groups, row_ids, g0, ng, scale);
        columns16(w->mins, groups, row_ids, g0, ng, min);
        for (int g = 0; g < ng; g++) sm[2 * (g0 + g)] = scale[g], sm[2 * (g0 + g) + 1] = min[g];
    }
}

/* int4_a8_tile's sums for nb inputs, the weights, scales and mins read from the packed tile. */
static inline __attribute__((always_inline)) void
int4_a8_packed_tile(const QWeight *w, const __m512i *packed, int64_t r0, int64_t r1, Activations8 act,
                    float *y, int64_t ldy, const int nb, int accumulate) {
    const int64_t in = w->in, blocks = in / A8_BLOCK, per_group = w->group / A8_BLOCK;
    const __m512 *sm = (const __m512 *)(packed + 8 * blocks);
    __m512 out[A8_PACKED_PASS];
    for (int b = 0; b < nb; b++) out[b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        __m512i dot[A8_PACKED_PASS];
        for (int b = 0; b < nb; b++) dot[b] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {   /* activation codes in int4 order: 8 (j % 4) + 4 (j / 4) */
            const __m512i Tj = _mm512_load_si512(packed + 8 * k + j);
            const int64_t at = k * A8_BLOCK + 8 * (j % 4) + 4 * (j / 4);
            for (int b = 0; b < nb; b++) dot[b] = _mm512_dpbusd_epi32(dot[b], Tj, bcast4(act.codes + b * in + at));
        }
        const __m512 s = sm[2 * (k / per_group)], m = sm[2 * (k / per_group) + 1];
        for (int b = 0; b < nb; b++) {
            __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(act.d[b * blocks + k]));
            out[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[b]), sd, out[b]);
            out[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(act.xsum[b * blocks + k]), out[b]);
        }
    }
    store_tile(out, w->bias, r0, r1, y, ldy, nb, accumulate);
}

/* Bytes of one packed tile: 16 rows x in codes as bytes, and two vectors per group. */
static inline size_t a8_packed_bytes(const QWeight *w) {
    return (size_t)w->in * ROW_TILE + (size_t)(w->in / w->group) * 2 * 64;
}

/* Rows [r0, r1) of y for all B inputs of an int4 weight through one packed copy of the tile
 * (scratch: a8_packed_bytes, 64-byte aligned). */
static void int4_a8_packed_rows(const QWeight *w, int64_t r0, int64_t r1, Activations8 act, float *y,
                                int64_t B, int accumulate, __m512i *scratch) {
    const uint8_t *rows[ROW_TILE];
    int64_t row_ids[ROW_TILE];
    tile_rows(w->codes, w->in / 2, r0, r1, rows, row_ids);
    int4_a8_pack(w, rows, row_ids, scratch);
    const int64_t blocks = w->in / A8_BLOCK;
    for (int64_t b = 0; b < B; b += A8_PACKED_PASS) {
        int64_t nb = B - b < A8_PACKED_PASS ? B - b : A8_PACKED_PASS;
        Activations8 ab = {act.codes + b * w->in, act.d + b * blocks, act.xsum + b * blocks, act.shift + b};
        float *yb = y + b * w->out;
        switch (nb) {   /* a constant nb per case: the loop over inputs unrolls into registers */
#define CASE(n) case n: int4_a8_packed_tile(w, scratch, r0, r1, ab, yb, w->out, n, accumulate); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
        }
    }
}

#endif /* MINSERVE_QUANT_A8_PACKED_H */
