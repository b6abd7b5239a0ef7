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
 * A work item is up to ROWS_MAX query vectors (rows x the G query heads of one KV head) of one
 * request: each key row read serves all of them, so a prefill chunk reads its keys once per
 * few rows, not once per row. Keys go in blocks aligned to multiples of BLOCK in key position,
 * every (query, key) dot sums its 16-lane chunks in one order, and keys a query may not see
 * weigh exactly 0: a row's result does not depend on the rows beside it (a verify chunk's
 * rows equal decodes' bit for bit; tests/unit/test_cpu_attention.py).
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
#define BLOCK 64    /* keys scored before their values are summed; blocks start at multiples */
#define ROWS_MAX 16 /* query vectors of one work item */

static inline int64_t slot_row(int64_t s, int64_t page_size, int64_t page_rows,
                               int64_t first_row) {
    return s + (s / page_size) * (page_rows - page_size) + first_row;
}

typedef struct {
    const void *pool;
    int dtype;
    const float *lut;
    float k_scale, v_scale;
    int64_t Hkv, D, page_size, page_rows, first_row, row_bytes;
} Pool;

/* The pool rows (K, or V with `v`) of `n` keys at slots[0..n) for KV head kvh. */
static void block_rows(const char **rows, const Pool *pl, const int64_t *slots, int64_t n,
                       int64_t kvh, int v) {
    for (int64_t j = 0; j < n; j++) {
        int64_t row = slot_row(slots[j], pl->page_size, pl->page_rows, pl->first_row);
        rows[j] = (const char *)pl->pool +
                  ((row + (v ? pl->page_size : 0)) * pl->Hkv + kvh) * pl->row_bytes;
    }
}

/* a row of the pool as float32 (a float32 pool's own memory; else converted into tmp) */
static inline const float *row_f32(const char *src, const Pool *pl, float scale, float *tmp) {
    int64_t d = pl->D;
    if (pl->dtype == POOL_F32) return (const float *)src;
    if (pl->dtype == POOL_BF16) {
        const uint16_t *b = (const uint16_t *)src;
        for (int64_t j = 0; j < d; j++) {
            uint32_t u = (uint32_t)b[j] << 16;
            memcpy(&tmp[j], &u, 4);
        }
        return tmp;
    }
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t j = 0; j < d; j++) tmp[j] = pl->lut[b[j]] * scale;
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
#define VECTOR_OK(D) ((D) % VEC == 0)

/* f[e] = the sum of a[e]'s 16 lanes, for 16 vectors at once: 45 shuffles and adds where 16
 * `_mm512_reduce_add_ps` take ~96 instructions. Lane e's sum depends on a[e] alone (the
 * shuffles only route), always in the same order: ((l0 + l2) + (l1 + l3)) within each 128-bit
 * quarter, then (q0 + q2) + (q1 + q3) across quarters. */
static inline __m512 hsum16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++) /* per quarter: [x0 + x2, y0 + y2, x1 + x3, y1 + y3] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per quarter: the quarter's sums of a[4i .. 4i + 3] */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44),
                               _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
    __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44),
                               _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88),
                         _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

/* s[v * BLOCK + j] = scale * q_v . k_j for vectors v < R and keys j in [j0, j1), in tiles of
 * up to 4 x 4 (8 loads for 16 FMAs). Each dot has one accumulator over the chunks in order and
 * the same lane sum (`hsum16`), whatever tile it falls in: the same bits in any tiling. */
#define DOT_TILE(NV, NK)                                                                     \
    static inline void dot_tile_##NV##x##NK(float *s, const float *const *q,                 \
                                            const float *const *k, int64_t j, int64_t D,     \
                                            float scale) {                                   \
        __m512 a[16];                                                                        \
        for (int e = 0; e < 16; e++) a[e] = _mm512_setzero_ps();                             \
        for (int64_t x = 0; x < D; x += VEC) {                                               \
            __m512 kv[NK];                                                                   \
            for (int w = 0; w < NK; w++) kv[w] = _mm512_loadu_ps(k[j + w] + x);              \
            for (int u = 0; u < NV; u++) {                                                   \
                __m512 qv = _mm512_loadu_ps(q[u] + x);                                       \
                for (int w = 0; w < NK; w++)                                                 \
                    a[4 * u + w] = _mm512_fmadd_ps(qv, kv[w], a[4 * u + w]);                 \
            }                                                                                \
        }                                                                                    \
        float f[16];                                                                         \
        _mm512_storeu_ps(f, hsum16(a));                                                      \
        for (int u = 0; u < NV; u++)                                                         \
            for (int w = 0; w < NK; w++) s[u * BLOCK + j + w] = f[4 * u + w] * scale;        \
    }
