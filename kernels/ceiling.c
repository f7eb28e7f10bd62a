// The CPU's arithmetic ceilings, measured: how many multiply-adds per second its vector units
// retire when nothing else limits them (no memory traffic, no dependency stalls).
//
// Each function runs `iters` rounds of ACC independent accumulator chains per thread, entirely in
// registers, on every thread of the OpenMP team, and returns a checksum so the compiler cannot
// drop the work. The caller times the call and divides the operation count by the time
// (benchmarks/bench_roofline.py). Why ACC independent chains: one fused multiply-add takes about
// 4 cycles before its result can feed the next, and a core starts up to two per cycle, so at
// least 8 chains in flight are needed to keep both pipes busy; 12 leaves headroom.
//
// Four instruction kinds, the ones minserve's kernels can use:
//   fp32  _mm512_fmadd_ps       16 lanes x 1 multiply-add          = 32 flops per instruction
//   bf16  _mm512_dpbf16_ps      16 lanes x 2 bf16 products + add   = 64 flops (AVX-512 BF16)
//   int8  _mm512_dpbusd_epi32   16 lanes x 4 u8*s8 products + add  = 128 ops  (AVX-512 VNNI)
//   tiles _tile_dpbf16ps        16 x 16 outputs x 32 bf16 products = 16,384 flops (AMX; kind 3)
// Without AVX-512 the fp32 ceiling falls back to AVX2 FMA (8 lanes) and the int8 one to AVX2's
// _mm256_maddubs_epi16 (16 lanes x 2 u8*s8 products + add = 64 ops; what kernels/quant_a8.h's
// AVX2 loops run on; on the AVX2 EPYC it retires at half the rate of 8-lane FMAs, 1.23 against
// 2.43 G instructions/s on a thread in a scratch loop, but with 32 multiply-adds against 8: twice
// the products). bf16 reports -1 there (instruction not available), so the library builds
// everywhere.
#define _DEFAULT_SOURCE   /* syscall (amx_bf16.h asks Linux for the AMX tile state) */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "vmath.h"      /* what amx_bf16.h expects before it */
#include "amx_bf16.h"   /* HAVE_AMX_BF16, amx_enable, amx_configure_square */

#define ACC 12
#define TILE_ACC 4        /* accumulator tiles: four C, two A, two B, each load serving two */

int ms_ceiling_threads(void) { return omp_get_max_threads(); }

// Flops (or integer ops) one call performs per thread and iteration; -1: not built for this CPU.
int64_t ms_ceiling_ops_per_iter(int kind) {
#if defined(__AVX512F__)
    if (kind == 0) return ACC * 16 * 2;
#elif defined(__AVX2__) && defined(__FMA__)
    if (kind == 0) return ACC * 8 * 2;
#endif
#if defined(__AVX512BF16__)
    if (kind == 1) return ACC * 16 * 4;
#endif
#if defined(__AVX512VNNI__)
    if (kind == 2) return ACC * 16 * 8;
#elif defined(__AVX2__)
    if (kind == 2) return ACC * 16 * 4;
#endif
#ifdef HAVE_AMX_BF16
    if (kind == 3) return amx_enable(1) ? TILE_ACC * 16 * 16 * 32 * 2 : -1;
#endif
    (void)kind;
    return -1;
}

double ms_ceiling_fp32(int64_t iters) {
    double total = 0.0;
#pragma omp parallel reduction(+ : total)
    {
#if defined(__AVX512F__)
        __m512 acc[ACC];
        const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
        for (int k = 0; k < ACC; k++) acc[k] = _mm512_set1_ps((float)k);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < ACC; k++) acc[k] = _mm512_fmadd_ps(acc[k], a, b);
        for (int k = 0; k < ACC; k++) total += _mm512_reduce_add_ps(acc[k]);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc[ACC];
        const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
        for (int k = 0; k < ACC; k++) acc[k] = _mm256_set1_ps((float)k);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < ACC; k++) acc[k] = _mm256_fmadd_ps(acc[k], a, b);
        float out[8];
        for (int k = 0; k < ACC; k++) {
            _mm256_storeu_ps(out, acc[k]);
            for (int j = 0; j < 8; j++) total += out[j];
        }
#else
        (void)iters;
#endif
    }
    return total;
}

double ms_ceiling_bf16(int64_t iters) {
    double total = 0.0;
#if defined(__AVX512BF16__)
#pragma omp parallel reduction(+ : total)
    {
        __m512 acc[ACC];
        const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
        for (int k = 0; k < ACC; k++) acc[k] = _mm512_set1_ps((float)k);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < ACC; k++) acc[k] = _mm512_dpbf16_ps(acc[k], a, b);
        for (int k = 0; k < ACC; k++) total += _mm512_reduce_add_ps(acc[k]);
    }
