/* The top-p (nucleus) filter of sampling rows, in place, without sorting a row.
 *
 * Why: the sampler found each top-p row's nucleus with `topk` over a window of its best tokens,
 * then a wider window, then a full sort when the nucleus was wider still: over 16 rows of
 * SmolLM2's 49,152 logits, one thread, 6.6-7.5 ms for a window of 1,024 and 55 ms for a full sort
 * (benchmarks/bench_sampler.py, Zen 4 EPYC), where a batch-16 decode step takes ~20-40 ms. The
 * filter needs no order among the tokens it keeps, only where the nucleus ends: the logit where
 * the probability of the tokens above it reaches top_p. So each row is binned instead: NBINS
 * bins by distance below the row's largest logit (a monotone map, so every token of a bin lies
 * between its neighbours'), each bin's probability mass summed in one pass; walking the bins from
 * the top finds the bin that holds the boundary, and only that bin's tokens are sorted, exactly,
 * to place it. (Top-k stays in torch: `topk` of k tokens is already cheap, and a top-p after it
 * works on those k.)
 *
 * The kept set is the one a sort defines (the torch path in minserve/engine/sampler.py): a token
 * is kept when the probability of the tokens before it in descending order is below top_p, so the
 * best token always is; tied tokens are ordered by index. Probabilities are exp(logit - max) from
 * vmath.h's vexp (relative error < 1e-6) summed in double: a boundary can differ from a float32
 * sort-and-cumsum only where top_p lies within that rounding of a prefix sum of the row's
 * probabilities.
 */
#define _POSIX_C_SOURCE 200112L   /* posix_memalign under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vmath.h"   /* vexp, vf16, omp.h */

#define NBINS 2048
#define LOW_LOGIT (-87.0f)   /* below the max by more than this, a token's probability counts as 0 */

typedef union { float f[16]; vf16 v; } Lanes;   /* 16 floats, as a vector or one by one */

typedef struct { float x, e; int32_t i; } Token;

typedef struct {          /* one thread's scratch for a row of V tokens */
    float *e;             /* [V] each token's probability, unnormalized */
    Token *tokens;        /* [V] the boundary bin's tokens */
    double mass[NBINS];
} Scratch;

/* The bins of 16 logits as a vector: distance below the max in units of range / NBINS, clamped
 * (-inf and far below land in the last bin, whose mass is 0). */
static inline vi16 bins16(vf16 x, float mx, float per_unit) {
    vf16 d = (splat(mx) - x) * per_unit;
    d = VSELECT(vi16, vf16, d < (float)(NBINS - 1), d, splat((float)(NBINS - 1)));
    return __builtin_convertvector(d, vi16);
}

/* x[i0 .. i0 + 15] as a vector, lanes past V at -inf. */
static inline vf16 load_padded(const float *x, int64_t i0, int64_t V) {
    Lanes v;
    if (V - i0 >= 16) memcpy(v.f, x + i0, sizeof v.f);
    else for (int j = 0; j < 16; j++) v.f[j] = i0 + j < V ? x[i0 + j] : -INFINITY;
    return v.v;
}

/* Each token's probability e = exp(x - mx) (0 far below the max) and each bin's mass. */
static void fill_bins(const float *x, int64_t V, float mx, float per_unit, Scratch *s) {
    memset(s->mass, 0, sizeof s->mass);
    for (int64_t i0 = 0; i0 < V; i0 += 16) {
        vf16 v = load_padded(x, i0, V), d = v - mx;
        Lanes e;
        union { int32_t i[16]; vi16 v; } b = {.v = bins16(v, mx, per_unit)};
        e.v = VSELECT(vi16, vf16, d >= LOW_LOGIT, vexp(d), splat(0.0f));
        int n = V - i0 < 16 ? (int)(V - i0) : 16;
        memcpy(s->e + i0, e.f, n * sizeof(float));
        for (int j = 0; j < n; j++) s->mass[b.i[j]] += e.f[j];
    }
}

/* Descending logit, then ascending index: the order a stable descending sort gives. */
static int token_order(const void *a, const void *b) {
    const Token *p = a, *q = b;
    if (p->x != q->x) return p->x > q->x ? -1 : 1;
    return (p->i > q->i) - (p->i < q->i);
}

typedef struct {
    float value;     /* the last kept token's logit */
    int64_t ties;    /* tokens with exactly that logit to keep, lowest index first */
    int64_t equal;   /* tokens with that logit in the row */
} Boundary;

