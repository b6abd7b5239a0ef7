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
 * Only C99 and OpenMP: swaserve/ops/cpu_native.py compiles this at first use with the system's C
 * compiler; the OpenMP runtime is the one torch loaded (same soname), so torch's thread count
 * applies.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { POOL_F32 = 0, POOL_BF16 = 1, POOL_FP8 = 2 };
#define BLOCK 64 /* keys scored before their values are summed */

static inline const float *row_f32(const void *pool, int dtype, int64_t row, int64_t d,
                                   const float *lut, float scale, float *tmp) {
    if (dtype == POOL_F32) return (const float *)pool + row * d;
    if (dtype == POOL_BF16) {
        const uint16_t *src = (const uint16_t *)pool + row * d;
        for (int64_t j = 0; j < d; j++) {
            uint32_t u = (uint32_t)src[j] << 16;
            memcpy(&tmp[j], &u, 4);
        }
        return tmp;
    }
    const uint8_t *src = (const uint8_t *)pool + row * d;
    for (int64_t j = 0; j < d; j++) tmp[j] = lut[src[j]] * scale;
    return tmp;
}

static inline int64_t slot_row(int64_t s, int64_t page_size, int64_t page_rows,
                               int64_t first_row) {
    return s + (s / page_size) * (page_rows - page_size) + first_row;
}

/* One work item: G query heads of one query row that share KV head `kvh`. */
static void attend_row(float *out, const float *q, const void *pool, int dtype, const float *lut,
                       float k_scale, float v_scale, const int64_t *slots, int64_t c0,
                       int64_t c1, int64_t G, int64_t Hkv, int64_t kvh, int64_t D, float scale,
                       float softcap, const float *sinks, int64_t h0, int64_t page_size,
                       int64_t page_rows, int64_t first_row) {
    float m[G], l[G], acc[G * D], s[G * BLOCK], tmp[D];
    for (int64_t g = 0; g < G; g++) {
        m[g] = sinks ? sinks[h0 + g] : -INFINITY;
        l[g] = sinks ? 1.0f : 0.0f; /* the sink's exp(sink - m) with m = sink */
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t b0 = c0; b0 < c1; b0 += BLOCK) {
        int64_t nb = c1 - b0 < BLOCK ? c1 - b0 : BLOCK;
        for (int64_t j = 0; j < nb; j++) {
            int64_t row = slot_row(slots[b0 + j], page_size, page_rows, first_row);
            const float *k = row_f32(pool, dtype, row * Hkv + kvh, D, lut, k_scale, tmp);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t x = 0; x < D; x++) dot += qg[x] * k[x];
                dot *= scale;
                if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
                s[g * BLOCK + j] = dot;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + g * BLOCK;
            float mb = m[g];
            for (int64_t j = 0; j < nb; j++) mb = sg[j] > mb ? sg[j] : mb;
            /* m[g] = -inf only before any key and without a sink: acc and l are 0 then */
            float corr = m[g] == -INFINITY ? 0.0f : expf(m[g] - mb);
            float sum = 0.0f;
            for (int64_t j = 0; j < nb; j++) {
                sg[j] = expf(sg[j] - mb);
                sum += sg[j];
            }
            l[g] = l[g] * corr + sum;
            m[g] = mb;
            if (corr != 1.0f) {
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t x = 0; x < D; x++) ag[x] *= corr;
            }
        }
        for (int64_t j = 0; j < nb; j++) {
            int64_t row = slot_row(slots[b0 + j], page_size, page_rows, first_row) + page_size;
            const float *v = row_f32(pool, dtype, row * Hkv + kvh, D, lut, v_scale, tmp);
            for (int64_t g = 0; g < G; g++) {
                float p = s[g * BLOCK + j];
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t x = 0; x < D; x++) ag[x] += p * v[x];
            }
        }
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
        attend_row(out + (t * H + kvh * G) * D, q + (t * H + kvh * G) * D, pool, dtype,
                   fp8_lut, k_scale, v_scale, slots + r * slots_w, start - key_pos0[r],
                   p + 1 - key_pos0[r], G, Hkv, kvh, D, scale, softcap, sinks, kvh * G,
                   page_size, page_rows, first_row);
    }
    free(first);
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
