/* Paged attention on the CPU, reading the KV pool in place (issue 14, item 4).
 *
 * The torch backend gathers every key and value a step reads into fresh tensors (one
 * `index_select` per layer and side) before torch's SDPA reads them again: a decode step of 16
 * requests over ~200 keys moved each ~5 MB layer three times. Here each query row walks its
 * visible keys straight from the pool's pages, in blocks, with an online softmax.
 *
 * Layout (swaserve/memory/kv_pool.py): the pool is rows of [kv_heads, head_dim]; the K of flat
 * slot s = page * page_size + offset of a layer is row
 *     s + (s / page_size) * (page_rows - page_size) + first_row
 * and its V is that row + page_size.
 *
 * Semantics (those of swaserve/attention/torch_backend.py `attend_batched`): request r's query i
 * is at position p = ctx[r] + i and sees keys at positions [max(lo, p - window + 1), p], where
 * lo = key_pos0[r] is the position of column 0 of its row of `slots` (full layers: window <= 0).
 * Query head h reads KV head h / (H / Hkv). Soft-capping: s = cap * tanh(s / cap). A sink is one
 * more logit per query head in the softmax's denominator, with no value.
 *
 * Every (request, query, KV head) is one work item with its own key range, so a row's result
 * does not depend on what else is in the batch (a verify chunk's rows equal decodes').
 * With AVX-512 and head_dim % 16 == 0 the dots, the exponentials and the value sums run on 16
 * lanes (intrinsics); any other case takes the plain C of the same steps. Only C99, OpenMP and
 * <immintrin.h>: swaserve/ops/cpu_native.py compiles this at first use with the system's C
 * compiler; the OpenMP runtime is the one torch loaded (same soname), so torch's thread count
 * applies.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { POOL_F32 = 0, POOL_BF16 = 1, POOL_FP8 = 2 };
#define BLOCK 64 /* keys scored before their values are summed */

static inline int64_t slot_row(int64_t s, int64_t page_size, int64_t page_rows,
                               int64_t first_row) {
    return s + (s / page_size) * (page_rows - page_size) + first_row;
}

static inline const char *row_addr(const void *pool, int dtype, int64_t row, int64_t d) {
    int64_t size = dtype == POOL_F32 ? 4 : dtype == POOL_BF16 ? 2 : 1;
    return (const char *)pool + row * d * size;
}

/* a row of the pool as float32 (a float32 pool's own memory; else converted into tmp) */
static inline const float *row_f32(const char *src, int dtype, int64_t d, const float *lut,
                                   float scale, float *tmp) {
    if (dtype == POOL_F32) return (const float *)src;
    if (dtype == POOL_BF16) {
        const uint16_t *b = (const uint16_t *)src;
        for (int64_t j = 0; j < d; j++) {
            uint32_t u = (uint32_t)b[j] << 16;
            memcpy(&tmp[j], &u, 4);
        }
        return tmp;
    }
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t j = 0; j < d; j++) tmp[j] = lut[b[j]] * scale;
    return tmp;
}

/* Ask for a block's rows ahead of use (into L2): the pages of a request are scattered, so the
 * hardware prefetcher restarts at each one. */
static inline void prefetch_rows(const char *const *rows, int64_t n, int64_t bytes) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(rows[j] + o, 0, 2);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define VEC 16

/* s[g * BLOCK + j] = scale * q_g . k_j for G heads and nb keys; D % 16 == 0. Four partial sums
 * a head: one accumulator chained D / 16 deep made the dot latency-bound. */
