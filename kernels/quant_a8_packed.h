/* W4A8 and W8A8 at prefill sizes: each weight tile packed once per call, the inputs interleaved
 * (included by quant_a8.h, in its AVX-512 VNNI section, after int8_a8_tile).
 *
 * Why: int4_a8_tile and int8_a8_tile transpose their 16 rows' bytes into vpdpbusd's lane order
 * (transpose16; int4 also splits the nibbles and transposes each group's scales and mins,
 * columns16) for every pass of A8_BATCH_PASS inputs. At decode sizes that is one or two passes; a
 * 1024-token prefill chunk makes 128. Here a tile is packed into a per-thread buffer once per call
 * (16 rows x in bytes, plus two vectors per int4 group), which stays in L1 / L2 while every input
 * of the call passes over it, A8_PACKED_PASS inputs at a time.
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
 * for int4 then the min term; for int8 the shift and the row scale at the end), so both paths give
 * bit-identical outputs (tests/test_quant_a8.py).
 */
#ifndef MINSERVE_QUANT_A8_PACKED_H
#define MINSERVE_QUANT_A8_PACKED_H

#define A8_PACKED_MIN_ROWS 32   /* fewer inputs: the per-pass tiles (one to three passes) */
#define A8_PACKED_PASS 12       /* inputs per pass: 12 int32 sums + 12 float sums + a weight vector */

/* Byte offset in a block of 32 activation codes of the 4-byte group that meets weight vector j
 * (0..7): int8 tiles hold columns 4j..4j+3 in vector j; int4 tiles the low nibbles of columns
 * 8j'..8j'+7 in vectors 0-3 and the high ones in 4-7 (see int4_a8_pack and quantize_block). */
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

/* The int4 tile in vpdpbusd's lane order, nibbles as bytes: 8 vectors per block of 32 columns
 * (the 4 low-nibble vectors, then the 4 high), then each group's scales and mins as vectors
 * (columns16), after the blocks: packed[8 * blocks + 2 * g] and [8 * blocks + 2 * g + 1]. */
static void int4_a8_pack(const QWeight *w, const uint8_t *const rows[ROW_TILE], const int64_t row_ids[ROW_TILE],
                         __m512i *packed) {
    const int64_t blocks = w->in / A8_BLOCK;
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int64_t k = 0; k < blocks; k++) {
        __m512i T[4];
        transpose16(rows, k * (A8_BLOCK / 2), T);
        for (int j = 0; j < 4; j++) {
            _mm512_store_si512(packed + 8 * k + j, _mm512_and_si512(T[j], nibble));
            _mm512_store_si512(packed + 8 * k + 4 + j, _mm512_and_si512(_mm512_srli_epi16(T[j], 4), nibble));
        }
    }
    int4_group_levels(w, row_ids, (__m512 *)(packed + 8 * blocks));
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

/* One pass over a packed tile: out[b] = the tile's 16 rows for the pass's input b < nb, before the
 * bias (int8: before the shift and the row scale too). bits and nb are constants at each call
 * site (a8_pass_of), so each format's and size's loop compiles into registers of its own. */
static inline __attribute__((always_inline)) void
a8_packed_pass(const int bits, const int nb, const __m512i *packed, int64_t blocks, int64_t per_group,
               const int32_t *codes, const float *d, const float *xsum, __m512 out[A8_PACKED_PASS],
               int64_t prefetch_bytes) {
    enum { P = A8_PACKED_PASS };
    const __m512 *sm = (const __m512 *)(packed + 8 * blocks);
    for (int b = 0; b < nb; b++) out[b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        if (prefetch_bytes)   /* tiles laid out at load (quant_a8_tiles.h): the one 2 ahead, a share per block */
            prefetch_share((const uint8_t *)packed, prefetch_bytes, k, blocks);
        __m512i dot[P];
        for (int b = 0; b < nb; b++) dot[b] = _mm512_setzero_si512();
        const int32_t *a = codes + k * 8 * P;
        _Pragma("GCC unroll 8")   /* unrolled, the pass's sums stay in registers */
        for (int j = 0; j < 8; j++) {
            const __m512i Tj = _mm512_load_si512(packed + 8 * k + j);
            for (int b = 0; b < nb; b++) dot[b] = _mm512_dpbusd_epi32(dot[b], Tj, _mm512_set1_epi32(a[j * P + b]));
        }
        if (bits == 4) {
            int4_scale_block(nb, dot, sm[2 * (k / per_group)], sm[2 * (k / per_group) + 1], d + k * P,
                             xsum + k * P, out);
        } else {
            for (int b = 0; b < nb; b++)
                out[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[b]), _mm512_set1_ps(d[k * P + b]), out[b]);
        }
    }
}