/* Where the nucleus ends: the kept tokens are those whose predecessors' mass is below target. */
static Boundary find_boundary(const float *x, int64_t V, float mx, float per_unit, double target,
                              Scratch *s) {
    double before = 0.0;
    int b = 0;
    for (; b < NBINS - 1; b++) {   /* the boundary's bin: the first whose end reaches the target */
        if (s->mass[b] > 0 && before + s->mass[b] >= target) break;
        before += s->mass[b];
    }
    int64_t n = 0;
    for (int64_t i0 = 0; i0 < V; i0 += 16) {   /* the bin's tokens; most vectors hold none */
        union { int32_t i[16]; vi16 v; } in = {.v = bins16(load_padded(x, i0, V), mx, per_unit) == b};
        if (!(in.i[0] | in.i[1] | in.i[2] | in.i[3] | in.i[4] | in.i[5] | in.i[6] | in.i[7] | in.i[8] |
              in.i[9] | in.i[10] | in.i[11] | in.i[12] | in.i[13] | in.i[14] | in.i[15])) continue;
        for (int j = 0; j < 16 && i0 + j < V; j++)
            if (in.i[j]) s->tokens[n++] = (Token){x[i0 + j], s->e[i0 + j], (int32_t)(i0 + j)};
    }
    qsort(s->tokens, n, sizeof(Token), token_order);
    int64_t last = 0;   /* the bin's first token is kept: before < target on entry */
    for (int64_t j = 1; j < n; j++) {
        before += s->tokens[j - 1].e;
        if (before >= target) break;
        last = j;
    }
    Boundary at = {s->tokens[last].x, 0, 0};
    for (int64_t j = 0; j < n; j++)
        if (s->tokens[j].x == at.value) {
            at.equal++;
            at.ties += j <= last;
        }
    return at;
}

/* Below the boundary to -inf, and the tied tokens past its count. */
static void cut(float *x, int64_t V, Boundary at) {
    for (int64_t i = 0; i < V; i++) x[i] = x[i] < at.value ? -INFINITY : x[i];
    if (at.ties == at.equal) return;
    int64_t keep = at.ties;
    for (int64_t i = 0; i < V; i++)
        if (x[i] == at.value && keep-- <= 0) x[i] = -INFINITY;
}

static void filter_row(float *x, int64_t V, float top_p, Scratch *s) {
    vf16 vmax = splat(-INFINITY), vmin = splat(INFINITY);
    vi16 nan = {0};
    for (int64_t i0 = 0; i0 < V; i0 += 16) {
        vf16 v = load_padded(x, i0, V);
        vmax = VSELECT(vi16, vf16, v > vmax, v, vmax);
        vmin = VSELECT(vi16, vf16, (v < vmin) & (v != -INFINITY), v, vmin);
        nan |= v != v;
    }
    Lanes hi = {.v = vmax}, lo = {.v = vmin};
    float mx = -INFINITY, mn = INFINITY;
    int any_nan = 0;
    for (int j = 0; j < 16; j++) {
        mx = hi.f[j] > mx ? hi.f[j] : mx, mn = lo.f[j] < mn ? lo.f[j] : mn;
        any_nan |= nan[j];
    }
    if (any_nan || !(mx > -INFINITY) || !(mx < INFINITY)) return;   /* NaN, all banned, +inf: the caller's case */
    float range = mx - mn > -LOW_LOGIT ? -LOW_LOGIT : mx - mn;
    float per_unit = range > 0 ? (float)(NBINS - 1) / range : 0.0f;
    fill_bins(x, V, mx, per_unit, s);
    double total = 0.0;
    for (int b = 0; b < NBINS; b++) total += s->mass[b];
    cut(x, V, find_boundary(x, V, mx, per_unit, (double)top_p * total, s));
}

/* rows[r] of logits [*, ld] (vocab V) filtered to their top_p[r] nucleus (top_p[r] >= 1: untouched).
 * nthreads <= 0: the OpenMP default. Returns 0, or -1 when a thread's scratch could not be had. */
int64_t ms_top_p(float *logits, int64_t ld, int64_t V, const int64_t *rows, int64_t nrows,
                 const float *top_p, int64_t nthreads) {
    int nt = nthreads > 0 ? (int)nthreads : omp_get_max_threads();
    if (nt > nrows) nt = nrows > 0 ? (int)nrows : 1;
    int64_t failed = 0;
    #pragma omp parallel num_threads(nt) reduction(+ : failed)
    {
        Scratch *s = NULL;
        int ok = posix_memalign((void **)&s, 64, sizeof(Scratch)) == 0;
        if (ok) {
            s->e = malloc((size_t)(V + 16) * sizeof(float));
            s->tokens = malloc((size_t)V * sizeof(Token));
            ok = s->e && s->tokens;
        }
        failed += !ok;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < nrows; r++)
            if (ok && top_p[r] < 1.0f) filter_row(logits + rows[r] * ld, V, top_p[r], s);
        if (s) free(s->e), free(s->tokens), free(s);
    }
    return failed ? -1 : 0;
}