static void score_block(float *s, const float *q, const float *const *k, int64_t nb, int64_t G,
                        int64_t D, float scale) {
    for (int64_t j = 0; j < nb; j++) {
        const float *kj = k[j];
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int64_t x = 0;
            for (; x + 4 * VEC <= D; x += 4 * VEC) {
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + x), _mm512_loadu_ps(kj + x), a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + x + VEC),
                                     _mm512_loadu_ps(kj + x + VEC), a1);
                a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + x + 2 * VEC),
                                     _mm512_loadu_ps(kj + x + 2 * VEC), a2);
                a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + x + 3 * VEC),
                                     _mm512_loadu_ps(kj + x + 3 * VEC), a3);
            }
            for (; x < D; x += VEC)
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + x), _mm512_loadu_ps(kj + x), a0);
            a0 = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
            s[g * BLOCK + j] = _mm512_reduce_add_ps(a0) * scale;
        }
    }
}

/* e^x for x <= 0 (and x = -inf -> 0), 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
 * Taylor series to r^7 (relative error < 1e-8, under float32's rounding), times 2^n. */
static inline __m512 exp_le0(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* e^-104 is below float32's denormals */
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
    return _mm512_scalef_ps(p, n);
}

/* s[j] = e^(s[j] - m) for j < n; returns their sum. */
static float exp_block(float *s, int64_t n, float m) {
    __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + VEC <= n; j += VEC) {
        __m512 e = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (j < n) {
        __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv));
        _mm512_mask_storeu_ps(s + j, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* acc[g] += sum_j p[g * BLOCK + j] v_j, eight vectors of a head's accumulator held in
 * registers across the block's keys (independent chains: the FMAs do not wait on each other). */
static void accumulate_block(float *acc, const float *p, const float *const *v, int64_t nb,
                             int64_t G, int64_t D) {
    for (int64_t g = 0; g < G; g++) {
        const float *pg = p + g * BLOCK;
        float *ag = acc + g * D;
        int64_t x = 0;
        for (; x + 8 * VEC <= D; x += 8 * VEC) {
            __m512 r[8];
            for (int u = 0; u < 8; u++) r[u] = _mm512_loadu_ps(ag + x + u * VEC);
            for (int64_t j = 0; j < nb; j++) {
                __m512 pj = _mm512_set1_ps(pg[j]);
                const float *vj = v[j] + x;
                for (int u = 0; u < 8; u++)
                    r[u] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + u * VEC), r[u]);
            }
            for (int u = 0; u < 8; u++) _mm512_storeu_ps(ag + x + u * VEC, r[u]);
        }
        for (; x < D; x += VEC) {
            __m512 r0 = _mm512_loadu_ps(ag + x);
            for (int64_t j = 0; j < nb; j++)
                r0 = _mm512_fmadd_ps(_mm512_set1_ps(pg[j]), _mm512_loadu_ps(v[j] + x), r0);
            _mm512_storeu_ps(ag + x, r0);
        }
    }
}
#define VECTOR_OK(D) ((D) % VEC == 0)
#else
#define VECTOR_OK(D) 0
static void score_block(float *s, const float *q, const float *const *k, int64_t nb, int64_t G,
                        int64_t D, float scale) {
    (void)s, (void)q, (void)k, (void)nb, (void)G, (void)D, (void)scale;
}
static float exp_block(float *s, int64_t n, float m) { return (void)s, (void)n, (void)m, 0.0f; }
static void accumulate_block(float *acc, const float *p, const float *const *v, int64_t nb,
                             int64_t G, int64_t D) {
    (void)acc, (void)p, (void)v, (void)nb, (void)G, (void)D;
}
#endif

/* The same three steps in plain C (any head_dim, any CPU). */
static void score_block_c(float *s, const float *q, const float *const *k, int64_t nb, int64_t G,
                          int64_t D, float scale) {
    for (int64_t j = 0; j < nb; j++)
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t x = 0; x < D; x++) dot += qg[x] * k[j][x];
            s[g * BLOCK + j] = dot * scale;
        }
}

static float exp_block_c(float *s, int64_t n, float m) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

static void accumulate_block_c(float *acc, const float *p, const float *const *v, int64_t nb,
                               int64_t G, int64_t D) {
    for (int64_t j = 0; j < nb; j++)
        for (int64_t g = 0; g < G; g++) {
            float pj = p[g * BLOCK + j];
            float *ag = acc + g * D;
#pragma omp simd
            for (int64_t x = 0; x < D; x++) ag[x] += pj * v[j][x];
        }
}

