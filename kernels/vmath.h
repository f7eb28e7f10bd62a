/* Vector math on 16 floats shared by the C kernels (decode.c, prefill_attention.c): exp, which
 * softmax and SiLU need many of, and the two helpers it is built from; bfloat16 <-> float32. */
#ifndef MINSERVE_VMATH_H
#define MINSERVE_VMATH_H
#include "quant_dot.h"

typedef int32_t vi16 __attribute__((vector_size(64)));

static inline vf16 splat(float v) { return (vf16){0} + v; }

static inline vf16 vselect(vi16 mask, vf16 a, vf16 b) {
    return (vf16)(((vi16)a & mask) | ((vi16)b & ~mask));
}

/* exp of 16 floats at once (libm's expf is one scalar call per element; softmax and SiLU need
 * many). Cephes' method: exp(x) = 2^n * exp(r) with n = round(x / ln 2), |r| <= ln(2) / 2, exp(r)
 * from a degree-6 polynomial, ln 2 split in two parts so r is exact. Relative error < 1e-6 against
 * float64 exp (tests/test_fused_decode.py). One body for two widths: vexp (16 floats) and vexp8
 * (8 floats, one AVX2 register; prefill_attention.c's softmax works at the register's width). */
#define VMATH_EXP(name, vf, vi)                                                                  \
    static inline vf name(vf x) {                                                                \
        x = VSELECT(vi, vf, x > 88.0f, (vf){0} + 88.0f, x);                                      \
        x = VSELECT(vi, vf, x < -87.0f, (vf){0} - 87.0f, x);                                     \
        /* n = x / ln 2 rounded to the nearest integer: adding 1.5 * 2^23 leaves it in the low \
         * mantissa bits (|x / ln 2| < 2^22 after the clamps), read back as float and as int:  \
         * two operations where floor by conversion took five. */                               \
        vf t = x * 1.44269504088896341f + 12582912.0f;                                           \
        vf nf = t - 12582912.0f;                                                                 \
        vi n = (vi)t - 0x4B400000;                                                               \
        vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;                                      \
        vf p = (vf){0} + 1.9875691500e-4f;                                                       \
        p = p * r + 1.3981999507e-3f;                                                            \
        p = p * r + 8.3334519073e-3f;                                                            \
        p = p * r + 4.1665795894e-2f;                                                            \
        p = p * r + 1.6666665459e-1f;                                                            \
        p = p * r + 5.0000001201e-1f;                                                            \
        p = p * r * r + r + 1.0f;                                                                \
        return p * (vf)((n + 127) << 23);      /* 2^n built from its exponent bits */           \
    }
#define VSELECT(vi, vf, mask, a, b) ((vf)(((vi)(a) & (mask)) | ((vi)(b) & ~(mask))))
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef int32_t vi4 __attribute__((vector_size(16)));
VMATH_EXP(vexp, vf16, vi16)
VMATH_EXP(vexp8, vf8, vi8)

/* bfloat16 is the top half of a float32: widening is a shift, exact. */
typedef uint16_t vu16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vu32x16 __attribute__((vector_size(64)));

static inline vf16 bf16x16_to_float(const uint16_t *p) {
#if defined(__AVX512F__)   /* one vpmovzxwd from memory; GCC 12 splits the generic form in five */
    return (vf16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    return (vf16)(__builtin_convertvector(*(const vu16x16 *)p, vu32x16) << 16);
#endif
}

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* float32 -> bfloat16 rounded to nearest, ties to even, as PyTorch's .to(torch.bfloat16); a NaN
 * stays a (quiet) NaN instead of rounding into infinity. */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* 16 floats -> bfloat16, rounded as float_to_bf16 rounds one. With AVX-512 BF16 one
 * instruction does it (to nearest even, NaN kept quiet), where the generic form took ten and made
 * a bf16 SwiGLU slower than the float32 one (1.11 against 0.61 ms for 1024 x 1536, Intel Xeon,
 * 2026-12-06); it flushes inputs below 2^-126 to zero, values no activation holds. */
static inline void store_bf16x16(uint16_t *dst, vf16 v) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
    vu32x16 u = (vu32x16)v;
    vu32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vu32x16 nan = (vu32x16)((vi16)(u & 0x7fffffffu) > (vi16){0} + 0x7f800000);
    rounded = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
    *(vu16x16 *)dst = __builtin_convertvector(rounded, vu16x16);
#endif
}
#endif
