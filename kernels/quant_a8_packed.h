/* W4A8 and W8A8 at prefill sizes: the inputs interleaved, the int8 tile's layout and its pass
 * (included by quant_a8.h, in its AVX-512 VNNI section, after int8_a8_tile; quant_a8_tiles.h holds
 * the tile layouts and the loops that read them, at load or packed once per call).
 *
 * Why: int4_a8_tile and int8_a8_tile transpose their 16 rows' bytes into vpdpbusd's lane order
 * (transpose16; int4 also each group's scales and mins, columns16) for every pass of
 * A8_BATCH_PASS inputs. At decode sizes that is one or two passes; a 1024-token prefill chunk
 * makes 128. So a tile is laid out once (per call into a per-thread buffer that stays in L1 / L2
 * while every input of the call passes over it, or at load: quant_a8_tiles.h), and read
 * A8_PACKED_PASS inputs at a time.
 *
 * The inputs are interleaved too (a8_interleave): for each pass, block and 4-byte group of the
 * block, the pass's inputs side by side, and each block's scales (and sums) the same way. A pass
 * then reads all its activations through one pointer at fixed offsets; read from B rows a row
 * apart, each of a pass's vpdpbusd also needed its own address arithmetic, and packing int8 tiles
 * alone did not pay. What both changes measured is on docs/performance/vllm-zen4.md;
 * benchmarks/bench_roofline.py's kernel table times both formats.
 *
 * The integers and the order of the float operations are those of the per-pass tiles (each
 * block's exact int32 dot product, converted and scaled into the row's running sum block by block;
 * for int4 then the min term; for int8 the shift and the row scale at the end), so every path
 * gives bit-identical outputs (tests/test_quant_a8.py).
 */
#ifndef MINSERVE_QUANT_A8_PACKED_H
#define MINSERVE_QUANT_A8_PACKED_H

#define A8_PACKED_MIN_ROWS 32   /* fewer inputs: the per-pass tiles (one to three passes) */
#define A8_PACKED_PASS 12       /* inputs per pass: 12 int32 sums + 12 float sums + a weight vector */

/* Byte offset in a block of 32 activation codes of the 4-byte group that meets weight vector j
 * (0..7): int8 tiles hold columns 4j..4j+3 in vector j; for int4, vector j < 4 is the low nibbles
 * of dword j of the block's bytes, 4 + j their high nibbles (quant_a8_tiles.h, quantize_block). */
static inline int64_t a8_group_offset(int int4, int j) { return int4 ? 8 * (j % 4) + 4 * (j / 4) : 4 * j; }

typedef struct {    /* x's codes for the packed tiles, A8_PACKED_PASS inputs side by side */
    int32_t *codes; /* [passes][blocks][8][PASS]: a 4-byte group of codes each */
    float *d, *xsum;/* [passes][blocks][PASS] */
    int64_t passes;
} A8Passes;

/* Bytes a8_interleave needs for B inputs of in columns. */
static inline size_t a8_passes_bytes(int64_t B, int64_t in) {
    int64_t rows = (B + A8_PACKED_PASS - 1) / A8_PACKED_PASS * A8_PACKED_PASS;
    return (size_t)rows * in + 2 * sizeof(float) * (size_t)rows * (in / A8_BLOCK);
}

/* act's codes, scales and sums in A8Passes's order, in buf (a8_passes_bytes, 64-byte aligned).
 * The last pass's rows past B repeat row B - 1: their sums are computed and never stored. */
static A8Passes a8_interleave(Activations8 act, int64_t B, int64_t in, int int4, void *buf, int nthreads) {
    const int64_t blocks = in / A8_BLOCK, P = A8_PACKED_PASS, passes = (B + P - 1) / P;
    A8Passes p = {(int32_t *)buf, NULL, NULL, passes};
    p.d = (float *)(p.codes + passes * blocks * 8 * P);
    p.xsum = p.d + passes * blocks * P;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (B * in >= 16384)
    for (int64_t pass = 0; pass < passes; pass++)
        for (int64_t b = 0; b < P; b++) {
            int64_t row = pass * P + b < B ? pass * P + b : B - 1;
            const int8_t *codes = act.codes + row * in;
            for (int64_t k = 0; k < blocks; k++) {
                int64_t at = (pass * blocks + k) * P + b;
                for (int j = 0; j < 8; j++)
                    memcpy(p.codes + 8 * (at - b) + j * P + b, codes + k * A8_BLOCK + a8_group_offset(int4, j), 4);
                p.d[at] = act.d[row * blocks + k];
                p.xsum[at] = act.xsum[row * blocks + k];
            }
        }
    return p;
}

/* Each int4 group's scales and mins of a tile's 16 rows as two vectors, group after group:
 * sm[2 * g] the scales, sm[2 * g + 1] the mins (columns16, 16 groups at a time). */
static void int4_group_levels(const QWeight *w, const int64_t row_ids[ROW_TILE], __m512 *sm) {
    const int64_t groups = w->in / w->group;
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        __m512 scale[16], min[16];
        int ng = groups - g0 < 16 ? (int)(groups - g0) : 16;
        columns16(w->scales, groups, row_ids, g0, ng, scale);
        columns16(w->mins, groups, row_ids, g0, ng, min);
        for (int g = 0; g < ng; g++) sm[2 * (g0 + g)] = scale[g], sm[2 * (g0 + g) + 1] = min[g];
    }
}

/* The int8 tile in vpdpbusd's lane order, each code + 128 (unsigned, as int8_a8_tile makes them):
 * 8 vectors per block of 32 columns. */
static void int8_a8_pack(const QWeight *w, const uint8_t *const rows[ROW_TILE], __m512i *packed) {
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < w->in / A8_BLOCK; k++) {
        __m512i T[8];
        transpose16(rows, k * A8_BLOCK, T);
        transpose16(rows, k * A8_BLOCK + 16, T + 4);
        for (int j = 0; j < 8; j++) _mm512_store_si512(packed + 8 * k + j, _mm512_xor_si512(T[j], offset));
    }
}

/* One pass of nb inputs (a constant at each call site) over an int8 tile (int8_a8_pack's layout):
 * out[b] = its 16 rows for input b, before the shift, the row scale and the bias. codes, d: the
 * pass's interleaved inputs; prefetch_bytes: see quant_a8_tiles.h's a8_tile_rows. */
static inline __attribute__((always_inline)) void
int8_a8_pass(const int nb, const __m512i *tile, int64_t blocks, const int32_t *codes, const float *d,
             __m512 out[A8_PACKED_PASS], int64_t prefetch_bytes) {
    enum { P = A8_PACKED_PASS };
    for (int b = 0; b < nb; b++) out[b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        if (prefetch_bytes) prefetch_share((const uint8_t *)tile, prefetch_bytes, k, blocks);
        __m512i dot[P];
        for (int b = 0; b < nb; b++) dot[b] = _mm512_setzero_si512();
        const int32_t *a = codes + k * 8 * P;
        _Pragma("GCC unroll 8")   /* unrolled, the pass's sums stay in registers */
        for (int j = 0; j < 8; j++) {
            const __m512i Tj = _mm512_load_si512(tile + 8 * k + j);
            for (int b = 0; b < nb; b++) dot[b] = _mm512_dpbusd_epi32(dot[b], Tj, _mm512_set1_epi32(a[j * P + b]));
        }
        for (int b = 0; b < nb; b++)
            out[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[b]), _mm512_set1_ps(d[k * P + b]), out[b]);
    }
}

#endif /* MINSERVE_QUANT_A8_PACKED_H */