#else
    (void)iters;
#endif
    return total;
}

double ms_ceiling_int8(int64_t iters) {
    double total = 0.0;
#if defined(__AVX512VNNI__)
#pragma omp parallel reduction(+ : total)
    {
        __m512i acc[ACC];
        const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(-1);
        for (int k = 0; k < ACC; k++) acc[k] = _mm512_set1_epi32(k);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < ACC; k++) acc[k] = _mm512_dpbusd_epi32(acc[k], a, b);
        for (int k = 0; k < ACC; k++) total += (double)_mm512_reduce_add_epi32(acc[k]);
    }
#elif defined(__AVX2__)
#pragma omp parallel reduction(+ : total)
    {
        // Each chain feeds its 16-bit sums back in as the next step's unsigned bytes (times
        // signed twos): acc_k <- maddubs(acc_k, 2). The values stay small (at most 2 x 510), so
        // nothing saturates, and they keep changing, so the test's replay counts the steps.
        __m256i acc[ACC];
        const __m256i two = _mm256_set1_epi8(2);
        for (int k = 0; k < ACC; k++) acc[k] = _mm256_set1_epi8((char)k);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < ACC; k++) acc[k] = _mm256_maddubs_epi16(acc[k], two);
        int16_t out[16];
        for (int k = 0; k < ACC; k++) {
            _mm256_storeu_si256((__m256i *)out, acc[k]);
            for (int j = 0; j < 16; j++) total += out[j];
        }
    }
#else
    (void)iters;
#endif
    return total;
}

// AMX: TILE_ACC independent accumulator tiles, each C += A . B per round with A = bf16 1.0 and
// B = bf16 2^-5 (every output grows by exactly 1 a round: 32 products of 2^-5), operands loaded
// once, so only the tile multiplier works. Returns the sum of every output of every thread:
// threads * TILE_ACC * 256 * iters, exact in float32 for iters up to 2^24 (the tests check it).
// 0 where this build or CPU has no AMX, or Linux refused the tile state.
double ms_ceiling_tiles(int64_t iters) {
    double total = 0.0;
#ifdef HAVE_AMX_BF16
    if (!amx_enable(1)) return 0.0;
#pragma omp parallel reduction(+ : total)
    {
        static const uint16_t one = 0x3F80, step = 0x3D00;   /* bf16 1.0 and 2^-5 */
        uint16_t a[16][32] __attribute__((aligned(64))), b[16][32] __attribute__((aligned(64)));
        float c[16][16] __attribute__((aligned(64)));
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 32; j++) a[i][j] = one, b[i][j] = step;
        amx_configure_square();
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, a, 64); _tile_loadd(5, a, 64); _tile_loadd(6, b, 64); _tile_loadd(7, b, 64);
        for (int64_t i = 0; i < iters; i++) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
            _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
        }
        for (int t = 0; t < TILE_ACC; t++) {
            if (t == 0) _tile_stored(0, c, 64);
            else if (t == 1) _tile_stored(1, c, 64);
            else if (t == 2) _tile_stored(2, c, 64);
            else _tile_stored(3, c, 64);
            for (int i = 0; i < 16; i++)
                for (int j = 0; j < 16; j++) total += c[i][j];
        }
        _tile_release();
    }
#else
    (void)iters;
#endif
    return total;
}

// Read bandwidth: sum n floats (n a multiple of 16 * ACC) on every thread, each thread streaming
// its own contiguous slice with ACC independent accumulators, as the decode kernels stream
// weights. torch.sum is a second opinion; the faster of the two is the ceiling.
double ms_ceiling_read(const float *p, int64_t n) {
    double total = 0.0;
#pragma omp parallel reduction(+ : total)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t chunk = (n / nt) / (16 * ACC) * (16 * ACC);
        const float *q = p + (int64_t)t * chunk;
#if defined(__AVX512F__)
        __m512 acc[ACC];
        for (int k = 0; k < ACC; k++) acc[k] = _mm512_setzero_ps();
        for (int64_t i = 0; i < chunk; i += 16 * ACC)
            for (int k = 0; k < ACC; k++) acc[k] = _mm512_add_ps(acc[k], _mm512_loadu_ps(q + i + 16 * k));
        for (int k = 0; k < ACC; k++) total += _mm512_reduce_add_ps(acc[k]);
#else
        float s = 0.0f;
        for (int64_t i = 0; i < chunk; i++) s += q[i];
        total += s;
#endif
    }
    return total;
}
