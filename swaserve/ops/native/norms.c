/* RMSNorm, the residual add before it and the attention prologue (q/k norms, rotary) for the
 * CPU, float32, one pass over each row (issue 14, item 4).
 *
 * torch 2.13 runs `torch.rms_norm` as several ops (pow, mean, rsqrt, two products), and the
 * prologue's rotary as four more: a Gemma 3 270M decode step spent ~3 ms in its 36 residual
 * adds and norms, ~90 us a call for 16 rows of 640, nearly all dispatch. These are the same
 * formulas as swaserve/ops/cpu_prologue.py, in the same order of roundings except the sum of
 * squares (vectorised here in another order, so a few ulps apart):
 *     norm(x) = (x * (1 / sqrt(mean(x^2) + eps))) * scale     (scale: 1 + w or w)
 *     rotary(v)[i] = v[i] * cos[i] + v[(i + D/2) % D] * sin'[i]   (sin': -sin on the first half)
 */
#include <math.h>
#include <stdint.h>

__attribute__((optimize("fp-contract=off"))) static inline void norm_row(float *out, const float *x, const float *scale, float eps,
                            int64_t dim) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = (x[i] * r) * scale[i];
}

#define PARALLEL_ROWS 64 /* fewer rows than this: one thread (a decode's 16 are ~1 us) */

/* out [n, dim] = norm(x), x rows `xs` floats apart. */
void swa_rmsnorm(float *out, const float *x, int64_t xs, const float *scale, float eps, int64_t n,
                 int64_t dim) {
#pragma omp parallel for if (n >= PARALLEL_ROWS)
    for (int64_t t = 0; t < n; t++) norm_row(out + t * dim, x + t * xs, scale, eps, dim);
}

/* s = residual + (x_scale ? norm(x, x_scale, x_eps) : x); normed = norm(s, scale, eps).
 * x rows `xs` apart, residual rows `rs` apart; s and normed [n, dim] contiguous. */
void swa_add_rmsnorm(float *normed, float *s, const float *x, int64_t xs, const float *residual,
                     int64_t rs, const float *x_scale, float x_eps, const float *scale, float eps,
                     int64_t n, int64_t dim) {
#pragma omp parallel for if (n >= PARALLEL_ROWS)
    for (int64_t t = 0; t < n; t++) {
        float *st = s + t * dim;
        const float *rt = residual + t * rs;
        if (x_scale) {
            norm_row(st, x + t * xs, x_scale, x_eps, dim);
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) st[i] = rt[i] + st[i];
        } else {
            const float *xt = x + t * xs;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) st[i] = rt[i] + xt[i];
        }
        norm_row(normed + t * dim, st, scale, eps, dim);
    }
}

/* out [n, heads, d] from the first heads * d columns of qkv (rows `qs` apart): each head
 * normed by its row of qk_scale [heads, d] (none when NULL), then rotated by the step's tables
 * cos, sin' [n, d]. */
/* no fused multiply-adds: each product rounded, as torch's x * cos + swap(x) * sin' */
__attribute__((optimize("fp-contract=off"))) void swa_qk_prologue(float *out, const float *qkv, int64_t qs, const float *qk_scale, float eps,
                     const float *cos_t, const float *sin_t, int64_t n, int64_t heads,
                     int64_t d) {
    int64_t half = d / 2;
#pragma omp parallel for if (n >= PARALLEL_ROWS)
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos_t + t * d, *sn = sin_t + t * d;
        float v[d];
        for (int64_t h = 0; h < heads; h++) {
            const float *src = qkv + t * qs + h * d;
            if (qk_scale) {
                norm_row(v, src, qk_scale + h * d, eps, d);
            } else {
#pragma omp simd
                for (int64_t i = 0; i < d; i++) v[i] = src[i];
            }
            float *o = out + (t * heads + h) * d;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) o[i] = v[i] * c[i] + v[i + half] * sn[i];
#pragma omp simd
            for (int64_t i = half; i < d; i++) o[i] = v[i] * c[i] + v[i - half] * sn[i];
        }
    }
}
