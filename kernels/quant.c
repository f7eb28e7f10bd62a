/* Weight-only quantized linear layers on the CPU: y[B, out] = x[B, in] @ W^T (+ bias), with W
 * stored as int8 or int4 and dequantized inside the weight stream, x and y float32.
 *
 * Why: at small batch a linear layer is a stream of weights through the cores, so its time is
 * weight bytes / memory bandwidth. int8 stores a quarter of fp32's bytes and int4 an eighth (plus
 * scales), which pays only if the dequantization keeps up with the stream; PyTorch's own CPU ops for
 * these formats reach ~1 GB/s here (DESIGN.md), slower than plain fp32. The loops that turn codes
 * into floats in registers and feed them to fused multiply-adds live in quant_dot.h, shared with
 * the fused decode step (decode.c); this file is their entry points for kernels/quant.py.
 *
 * Layouts: minserve/quant/formats.py is the contract (checked on the Python side, kernels/quant.py;
 * quant_dot.h restates it). Prefill (many input rows) is better served by ms_*_dequantize +
 * PyTorch's GEMM: kernels/quant.py has the measurement and the crossover.
 *
 * With int8 activations (quantization_config "activations": "int8"), the same weights run through
 * quant_a8.h's VNNI loops instead: x is quantized to int8 blocks first (W8A8 / W4A8, other
 * numerics, whose torch reference is minserve/quant/activations.py).
 */
#include "quant_a8.h"   /* and quant_dot.h */

/* Which of quant_dot.h's and quant_a8.h's paths this build compiled (tests/test_quant_kernels.py
 * checks them). */
const char *ms_quant_isa(void) { return QUANT_ISA; }
const char *ms_a8_isa(void) { return A8_ISA; }

static int team_size(int64_t nthreads) { return nthreads > 0 ? (int)nthreads : omp_get_max_threads(); }

/* nthreads <= 0: the caller's default team (PyTorch's thread count), as in decode.c. */
int64_t ms_int8_linear(const int8_t *codes, const float *scales, const float *bias, const float *x,
                       float *y, int64_t B, int64_t in, int64_t out, int64_t accumulate,
                       int64_t nthreads) {
    QWeight w = {8, codes, scales, NULL, bias, 0, in, out, NULL};
    return qmatmul(&w, x, y, B, (int)accumulate, team_size(nthreads));
}

/* x [n / 32 blocks of 32 columns] -> xs with each block's 16 even columns first, then its 16 odd
 * ones: the column order in which dequant32 produces int4 weights. n: a multiple of 32. */
void ms_int4_order_columns(const float *x, float *xs, int64_t n) { order_columns(x, xs, n); }

/* xs: caller's scratch of B * in floats, overwritten with x in ms_int4_order_columns's order. */
int64_t ms_int4_linear(const uint8_t *packed, const float *scales, const float *mins, int64_t group,
                       const float *bias, const float *x, float *xs, float *y, int64_t B,
                       int64_t in, int64_t out, int64_t accumulate, int64_t nthreads) {
    if ((group != 32 && group != 64 && group != 128) || in % group)
        return -1;   /* the Python side checks first; this only keeps a bad call from reading past */
    ms_int4_order_columns(x, xs, B * in);
    QWeight w = {4, packed, scales, mins, bias, group, in, out, NULL};
    return qmatmul(&w, xs, y, B, (int)accumulate, team_size(nthreads));
}

/* Rows [r0, r1) of the weight as float32 into w (row-major, in floats a row): the prefill path
 * (kernels/quant.py) dequantizes a cache-sized tile this way and hands it to PyTorch's matmul. */
void ms_int8_dequantize(const int8_t *codes, const float *scales, float *w, int64_t r0, int64_t r1,
                        int64_t in, int64_t nthreads) {
    #pragma omp parallel for schedule(static) num_threads(team_size(nthreads))
    for (int64_t r = r0; r < r1; r++) {
        float *row = w + (r - r0) * in;
        const int8_t *c = codes + r * in;
        int64_t i = 0;
        for (; i + 16 <= in; i += 16) *(vf16 *)(row + i) = int8x16_to_float(c + i) * scales[r];
        for (; i < in; i++) row[i] = (float)c[i] * scales[r];
    }
}

