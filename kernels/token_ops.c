/* The per-token operations between a layer's products, for many tokens at once: SwiGLU and RoPE.
 *
 * Why this exists: once the products of a long prefill chunk run at the CPU's best rate (oneDNN,
 * MKL, AMX tiles for bfloat16), the element-wise operations left in PyTorch cost a fifth of the
 * chunk: silu(gate) * up is two passes over [T, 2 x intermediate] with a temporary in between, and
 * RoPE (x * cos + roll(x) * sin) is four, each a separate dispatch. One pass each here, split over
 * the OpenMP threads by rows, reading and writing float32 or bfloat16 (widened in registers, the
 * arithmetic in float32, each output rounded once to nearest even).
 *
 * The formulas are the ones minserve/models/layers.py and llama.py compute in PyTorch, in the same
 * order: silu(g) = g / (1 + exp(-g)); rope(x)[d] = x[d] cos[d] + x[(d + D/2) % D] sin_signed[d],
 * with sin_signed the table whose first half holds -sin (rotate_half's sign folded in). Results
 * may differ from PyTorch's in the last bit (exp's polynomial, fused multiply-adds), as any
 * kernel's rounding does (tests/test_token_ops.py bounds it).
 */
#include <math.h>
#include <string.h>

#include "quant_dot.h"   /* vf16, omp.h */
#include "vmath.h"       /* vexp, bf16 <-> float */

/* 16 floats rounded to bfloat16 and widened back (store_bf16x16's rounding, kept in registers). */
static inline vf16 rounded_to_bf16(vf16 v) {
    uint16_t b[16];
    store_bf16x16(b, v);
    return bf16x16_to_float(b);
}

static inline vf16 load16(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16x16_to_float((const uint16_t *)p + i) : *(const vf16 *)((const float *)p + i);
}

static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store16(void *p, int64_t i, vf16 v, int bf16) {
    if (bf16) store_bf16x16((uint16_t *)p + i, v); else *(vf16 *)((float *)p + i) = v;
}

static inline void store1(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(v); else ((float *)p)[i] = v;
}

/* out[t, :] = silu(gate_up[t, :inter]) * gate_up[t, inter:], rows t < T; ld: elements per
 * gate_up row (>= 2 x inter). */
void ms_silu_mul(const void *gate_up, int64_t ld, void *out, int64_t T, int64_t inter, int bf16,
                 int nthreads) {
    const int64_t esz = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : omp_get_max_threads())
    for (int64_t t = 0; t < T; t++) {
        const char *g = (const char *)gate_up + t * ld * esz, *u = g + inter * esz;
        char *o = (char *)out + t * inter * esz;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16) {
            vf16 gv = load16(g, i, bf16);
            store16(o, i, gv / (1.0f + vexp(-gv)) * load16(u, i, bf16), bf16);
        }
        for (; i < inter; i++) {
            float gi = load1(g, i, bf16);
            store1(o, i, gi / (1.0f + expf(-gi)) * load1(u, i, bf16), bf16);
        }
    }
}

/* Rotate, in place, `heads` vectors of D elements in each row t < T of x (row stride ld elements)
 * by row t of the tables cos, sin_signed [T, D] (gathered at each token's position, in x's dtype,
 * as the PyTorch path multiplies them). D even, at most 512. */
void ms_rope(void *x, int64_t ld, int64_t T, int64_t heads, int64_t D, const void *cos,
             const void *sin_signed, int bf16, int nthreads) {
    const int64_t half = D / 2, esz = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : omp_get_max_threads())
    for (int64_t t = 0; t < T; t++) {
        float c[512], s[512], tmp[512];
        for (int64_t d = 0; d < D; d++) {
            c[d] = load1(cos, t * D + d, bf16);
            s[d] = load1(sin_signed, t * D + d, bf16);
        }
        for (int64_t h = 0; h < heads; h++) {
            char *v = (char *)x + (t * ld + h * D) * esz;
            for (int64_t d = 0; d < D; d++) tmp[d] = load1(v, d, bf16);
            int64_t d = 0;
            if (half % 16 == 0)
                for (; d < D; d += 16) {
                    vf16 a = *(const vf16 *)(tmp + d), b = *(const vf16 *)(tmp + (d + half) % D);
                    store16(v, d, a * *(const vf16 *)(c + d) + b * *(const vf16 *)(s + d), bf16);
                }
            for (; d < D; d++) store1(v, d, tmp[d] * c[d] + tmp[(d + half) % D] * s[d], bf16);
        }
    }
}

/* RMSNorm of bfloat16 rows as transformers computes it for a half-precision model: widen to float32,
 * x * rsqrt(mean(x^2) + eps) rounded to bfloat16, then times the bf16 weight, rounded again.
 * (float32 rows keep PyTorch's fused F.rms_norm, bit-identical to the reference.) */
void ms_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *out, int64_t T,
                      int64_t dim, float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : omp_get_max_threads())
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * ldx;
        uint16_t *o = out + t * dim;
        vf16 acc = {0};
        float tail = 0.f;
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) {
            vf16 v = bf16x16_to_float(xr + i);
            acc += v * v;
        }
        for (; i < dim; i++) tail += bf16_to_float(xr[i]) * bf16_to_float(xr[i]);
        const float inv = 1.0f / sqrtf((hsum(acc) + tail) / (float)dim + eps);
        for (i = 0; i + 16 <= dim; i += 16)   /* the loop below, 16 at a time: the same roundings */
            store_bf16x16(o + i, bf16x16_to_float(w + i) * rounded_to_bf16(bf16x16_to_float(xr + i) * inv));
        for (; i < dim; i++) {
            float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * inv));
            o[i] = float_to_bf16(bf16_to_float(w[i]) * normed);
        }
    }
}
