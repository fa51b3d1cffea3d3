/* The lean forward's per-layer pointwise steps in bfloat16, one call each instead of 5-8 torch ops.
 *
 * Each computes what `llama_fast._rms_norm` / `FastLlama._rope` compute op by op, with the same
 * roundings to bfloat16 between the steps (so the results match torch's but for the order of one float32
 * sum). Rows are spread over OpenMP threads (torch's team: see xpyd/model/native.py).
 * Strides are in elements.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* bf16 a * b as torch rounds it */
static inline float mul_bf16(float a, float b) { return bf16_to_f32(f32_to_bf16(a * b)); }

int xpyd_pointwise_abi_version(void) { return 1; }

/* out[r] = bf16(bf16(x[r] * rsqrt(mean(x[r]^2) + eps)) * w), float32 statistics (transformers' RMSNorm). */
int xpyd_rms_norm_bf16(const uint16_t *x, int64_t x_row, const uint16_t *w, uint16_t *out, int64_t out_row,
                       int64_t rows, int n, float eps, int threads) {
    if (rows <= 0 || n <= 0 || threads <= 0) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_row;
        uint16_t *o = out + r * out_row;
        float squares = 0.0f;
        for (int i = 0; i < n; i++) {
            const float f = bf16_to_f32(xr[i]);
            squares += f * f;
        }
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);
        for (int i = 0; i < n; i++)
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * inv)) * bf16_to_f32(w[i]));
    }
    return 0;
}

/* Rotary embedding of the first `heads` head vectors of each row of qkv ([rows, >= heads, head_dim], heads
 * contiguous): out[r, h] = bf16(bf16(v * cos[r]) + bf16(swap(v) * sin[r])), swap(v) = (v2, v1) for the
 * halves v1, v2 of v; `sin` already carries rotate_half's sign (see FastLlama._rope). */
int xpyd_rope_bf16(const uint16_t *qkv, int64_t qkv_row, const uint16_t *cos, const uint16_t *sin,
                   int64_t table_row, uint16_t *out, int64_t out_row, int64_t rows, int heads, int head_dim,
                   int threads) {
    if (rows <= 0 || heads <= 0 || head_dim <= 0 || head_dim % 2 || threads <= 0) return -1;
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * table_row, *s = sin + r * table_row;
        for (int h = 0; h < heads; h++) {
            const uint16_t *v = qkv + r * qkv_row + (int64_t)h * head_dim;
            uint16_t *o = out + r * out_row + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d++) {
                const float swapped = bf16_to_f32(v[d < half ? d + half : d - half]);
                const float a = mul_bf16(bf16_to_f32(v[d]), bf16_to_f32(c[d]));
                const float b = mul_bf16(swapped, bf16_to_f32(s[d]));
                o[d] = f32_to_bf16(a + b);
            }
        }
    }
    return 0;
}
