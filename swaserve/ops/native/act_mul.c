/* A gated MLP's act(gate) * up on the CPU, float32, after gate|up ran as one GEMM (issue 14,
 * item 4).
 *
 * oneDNN runs the merged [2I, K] GEMM ~10% faster than the gate and up GEMMs apart (Gemma 3
 * 270M, 16 rows: 600 against 670 us a layer), but torch then spent three passes (activation,
 * product, copy) on its output. This is one pass over each row of that output:
 *     out[t, i] = act(g) * u,   g = gu[t, i], u = gu[t, I + i]
 * with act(x) = x * sigmoid(z): SiLU z = x; tanh-GELU z = 2 b (x + k x^3), since
 * 0.5 (1 + tanh(y)) = sigmoid(2 y) (b = sqrt(2 / pi), k = 0.044715, torch's constants).
 * sigmoid(z) = 1 / (1 + e) for z >= 0 and e / (1 + e) below, e = exp(-|z|): no cancellation
 * on either side. A few float32 ulps from torch's formulas (tests/unit/test_cpu_act_mul.py).
 */
#include <math.h>
#include <stdint.h>

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
#define PARALLEL_ELEMS 65536 /* a decode's 16 x 2,048 run on one thread (~10 us) */

static const float GELU_2B = 1.5957691216057308f; /* 2 sqrt(2 / pi) */
static const float GELU_K = 0.044715f;

static inline float sigmoid1(float z) {
    float e = expf(-fabsf(z));
    return (z >= 0.0f ? 1.0f : e) / (1.0f + e);
}

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_exp.h"

static inline __m512 act16(__m512 x, int act) {
    __m512 z = x;
    if (act == ACT_GELU_TANH) {
        __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        z = _mm512_mul_ps(_mm512_set1_ps(GELU_2B),
                          _mm512_fmadd_ps(_mm512_set1_ps(GELU_K), x3, x));
    }
    __m512 e = exp_le0(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)));
    __mmask16 neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 num = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), neg, e);
    return _mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}
#endif

static void act_mul_row(float *out, const float *g, const float *u, int64_t inter, int act) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= inter; i += 16) {
        __m512 a = act16(_mm512_loadu_ps(g + i), act);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(a, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; i++) {
        float x = g[i], z = x;
        if (act == ACT_GELU_TANH) z = GELU_2B * (GELU_K * (x * x * x) + x);
        out[i] = (x * sigmoid1(z)) * u[i];
    }
}

/* out [n, inter] = act(gu[:, :inter]) * gu[:, inter:2 inter], gu's rows `gs` floats apart.
 * Returns -1 for an unknown act. */
int swa_act_mul(float *out, const float *gu, int64_t gs, int64_t n, int64_t inter, int act) {
    if (act != ACT_SILU && act != ACT_GELU_TANH) return -1;
#pragma omp parallel for if (n * inter >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < n; t++)
        act_mul_row(out + t * inter, gu + t * gs, gu + t * gs + inter, inter, act);
    return 0;
}
