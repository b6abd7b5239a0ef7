/* e^x on 16 float32 lanes for x <= 0 (AVX-512), shared by the CPU's native kernels. Include
 * after <immintrin.h>, inside an `#if defined(__AVX512F__)`. */
#ifndef SWASERVE_VEC_EXP_H
#define SWASERVE_VEC_EXP_H

/* e^x for x <= 0, 16 lanes; exactly 0 for x < -103 (-inf: a key not seen). x = n ln2 + r,
 * |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error < 1e-8), times 2^n. */
static inline __m512 exp_le0(__m512 x) {
    /* NaN stays live and propagates (max_ps returns its second operand for a NaN) */
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.0f), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(-103.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

#endif