typedef struct {
    const void *pool;
    int dtype;
    const float *lut;
    float k_scale, v_scale;
    int64_t Hkv, D, page_size, page_rows, first_row;
} Pool;

/* The pool rows (K, or V with `v`) of keys [b0, b0 + n) of a request's slots. */
static void block_rows(const char **rows, const Pool *pl, const int64_t *slots, int64_t b0,
                       int64_t n, int64_t kvh, int v) {
    for (int64_t j = 0; j < n; j++) {
        int64_t row = slot_row(slots[b0 + j], pl->page_size, pl->page_rows, pl->first_row);
        rows[j] = row_addr(pl->pool, pl->dtype, (row + (v ? pl->page_size : 0)) * pl->Hkv + kvh,
                           pl->D);
    }
}

/* One work item: G query heads of one query row that share KV head `kvh`, over keys
 * [c0, c1) of its request's slots. `buf`: 2 * BLOCK * D floats for a non-float32 pool's rows. */
static void attend_row(float *out, const float *q, const Pool *pl, const int64_t *slots,
                       int64_t c0, int64_t c1, int64_t G, int64_t kvh, float scale,
                       float softcap, const float *sinks, int64_t h0, float *buf) {
    int64_t D = pl->D;
    int vec = VECTOR_OK(D);
    float m[G], l[G], acc[G * D], s[G * BLOCK];
    const char *kraw[BLOCK], *vraw[BLOCK], *next[BLOCK];
    const float *kr[BLOCK], *vr[BLOCK];
    int64_t bytes = D * (pl->dtype == POOL_F32 ? 4 : pl->dtype == POOL_BF16 ? 2 : 1);
    for (int64_t g = 0; g < G; g++) {
        m[g] = sinks ? sinks[h0 + g] : -INFINITY;
        l[g] = sinks ? 1.0f : 0.0f; /* the sink's exp(sink - m) with m = sink */
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t b0 = c0; b0 < c1; b0 += BLOCK) {
        int64_t nb = c1 - b0 < BLOCK ? c1 - b0 : BLOCK;
        block_rows(kraw, pl, slots, b0, nb, kvh, 0);
        block_rows(vraw, pl, slots, b0, nb, kvh, 1);
        if (b0 == c0) prefetch_rows(kraw, nb, bytes);
        prefetch_rows(vraw, nb, bytes);
        int64_t nn = c1 - (b0 + nb) < BLOCK ? c1 - (b0 + nb) : BLOCK;
        if (nn > 0) { /* the next block's keys, while this one computes */
            block_rows(next, pl, slots, b0 + nb, nn, kvh, 0);
            prefetch_rows(next, nn, bytes);
        }
        for (int64_t j = 0; j < nb; j++) {
            kr[j] = row_f32(kraw[j], pl->dtype, D, pl->lut, pl->k_scale, buf + j * D);
            vr[j] = row_f32(vraw[j], pl->dtype, D, pl->lut, pl->v_scale, buf + (BLOCK + j) * D);
        }
        if (vec) score_block(s, q, kr, nb, G, D, scale);
        else score_block_c(s, q, kr, nb, G, D, scale);
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + g * BLOCK;
            if (softcap > 0.0f)
                for (int64_t j = 0; j < nb; j++) sg[j] = softcap * tanhf(sg[j] / softcap);
            float mb = m[g];
            for (int64_t j = 0; j < nb; j++) mb = sg[j] > mb ? sg[j] : mb;
            /* m[g] = -inf only before any key and without a sink: acc and l are 0 then */
            float corr = m[g] == -INFINITY ? 0.0f : expf(m[g] - mb);
            float sum = vec ? exp_block(sg, nb, mb) : exp_block_c(sg, nb, mb);
            l[g] = l[g] * corr + sum;
            m[g] = mb;
            if (corr != 1.0f) {
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t x = 0; x < D; x++) ag[x] *= corr;
            }
        }
        if (vec) accumulate_block(acc, s, vr, nb, G, D);
        else accumulate_block_c(acc, s, vr, nb, G, D);
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        float *og = out + g * D;
        const float *ag = acc + g * D;