/* A pass of `left` inputs (the last one may be short): 12, or the next multiple of 4, so that a
 * call of 32 or 64 inputs computes no padding rows (padded to 12, int4 at 32 rows was slower:
 * docs/performance/vllm-zen4.md). Rows past `left` in the pass are copies of the last input, their
 * sums never stored. */
static inline __attribute__((always_inline)) void
a8_pass_of(const int bits, int64_t left, const __m512i *packed, int64_t blocks, int64_t per_group,
           const int32_t *codes, const float *d, const float *xsum, __m512 out[A8_PACKED_PASS]) {
    if (left > 8)
        a8_packed_pass(bits, A8_PACKED_PASS, packed, blocks, per_group, codes, d, xsum, out, 0);
    else if (left > 4)
        a8_packed_pass(bits, 8, packed, blocks, per_group, codes, d, xsum, out, 0);
    else
        a8_packed_pass(bits, 4, packed, blocks, per_group, codes, d, xsum, out, 0);
}

/* Bytes of one packed tile: 16 rows x in codes as bytes, and two vectors per int4 group. */
static inline size_t a8_packed_bytes(const QWeight *w) {
    return (size_t)w->in * ROW_TILE + (w->bits == 4 ? (size_t)(w->in / w->group) * 2 * 64 : 0);
}

/* Rows [r0, r1) of y for all B inputs through one packed copy of the tile (scratch: a8_packed_bytes,
 * 64-byte aligned). act: the inputs as quantize_a8 left them (int8's shifts); p: interleaved. */
static void a8_packed_rows(const QWeight *w, int64_t r0, int64_t r1, Activations8 act, A8Passes p,
                           float *y, int64_t B, int accumulate, __m512i *scratch) {
    const uint8_t *rows[ROW_TILE];
    int64_t row_ids[ROW_TILE];
    const int64_t blocks = w->in / A8_BLOCK, P = A8_PACKED_PASS;
    tile_rows(w->codes, w->bits == 4 ? w->in / 2 : w->in, r0, r1, rows, row_ids);
    __mmask16 mask = r1 - r0 >= 16 ? 0xFFFF : (__mmask16)((1u << (r1 - r0)) - 1);
    __m512 scale = _mm512_setzero_ps();
    if (w->bits == 4) {
        int4_a8_pack(w, rows, row_ids, scratch);
    } else {
        int8_a8_pack(w, rows, scratch);
        scale = _mm512_maskz_loadu_ps(mask, w->scales + r0);
    }
    for (int64_t pass = 0; pass < p.passes; pass++) {
        __m512 out[A8_PACKED_PASS];
        const int32_t *codes = p.codes + pass * blocks * 8 * P;
        const float *d = p.d + pass * blocks * P, *xsum = p.xsum + pass * blocks * P;
        int nb = B - pass * P < P ? (int)(B - pass * P) : (int)P;
        if (w->bits == 4) {
            a8_pass_of(4, nb, scratch, blocks, w->group / A8_BLOCK, codes, d, xsum, out);
        } else {
            a8_pass_of(8, nb, scratch, blocks, 1, codes, d, xsum, out);
            for (int b = 0; b < nb; b++)
                out[b] = _mm512_mul_ps(_mm512_sub_ps(out[b], _mm512_set1_ps(act.shift[pass * P + b])), scale);
        }
        store_tile(out, w->bias, r0, r1, y + pass * P * w->out, w->out, nb, accumulate);
    }
}

#endif /* MINSERVE_QUANT_A8_PACKED_H */
