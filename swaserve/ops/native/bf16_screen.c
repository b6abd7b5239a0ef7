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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define SCAN_BLOCK 256 /* columns whose maximum is tested before any of them is */

static inline float bf16_value(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* x rounded down to float32: every float32 y >= x is >= the result. */
static inline float down_to_float32(double x) {
    float f = (float)x;
    return (double)f > x ? nextafterf(f, -INFINITY) : f;
}

/* The largest of row[c0 .. c1) as float32 values. */
static inline float block_max(const uint16_t *row, int64_t c0, int64_t c1) {
    float mx = -INFINITY;
    int64_t c = c0;
#if defined(__AVX512F__)
    __m512 v = _mm512_set1_ps(-INFINITY);
    for (; c + 16 <= c1; c += 16) { /* bfloat16 -> float32: the bits shifted up */
        __m256i h = _mm256_loadu_si256((const __m256i *)(row + c));
        v = _mm512_max_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    mx = _mm512_reduce_max_ps(v);
#endif
    for (; c < c1; c++) {
        float f = bf16_value(row[c]);
        mx = f > mx ? f : mx;
    }
    return mx;
}

/* greedy_head.py's `candidates` for a screen y [M, N] (bfloat16, rows N apart): per row, the
 * largest value of each block of SCAN_BLOCK columns, the row's floor lo = max over blocks of
 * (m - a - b|m|), then every token of a block with m + a + b|m| >= lo whose value is at least
 * the threshold t (y + a + b|y| >= lo solved for y, rounded down to float32). Writes up to
 * `cap` (row, token) pairs to `pairs` [cap, 2], in row then token order; returns how many
 * there are (more than cap: the caller takes the float32 head). `a` [M] in float64. */
int64_t swa_screen_candidates(const uint16_t *y, int64_t M, int64_t N, const double *a, double b,
                              int64_t *pairs, int64_t cap) {
    int64_t nb = (N + SCAN_BLOCK - 1) / SCAN_BLOCK;
    double *m = malloc(sizeof(double) * (M * nb > 0 ? M * nb : 1));
    int64_t *count = calloc((size_t)(M > 0 ? M : 1), sizeof(int64_t));
    float *thr = malloc(sizeof(float) * (M > 0 ? M : 1));
    double *lo = malloc(sizeof(double) * (M > 0 ? M : 1));
    if (!m || !count || !thr || !lo) {
        free(m), free(count), free(thr), free(lo);
        return -2;
    }
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *row = y + r * N;
        double best = -INFINITY;
        for (int64_t k = 0; k < nb; k++) {
            int64_t c1 = (k + 1) * SCAN_BLOCK < N ? (k + 1) * SCAN_BLOCK : N;
            double md = block_max(row, k * SCAN_BLOCK, c1);
            m[r * nb + k] = md;
            double low = md - a[r] - b * fabs(md);
            best = low > best ? low : best;
        }
        lo[r] = best;
        double d = best - a[r];
        thr[r] = down_to_float32(d >= 0 ? d / (1 + b) : d / (1 - b));
        int64_t n = 0; /* this row's candidates */
        for (int64_t k = 0; k < nb; k++) {
            double md = m[r * nb + k];
            if (md + a[r] + b * fabs(md) < best) continue;
            int64_t c1 = (k + 1) * SCAN_BLOCK < N ? (k + 1) * SCAN_BLOCK : N;
            for (int64_t c = k * SCAN_BLOCK; c < c1; c++) n += bf16_value(row[c]) >= thr[r];
        }
        count[r] = n;
    }
    int64_t total = 0;
    for (int64_t r = 0; r < M; r++) total += count[r];
    if (total <= cap) { /* the pairs, row by row (each row's run starts after the rows before) */
        int64_t at = 0;
        for (int64_t r = 0; r < M; r++) {
            const uint16_t *row = y + r * N;
            for (int64_t k = 0; k < nb; k++) {
                double md = m[r * nb + k];
                if (md + a[r] + b * fabs(md) < lo[r]) continue;
                int64_t c1 = (k + 1) * SCAN_BLOCK < N ? (k + 1) * SCAN_BLOCK : N;
                for (int64_t c = k * SCAN_BLOCK; c < c1; c++)
                    if (bf16_value(row[c]) >= thr[r]) {
                        pairs[2 * at] = r;
                        pairs[2 * at + 1] = c;
                        at++;
                    }
            }
        }
    }
    free(m), free(count), free(thr), free(lo);
    return total;
}

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
