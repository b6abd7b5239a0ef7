/* The greedy head's bfloat16 screen (swaserve/ops/greedy_head.py) as one AVX512-BF16 kernel
 * (issue 14, item 4).
 *
 * y[M, N] = x[M, K] W^T with x and W in bfloat16, every product exact and summed in float32
 * (`vdpbf16ps`: two products into each float32 lane, each sum rounded to nearest, denormals
 * flushed), the result rounded to bfloat16 to nearest: the arithmetic greedy_head.py's error
 * bound assumes, in another order of the sums (the bound holds for any). oneDNN's bfloat16
 * GEMM took ~20 ms for Gemma 3's 262,144 x 640 table at 16 rows on the development CPU; this
 * takes ~16: each 16-column block of W streams once past 16 rows held in registers, the next
 * block prefetched.
 *
 * W is packed `[N / 16][K / 2][16]` of bfloat16 pairs (columns n..n+15 of the pair of rows
 * 2k, 2k + 1): one 64-byte load feeds sixteen `vdpbf16ps`, one a query row.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int swa_bf16_screen_available(void) { return 1; }

/* y [M, N] bfloat16 (row stride N), x [M, K] bfloat16 contiguous, wp as above; N % 16 == 0,
 * K % 2 == 0. Returns 0, or -2 when out of memory. */
int swa_bf16_screen(uint16_t *y, const uint16_t *x, const uint32_t *wp, int64_t M, int64_t N,
                    int64_t K) {
    int64_t kp = K / 2, nb = N / 16;
    uint32_t *xt = malloc(sizeof(uint32_t) * kp * 16); /* a tile's rows as [K / 2][16] pairs */
    if (!xt) return -2;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        int64_t mt = M - m0 < 16 ? M - m0 : 16;
        memset(xt, 0, sizeof(uint32_t) * kp * 16);
        for (int64_t m = 0; m < mt; m++)
            for (int64_t k = 0; k < kp; k++)
                xt[k * 16 + m] = ((const uint32_t *)x)[(m0 + m) * kp + k];
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            const uint32_t *w = wp + b * kp * 16;
            __m512 acc[16];
            for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
            for (int64_t k = 0; k < kp; k++) {
                __m512bh wk = (__m512bh)_mm512_loadu_si512(w + k * 16);
                _mm_prefetch((const char *)(w + k * 16 + 1024), _MM_HINT_T0);
                const uint32_t *xk = xt + k * 16;
                for (int m = 0; m < 16; m++)
                    if (m < mt)
                        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(xk[m]), wk);
            }
            for (int m = 0; m < mt; m++)
                _mm256_storeu_si256((__m256i *)(y + (m0 + m) * N + b * 16),
                                    (__m256i)_mm512_cvtneps_pbh(acc[m]));
        }
    }
    free(xt);
    return 0;
}
#else
int swa_bf16_screen_available(void) { return 0; }
int swa_bf16_screen(uint16_t *y, const uint16_t *x, const uint32_t *wp, int64_t M, int64_t N,
                    int64_t K) {
    (void)y, (void)x, (void)wp, (void)M, (void)N, (void)K;
    return -1;
}
#endif