DOT_TILE(4, 4)
DOT_TILE(4, 1)
DOT_TILE(1, 4)
DOT_TILE(1, 1)

static void score_block(float *s, const float *const *q, int64_t R, const float *const *k,
                        int64_t j0, int64_t j1, int64_t D, float scale) {
    int64_t v = 0;
    for (; v + 4 <= R; v += 4) {
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4) dot_tile_4x4(s + v * BLOCK, q + v, k, j, D, scale);
        for (; j < j1; j++) dot_tile_4x1(s + v * BLOCK, q + v, k, j, D, scale);
    }
    for (; v < R; v++) {
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4) dot_tile_1x4(s + v * BLOCK, q + v, k, j, D, scale);
        for (; j < j1; j++) dot_tile_1x1(s + v * BLOCK, q + v, k, j, D, scale);
    }
}

#include "vec_exp.h"

/* s[j] = e^(s[j] - m) for the whole block (lanes at -inf give 0); returns their sum. */
static float exp_block(float *s, float m) {
    __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < BLOCK; j += VEC) {
        __m512 e = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* acc[v] += sum_j p[v * BLOCK + j] v_j over keys j in [j0, j1), in order: up to two vectors x
 * eight 16-lane chunks of their accumulators held in registers across the keys. */
#define PV_TILE(NV, NC)                                                                      \
    static inline void pv_tile_##NV##x##NC(float *const *acc, const float *const *p,         \
                                           const float *const *v, int64_t j0, int64_t j1,    \
                                           int64_t x) {                                      \
        __m512 r[NV][NC];                                                                    \
        for (int u = 0; u < NV; u++)                                                         \
            for (int c = 0; c < NC; c++) r[u][c] = _mm512_loadu_ps(acc[u] + x + c * VEC);    \
        for (int64_t j = j0; j < j1; j++) {                                                  \
            __m512 vv[NC];                                                                   \
            for (int c = 0; c < NC; c++) vv[c] = _mm512_loadu_ps(v[j] + x + c * VEC);        \
            for (int u = 0; u < NV; u++) {                                                   \
                __m512 pj = _mm512_set1_ps(p[u][j]);                                         \
                for (int c = 0; c < NC; c++) r[u][c] = _mm512_fmadd_ps(pj, vv[c], r[u][c]);  \
            }                                                                                \
        }                                                                                    \
        for (int u = 0; u < NV; u++)                                                         \
            for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc[u] + x + c * VEC, r[u][c]);    \
    }
PV_TILE(2, 8)
PV_TILE(2, 1)
PV_TILE(1, 8)
PV_TILE(1, 1)

static void accumulate_block(float *const *acc, const float *s, int64_t R,
                             const float *const *v, int64_t j0, int64_t j1, int64_t D) {
    const float *p[ROWS_MAX];
    for (int64_t u = 0; u < R; u++) p[u] = s + u * BLOCK;
    int64_t u = 0;
    for (; u + 2 <= R; u += 2) {
        int64_t x = 0;
        for (; x + 8 * VEC <= D; x += 8 * VEC) pv_tile_2x8(acc + u, p + u, v, j0, j1, x);
        for (; x < D; x += VEC) pv_tile_2x1(acc + u, p + u, v, j0, j1, x);
    }
    for (; u < R; u++) {
        int64_t x = 0;
        for (; x + 8 * VEC <= D; x += 8 * VEC) pv_tile_1x8(acc + u, p + u, v, j0, j1, x);
        for (; x < D; x += VEC) pv_tile_1x1(acc + u, p + u, v, j0, j1, x);
    }
}
#else
#define VECTOR_OK(D) 0
static void score_block(float *s, const float *const *q, int64_t R, const float *const *k,
                        int64_t j0, int64_t j1, int64_t D, float scale) {
    (void)s, (void)q, (void)R, (void)k, (void)j0, (void)j1, (void)D, (void)scale;
}
static float exp_block(float *s, float m) { return (void)s, (void)m, 0.0f; }
static void accumulate_block(float *const *acc, const float *s, int64_t R,
                             const float *const *v, int64_t j0, int64_t j1, int64_t D) {
    (void)acc, (void)s, (void)R, (void)v, (void)j0, (void)j1, (void)D;
}
#endif