/* The same for int4, with the columns in ms_int4_order_columns's order (multiply by xs, not x):
 * undoing the nibble interleave here would cost a shuffle per 16 weights for nothing. */
void ms_int4_dequantize(const uint8_t *packed, const float *scales, const float *mins, int64_t group,
                        float *w, int64_t r0, int64_t r1, int64_t in, int64_t nthreads) {
    int64_t groups = in / group;
    #pragma omp parallel for schedule(static) num_threads(team_size(nthreads))
    for (int64_t r = r0; r < r1; r++) {
        float *row = w + (r - r0) * in;
        const uint8_t *p = packed + r * (in / 2);
        for (int64_t k = 0; k < groups; k++) {
            levels_t t = group_levels(scales[r * groups + k], mins[r * groups + k]);
            for (int64_t j = k * group; j < (k + 1) * group; j += 32) {
                vf16 even, odd;
                dequant32(p + j / 2, t, &even, &odd);
                *(vf16 *)(row + j) = even;
                *(vf16 *)(row + j + 16) = odd;
            }
        }
    }
}

/* quant_a8.h's entry points, for the tests against minserve/quant/activations.py: x [B, in] ->
 * the block codes (in the order of int4 weights when int4_order, else in column order), scales,
 * sums, and the int8 weights' shift per row. */
void ms_quantize_a8(const float *x, int64_t B, int64_t in, int64_t int4_order, int8_t *codes, float *d,
                    float *xsum, float *shift) {
    Activations8 act = {codes, d, xsum, shift};
    quantize_a8(x, B, in, (int)int4_order, act, omp_get_max_threads());
}

/* y = x @ W^T (+ bias) with x quantized in blocks of 32 (in % 32 == 0, else -1). scratch: B * in + B
 * floats. bits: 8 (codes int8 [out, in], scales [out]) or 4 (packed, scales, mins as ms_int4_linear).
 * tiles: NULL, or the same weight as ms_a8_tile laid it out (read instead of the codes). */
int64_t ms_linear_a8(int64_t bits, const void *codes, const float *scales, const float *mins,
                     int64_t group, const float *bias, const float *x, float *scratch, float *y,
                     int64_t B, int64_t in, int64_t out, int64_t accumulate, int64_t nthreads,
                     const void *tiles) {
    if (in % A8_BLOCK || (bits == 4 && (group % A8_BLOCK || in % group)) || (bits != 4 && bits != 8))
        return -1;
    QWeight w = {(int)bits, codes, scales, mins, bias, group, in, out, tiles};
    return qmatmul_a8(&w, x, a8_scratch(scratch, B, in), y, B, (int)accumulate, team_size(nthreads));
}

/* Bytes of a weight [out, in] (bits 8, or 4 with group size `group`) in the tile order of
 * quant_a8_tiles.h; 0 where this build has no such loops (no AVX-512 VNNI: the row-major loops
 * serve) or the shape does not divide into blocks. */
int64_t ms_a8_tiles_bytes(int64_t bits, int64_t in, int64_t out, int64_t group) {
#ifdef MINSERVE_QUANT_A8_TILES_H
    if (in % A8_BLOCK || (bits == 4 && (group % A8_BLOCK || in % group)) || (bits != 4 && bits != 8) || out < 1)
        return 0;
    return (out + ROW_TILE - 1) / ROW_TILE * a8_tile_vectors((int)bits, in, group) * 64;
#else
    (void)bits, (void)in, (void)out, (void)group;
    return 0;
#endif
}

/* The weight (as ms_linear_a8 takes it) into tiles (ms_a8_tiles_bytes of them, 64-byte aligned);
 * -1 where that is 0 or tiles is misaligned. */
int64_t ms_a8_tile(int64_t bits, const void *codes, const float *scales, const float *mins, int64_t group,
                   int64_t in, int64_t out, void *tiles, int64_t nthreads) {
    if (!ms_a8_tiles_bytes(bits, in, out, group) || (uintptr_t)tiles % 64) return -1;
#ifdef MINSERVE_QUANT_A8_TILES_H
    QWeight w = {(int)bits, codes, scales, mins, NULL, group, in, out, NULL};
    a8_tile_weight(&w, tiles, team_size(nthreads));
#else
    (void)codes, (void)scales, (void)mins, (void)nthreads;
#endif
    return 0;
}