#pragma omp simd
        for (int64_t x = 0; x < D; x++) og[x] = ag[x] * inv;
    }
}

/* Attend the query rows of requests `reqs` (n_reqs of them). q and out are float32
 * [T, H, D] contiguous; slots [R, W] int64 (W = slots_w); key_pos0, ctx [R]; qsl [R + 1].
 * Returns 0, or -1 when a request's query sees no key it may read (a window narrower than its
 * group's: the caller's bug). */
int swa_paged_attention(float *out, const float *q, const void *pool, int dtype,
                        const float *fp8_lut, float k_scale, float v_scale, const int64_t *slots,
                        int64_t slots_w, const int64_t *key_pos0, const int64_t *ctx,
                        const int64_t *qsl, const int64_t *reqs, int64_t n_reqs, int64_t H,
                        int64_t Hkv, int64_t D, int64_t window, float scale, float softcap,
                        const float *sinks, int64_t page_size, int64_t page_rows,
                        int64_t first_row) {
    int64_t G = H / Hkv;
    int64_t *first = malloc(sizeof(int64_t) * (n_reqs + 1)); /* first item of each request */
    if (!first) return -2;
    first[0] = 0;
    for (int64_t i = 0; i < n_reqs; i++) {
        int64_t r = reqs[i];
        first[i + 1] = first[i] + (qsl[r + 1] - qsl[r]) * Hkv;
    }
    int64_t items = first[n_reqs];
    Pool pl = {pool, dtype, fp8_lut, k_scale, v_scale, Hkv, D, page_size, page_rows, first_row};
    float *buf = NULL; /* per thread: a block's K and V rows as float32 (non-float32 pools) */
    if (dtype != POOL_F32) {
        buf = malloc(sizeof(float) * (size_t)omp_get_max_threads() * 2 * BLOCK * D);
        if (!buf) {
            free(first);
            return -2;
        }
    }
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad)
    for (int64_t it = 0; it < items; it++) {
        int64_t lo = 0, hi = n_reqs - 1; /* the request holding item `it` */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (first[mid] <= it) lo = mid; else hi = mid - 1;
        }
        int64_t r = reqs[lo], k = it - first[lo];
        int64_t i = k / Hkv, kvh = k % Hkv;
        int64_t p = ctx[r] + i, start = window > 0 ? p - window + 1 : 0;
        if (start < 0) start = 0;
        if (start < key_pos0[r]) { /* below the keys its group keeps */
            bad = 1;
            continue;
        }
        int64_t t = qsl[r] + i;
        attend_row(out + (t * H + kvh * G) * D, q + (t * H + kvh * G) * D, &pl,
                   slots + r * slots_w, start - key_pos0[r], p + 1 - key_pos0[r], G, kvh, scale,
                   softcap, sinks, kvh * G,
                   buf ? buf + (int64_t)omp_get_thread_num() * 2 * BLOCK * D : NULL);
    }
    free(first);
    free(buf);
    return bad ? -1 : 0;
}

/* Store new K and V rows (float32 [T, Hkv * D], the pool's own dtype) at flat slots. */
void swa_store_f32(float *pool, const float *k, const float *v, const int64_t *slot_mapping,
                   int64_t T, int64_t row_elems, int64_t page_size, int64_t page_rows,
                   int64_t first_row) {
    for (int64_t t = 0; t < T; t++) {
        int64_t row = slot_row(slot_mapping[t], page_size, page_rows, first_row);
        memcpy(pool + row * row_elems, k + t * row_elems, sizeof(float) * row_elems);
        memcpy(pool + (row + page_size) * row_elems, v + t * row_elems,
               sizeof(float) * row_elems);
    }
}