/* The same three steps in plain C (any head_dim, any CPU). */
static void score_block_c(float *s, const float *const *q, int64_t R, const float *const *k,
                          int64_t j0, int64_t j1, int64_t D, float scale) {
    for (int64_t v = 0; v < R; v++)
        for (int64_t j = j0; j < j1; j++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t x = 0; x < D; x++) dot += q[v][x] * k[j][x];
            s[v * BLOCK + j] = dot * scale;
        }
}

static float exp_block_c(float *s, float m) {
    float sum = 0.0f;
    for (int64_t j = 0; j < BLOCK; j++) {
        s[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

static void accumulate_block_c(float *const *acc, const float *s, int64_t R,
                               const float *const *v, int64_t j0, int64_t j1, int64_t D) {
    for (int64_t u = 0; u < R; u++)
        for (int64_t j = j0; j < j1; j++) {
            float pj = s[u * BLOCK + j];
            float *a = acc[u];
#pragma omp simd
            for (int64_t x = 0; x < D; x++) a[x] += pj * v[j][x];
        }
}

/* One work item: R query vectors q[u] (-> out[u]) of one request and KV head, vector u seeing
 * the keys at positions [lo[u], hi[u]]; `slots` holds the request's keys from position pos0.
 * `buf`: 2 * BLOCK * D floats for a non-float32 pool's rows. */
static void attend_item(float *const *out, const float *const *q, int64_t R, const int64_t *lo,
                        const int64_t *hi, const Pool *pl, const int64_t *slots, int64_t pos0,
                        int64_t kvh, float scale, float softcap, const float *sink,
                        float *buf) {
    int64_t D = pl->D;
    int vec = VECTOR_OK(D);
    float m[ROWS_MAX], l[ROWS_MAX], s[ROWS_MAX * BLOCK], accbuf[ROWS_MAX * D];
    float *acc[ROWS_MAX];
    const char *kraw[BLOCK], *vraw[BLOCK], *next[BLOCK];
    const float *kr[BLOCK], *vr[BLOCK];
    int64_t p0 = lo[0], p1 = hi[0]; /* the keys any vector sees */
    for (int64_t u = 0; u < R; u++) {
        p0 = lo[u] < p0 ? lo[u] : p0;
        p1 = hi[u] > p1 ? hi[u] : p1;
        m[u] = sink ? sink[u] : -INFINITY;
        l[u] = sink ? 1.0f : 0.0f; /* the sink's exp(sink - m) with m = sink */
        acc[u] = accbuf + u * D;
    }
    memset(accbuf, 0, sizeof(float) * R * D);
    for (int64_t b = p0 / BLOCK * BLOCK; b <= p1; b += BLOCK) {
        /* keys at positions b + j for j in [j0, j1) */
        int64_t j0 = p0 > b ? p0 - b : 0, j1 = p1 + 1 - b < BLOCK ? p1 + 1 - b : BLOCK;
        const int64_t *sl = slots + (b + j0 - pos0);
        block_rows(kraw + j0, pl, sl, j1 - j0, kvh, 0);
        block_rows(vraw + j0, pl, sl, j1 - j0, kvh, 1);
        if (b <= p0) prefetch_rows(kraw + j0, j1 - j0, pl->row_bytes);
        prefetch_rows(vraw + j0, j1 - j0, pl->row_bytes);
        if (b + BLOCK <= p1) { /* the next block's keys, while this one computes */
            int64_t nn = p1 + 1 - (b + BLOCK) < BLOCK ? p1 + 1 - (b + BLOCK) : BLOCK;
            block_rows(next, pl, slots + (b + BLOCK - pos0), nn, kvh, 0);
            prefetch_rows(next, nn, pl->row_bytes);
        }
        for (int64_t j = j0; j < j1; j++) {
            kr[j] = row_f32(kraw[j], pl, pl->k_scale, buf + j * D);
            vr[j] = row_f32(vraw[j], pl, pl->v_scale, buf + (BLOCK + j) * D);
        }
        for (int64_t u = 0; u < R; u++)
            for (int64_t j = 0; j < BLOCK; j++) s[u * BLOCK + j] = -INFINITY;
        if (vec) score_block(s, q, R, kr, j0, j1, D, scale);
        else score_block_c(s, q, R, kr, j0, j1, D, scale);
        for (int64_t u = 0; u < R; u++) {
            float *su = s + u * BLOCK;
            /* this vector's keys in the block: the rest weigh exactly 0 */
            int64_t a = lo[u] - b > j0 ? lo[u] - b : j0, z = hi[u] + 1 - b < j1 ? hi[u] + 1 - b : j1;
            for (int64_t j = j0; j < j1; j++) {
                if (j < a || j >= z) su[j] = -INFINITY;
                else if (softcap > 0.0f) su[j] = softcap * tanhf(su[j] / softcap);
            }
            float mb = m[u];
            for (int64_t j = a; j < z; j++) mb = su[j] > mb ? su[j] : mb;
            if (mb == -INFINITY) { /* no key yet and none here: nothing to add */
                for (int64_t j = 0; j < BLOCK; j++) su[j] = 0.0f;
                continue;
            }
            float corr = m[u] == -INFINITY ? 0.0f : expf(m[u] - mb);
            float sum = vec ? exp_block(su, mb) : exp_block_c(su, mb);
            l[u] = l[u] * corr + sum;
            m[u] = mb;
            if (corr != 1.0f) {
                float *au = acc[u];
#pragma omp simd
                for (int64_t x = 0; x < D; x++) au[x] *= corr;
            }
        }
        if (vec) accumulate_block(acc, s, R, vr, j0, j1, D);
        else accumulate_block_c(acc, s, R, vr, j0, j1, D);
    }
    for (int64_t u = 0; u < R; u++) {
        float inv = l[u] > 0.0f ? 1.0f / l[u] : 0.0f;
#pragma omp simd
        for (int64_t x = 0; x < D; x++) out[u][x] = acc[u][x] * inv;
    }
}

/* Attend the query rows of requests `reqs` (n_reqs of them). q and out are float32
 * [T, H, D] contiguous; slots [R, W] int64 (W = slots_w); key_pos0, ctx [R]; qsl [R + 1].
 * Returns 0, -1 when a query's window starts below the keys its request's row of `slots`
 * holds (a layer wider than its group: the caller's bug), -2 when out of memory. */
int swa_paged_attention(float *out, const float *q, const void *pool, int dtype,
                        const float *fp8_lut, float k_scale, float v_scale, const int64_t *slots,
                        int64_t slots_w, const int64_t *key_pos0, const int64_t *ctx,
                        const int64_t *qsl, const int64_t *reqs, int64_t n_reqs, int64_t H,
                        int64_t Hkv, int64_t D, int64_t window, float scale, float softcap,
                        const float *sinks, int64_t page_size, int64_t page_rows,
                        int64_t first_row) {
    int64_t G = H / Hkv;
    if (G > ROWS_MAX) return -3;
    int64_t rows = ROWS_MAX / G; /* query rows of a work item */
    int64_t *first = malloc(sizeof(int64_t) * (n_reqs + 1)); /* first item of each request */
    if (!first) return -2;
    first[0] = 0;
    for (int64_t i = 0; i < n_reqs; i++) {
        int64_t r = reqs[i], n = qsl[r + 1] - qsl[r];
        first[i + 1] = first[i] + (n + rows - 1) / rows * Hkv;
    }
    int64_t items = first[n_reqs];
    int64_t esize = dtype == POOL_F32 ? 4 : dtype == POOL_BF16 ? 2 : 1;
    Pool pl = {pool, dtype, fp8_lut, k_scale, v_scale, Hkv, D, page_size, page_rows, first_row,
               D * esize};
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
        int64_t a = 0, z = n_reqs - 1; /* the request holding item `it` */
        while (a < z) {
            int64_t mid = (a + z + 1) / 2;
            if (first[mid] <= it) a = mid; else z = mid - 1;
        }
        int64_t r = reqs[a], k = it - first[a];
        int64_t i0 = k / Hkv * rows, kvh = k % Hkv, n = qsl[r + 1] - qsl[r];
        int64_t i1 = i0 + rows < n ? i0 + rows : n;
        float *o[ROWS_MAX];
        const float *qv[ROWS_MAX];
        int64_t lo[ROWS_MAX], hi[ROWS_MAX];
        float sk[ROWS_MAX];
        int64_t R = 0;
        for (int64_t i = i0; i < i1; i++) {
            int64_t p = ctx[r] + i, start = window > 0 ? p - window + 1 : 0;
            if (start < 0) start = 0;
            if (start < key_pos0[r]) bad = 1; /* below the keys its group keeps */
            for (int64_t g = 0; g < G; g++, R++) {
                int64_t at = ((qsl[r] + i) * H + kvh * G + g) * D;
                o[R] = out + at;
                qv[R] = q + at;
                lo[R] = start;
                hi[R] = p;
                if (sinks) sk[R] = sinks[kvh * G + g];
            }
        }
        if (bad) continue;
        attend_item(o, qv, R, lo, hi, &pl, slots + r * slots_w, key_pos0[r], kvh, scale,
                    softcap, sinks ? sk : NULL,
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
