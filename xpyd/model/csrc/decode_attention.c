/* Decode attention over xpyd's KV pool, bfloat16 in, float32 math, bfloat16 out.
 *
 * One query token per request. For request b and KV head h (one work item each, spread over OpenMP
 * threads) the kernel first writes the step's new K and V at position len[b]-1 of the request's slot,
 * then computes softmax(q k^T * scale) v for the `group` query heads that share h, reading K and V in
 * place from the pool through its strides (no gather, no float32 copy of the cache). The numbers are
 * the ones `llama_fast._matmul_attention` computes (float32 products and softmax, one rounding to
 * bfloat16 at the end).
 *
 * Built and loaded by xpyd/model/native.py with the machine's C compiler; called through ctypes with
 * raw pointers and element strides (all strides are in elements, not bytes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* Rows this many tokens ahead are prefetched: consecutive tokens of one layer sit a whole token of KV
   apart (23 KB for SmolLM2-135M), too far for the hardware prefetcher (measured: 4, 8, 16 -> 16 best,
   10-30% faster than none; an AVX-512-BF16 intrinsics version was 1.5-2x slower than this plain C). */
#define XPYD_PREFETCH 16
#define XPYD_MAX_GROUP 16
#define XPYD_MAX_HEAD_DIM 256

/* One (request, KV head) item: softmax(q k^T * scale) v for the `group` query heads sharing that KV head.
   always_inline: the dispatch below compiles it once per common (group, head_dim), both constant, so the
   loops unroll (15-20% faster than the generic copy in an A/B here); other shapes run the generic copy. */
static inline __attribute__((always_inline)) void attend_item(
    const uint16_t *q, const uint16_t *base, int64_t n, int64_t token_stride, int64_t k_off, int64_t v_off,
    float scale, float *scores, uint16_t *out, const int group, const int head_dim) {
    float qf[XPYD_MAX_GROUP][XPYD_MAX_HEAD_DIM], acc[XPYD_MAX_GROUP][XPYD_MAX_HEAD_DIM];
    float row[XPYD_MAX_HEAD_DIM], top[XPYD_MAX_GROUP], sum[XPYD_MAX_GROUP];
    for (int g = 0; g < group; g++) {
        for (int d = 0; d < head_dim; d++) {
            qf[g][d] = bf16_to_f32(q[g * head_dim + d]);
            acc[g][d] = 0.0f;
        }
        top[g] = -3.0e38f;
    }
    for (int64_t t = 0; t < n; t++) { /* scores = q . k */
        const uint16_t *kt = base + t * token_stride + k_off;
        if (t + XPYD_PREFETCH < n)
            for (int d = 0; d < head_dim; d += 32) __builtin_prefetch(kt + XPYD_PREFETCH * token_stride + d, 0, 3);
        for (int d = 0; d < head_dim; d++) row[d] = bf16_to_f32(kt[d]);
        for (int g = 0; g < group; g++) {
            float s = 0.0f;
            for (int d = 0; d < head_dim; d++) s += qf[g][d] * row[d];
            s *= scale;
            scores[g * n + t] = s;
            if (s > top[g]) top[g] = s;
        }
    }
    for (int g = 0; g < group; g++) { /* softmax numerators and their sum */
        float total = 0.0f;
        float *sg = scores + g * n;
        for (int64_t t = 0; t < n; t++) {
            const float e = expf(sg[t] - top[g]);
            sg[t] = e;
            total += e;
        }
        sum[g] = total;
    }
    for (int64_t t = 0; t < n; t++) { /* acc = sum_t p_t v_t */
        const uint16_t *vt = base + t * token_stride + v_off;
        if (t + XPYD_PREFETCH < n)
            for (int d = 0; d < head_dim; d += 32) __builtin_prefetch(vt + XPYD_PREFETCH * token_stride + d, 0, 3);
        for (int d = 0; d < head_dim; d++) row[d] = bf16_to_f32(vt[d]);
        for (int g = 0; g < group; g++) {
            const float p = scores[g * n + t];
            for (int d = 0; d < head_dim; d++) acc[g][d] += p * row[d];
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = 1.0f / sum[g];
        for (int d = 0; d < head_dim; d++) out[g * head_dim + d] = f32_to_bf16(acc[g][d] * inv);
    }
}

/* The shapes of common models get their own compiled copy (group = heads / kv_heads). */
#define XPYD_SHAPE(G, D) \
    if (group == G && head_dim == D) { \
        attend_item(q, base, n, token_stride, k_off, v_off, scale, scores, out, G, D); \
        return; \
    }

static void attend(const uint16_t *q, const uint16_t *base, int64_t n, int64_t token_stride, int64_t k_off,
                   int64_t v_off, float scale, float *scores, uint16_t *out, int group, int head_dim) {
    XPYD_SHAPE(3, 64)  /* SmolLM2-135M */
    XPYD_SHAPE(4, 64)  /* Llama 3.2 1B, SmolLM2-360M-ish */
    XPYD_SHAPE(8, 64)  /* TinyLlama */
    XPYD_SHAPE(4, 128) /* Llama 3 8B, Mistral 7B */
    XPYD_SHAPE(8, 128) /* Llama 3 70B */
    XPYD_SHAPE(7, 64)  /* Qwen2 0.5B */
    XPYD_SHAPE(6, 128) /* Qwen2 1.5B */
    XPYD_SHAPE(1, 64)
    XPYD_SHAPE(1, 128)
    attend_item(q, base, n, token_stride, k_off, v_off, scale, scores, out, group, head_dim);
}

int xpyd_abi_version(void) { return 1; }

/* Returns 0, or a negative code for arguments the kernel does not handle (nothing is written then). */
int xpyd_decode_attention_bf16(
    const uint16_t *q, int64_t q_row,          /* [B, heads, head_dim]: row stride q_row, heads contiguous */
    const uint16_t *k_new, int64_t k_new_row,  /* [B, kv_heads, head_dim] */
    const uint16_t *v_new, int64_t v_new_row,
    uint16_t *kv, int64_t slot_stride, int64_t token_stride, int64_t k_off, int64_t v_off, int64_t head_stride,
    const int64_t *slots, const int64_t *lens, /* lens[b]: tokens to attend over, the new one included */
    int batch, int heads, int kv_heads, int head_dim, float scale,
    uint16_t *out,                             /* [B, heads, head_dim] contiguous */
    int threads) {
    if (batch <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || head_dim > XPYD_MAX_HEAD_DIM ||
        heads / kv_heads > XPYD_MAX_GROUP || threads <= 0)
        return -1;
    for (int b = 0; b < batch; b++)
        if (lens[b] <= 0) return -2;
    const int group = heads / kv_heads;
    int failed = 0;

#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : failed)
    for (int item = 0; item < batch * kv_heads; item++) {
        const int b = item / kv_heads, h = item % kv_heads;
        const int64_t n = lens[b];
        uint16_t *base = kv + slots[b] * slot_stride + (int64_t)h * head_stride;
        uint16_t *k_last = base + (n - 1) * token_stride + k_off, *v_last = base + (n - 1) * token_stride + v_off;
        memcpy(k_last, k_new + b * k_new_row + (int64_t)h * head_dim, sizeof(uint16_t) * head_dim);
        memcpy(v_last, v_new + b * v_new_row + (int64_t)h * head_dim, sizeof(uint16_t) * head_dim);

        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)n);
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        attend(q + b * q_row + (int64_t)h * group * head_dim, base, n, token_stride, k_off, v_off, scale, scores,
               out + ((int64_t)b * heads + h * group) * head_dim, group, head_dim);
        free(scores);
    }
    return failed ? -3 : 0;
}
