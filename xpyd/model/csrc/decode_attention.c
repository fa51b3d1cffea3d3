/* Decode attention over xpyd's paged KV pool, bfloat16 in, float32 math, bfloat16 out.
 *
 * The pool holds one of three element types (xpyd/model/kv_quant.py writes the quantized ones):
 * - bfloat16 K/V (xpyd_decode_attention_bf16);
 * - fp8 codes, one byte each, with a power-of-two scale per KV head of the layer for K and for V
 *   (xpyd_decode_attention_fp8): the codes are converted as they are read (fp8.h, exact) and the scales
 *   applied once per score and once per output, which equals dequantizing every element first (powers of two
 *   are exact);
 * - int8 rows (xpyd_decode_attention_int8): head_dim signed codes then the row's own scale, a little-endian
 *   binary16 (head_dim + 2 bytes a row; int8.h): the codes are converted as they are read (exact) and the row's
 *   K scale joins the score's scale, its V scale the softmax weight, so the float32 results are dequantizing
 *   every element first (code * scale is exact in float32) up to float32 rounding.
 * The step's new K/V arrive already quantized and are copied in as they are (bfloat16 and fp8 pools), or as
 * bfloat16 values that the kernel encodes into int8 rows itself (`encode_int8_row`: the format of
 * xpyd/model/kv_int8.py, in the rotated basis of xpyd/model/kv_rotation.py when a rotation is given).
 *
 * The pool is a set of fixed-size blocks; each request owns a block table (its blocks in token order), and
 * token t of a request sits in block table[t / block_size] at row t % block_size. Inside a block, the rows
 * of one (KV head, layer, K or V) are consecutive: [num_blocks, kv_heads, layers, 2, block_size, row], row
 * head_dim elements (head_dim + 2 bytes for int8).
 *
 * One query token per request. For request b and KV head h (one work item each, spread over OpenMP
 * threads) the kernel first writes the step's new K and V at position len[b]-1 (block
 * table[b][(len[b]-1) / block_size], row (len[b]-1) % block_size), then computes softmax(q k^T * scale) v
 * for the `group` query heads that share h, reading K and V in place from the blocks through the table
 * and the pool's strides (no gather, no float32 copy of the cache). The numbers are the ones
 * `llama_fast._matmul_attention` computes (float32 products and softmax, one rounding to bfloat16 at the
 * end).
 *
 * Built and loaded by xpyd/model/native.py with the machine's C compiler; called through ctypes with
 * raw pointers and element strides (all strides are in elements, not bytes). The block ids are checked
 * against the pool's size by the Python wrapper before the call (this kernel refuses negative ones only:
 * it is not told how many blocks there are).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fp8.h"
#include "int8.h"

/* Software prefetch of the row XPYD_PREFETCH tokens ahead (following the block table across block
   boundaries; -DXPYD_PREFETCH=0 turns it off). In a block the rows of one (KV head, layer) are consecutive,
   yet prefetching still pays: measured here (AMD EPYC Zen 4 VM, 2 threads, SmolLM2-135M's shape, 30 layers
   in the pool, shuffled tables, one call per layer in turn; scripts/bench_decode_attention.py
   --prefetch-ab 0,16,32,64), us per call, no prefetch -> 16 / 32 / 64 rows ahead:
     context 1024, batch 16: block 8   2827 -> 1666 / 1636 / 1664,  block 16  2086 -> 1265 / 1120 / 1220,
                             block 64  1567 -> 1181 / 1151 / 1142
     context 2048, batch 16: block 8   6387 -> 4111 / 4480 / 3963,  block 16  4542 -> 2895 / 2783 / 2704,
                             block 64  3026 -> 2273 / 2313 / 2371
     context 2048, batch 1:  block 16   280 ->  176 /  206 /  191;  context 256, batch 1, block 16: 33 -> 29 / 28 / 31
   so 25-40% faster with it; 16, 32 and 64 rows ahead are within the noise of one another: 32. */
#ifndef XPYD_PREFETCH
#define XPYD_PREFETCH 32
#endif
#define XPYD_MAX_GROUP 16
#define XPYD_MAX_HEAD_DIM 256

/* Rows of one K (or V) pass: the request's tokens [0, n) in order, one block at a time. `head` is a byte pointer;
   offsets and strides are in elements of ES bytes (2: bfloat16, 1: fp8 and int8 codes); a row is row_bytes long. */
#define XPYD_FOR_ROWS(OFF, ROW, BODY)                                                                  \
    do {                                                                                               \
        int64_t pf_t = XPYD_PREFETCH, pf_j = XPYD_PREFETCH / block_size, pf_i = XPYD_PREFETCH % block_size; \
        int64_t t = 0;                                                                                 \
        for (int64_t j = 0; t < n; j++) {                                                              \
            const unsigned char *blk = head + (table[j] * block_stride + (OFF)) * ES;                  \
            const int64_t rows = n - t < block_size ? n - t : block_size;                              \
            for (int64_t i = 0; i < rows; i++, t++) {                                                  \
                const unsigned char *ROW = blk + i * token_stride * ES;                                \
                if (XPYD_PREFETCH > 0 && pf_t < n) {                                                   \
                    const unsigned char *p = head + (table[pf_j] * block_stride + (OFF) + pf_i * token_stride) * ES; \
                    for (int d = 0; d < row_bytes; d += 64) __builtin_prefetch(p + d, 0, 3);       \
                    pf_t++;                                                                            \
                    if (++pf_i == block_size) pf_i = 0, pf_j++;                                        \
                }                                                                                      \
                BODY                                                                                   \
            }                                                                                          \
        }                                                                                              \
    } while (0)

/* The pool's element types (`kind` below): fp8 formats keep fp8.h's numbers. */
enum { KV_BF16 = 0, KV_E4M3 = 1, KV_E5M2 = 2, KV_INT8 = 3 };

/* One K or V row as float32: bfloat16 elements, fp8 codes (fp8.h) as the codes' values divided by fp8_unit
   (the per-head scale times fp8_unit is applied by the caller, once per score and once per output), or int8
   codes as they are (the row's scale is applied by the caller, once per score and once per weight). */
static inline __attribute__((always_inline)) void load_row(float *restrict row, const unsigned char *restrict src,
                                                           const int kind, const int head_dim) {
    if (kind == KV_INT8) {
        int8_row(row, src, head_dim);
    } else if (kind) {
        fp8_row(row, src, kind, head_dim);
    } else {
        const uint16_t *h = (const uint16_t *)src;
        for (int d = 0; d < head_dim; d++) row[d] = bf16_to_f32(h[d]);
    }
}

/* One int8 row (xpyd/model/kv_int8.py's format) of the bfloat16 values x[0..head_dim): the codes of y = x R
   (`rot`, float32 [head_dim, head_dim]; NULL: y = x) and y's scale: amax over the row / 127 in float32, at most
   65504, rounded to a binary16 s; code = clamp(round_half_even(y / s), -127, 127), 0 where s is 0; then s, low
   byte first. Without a rotation the bytes are torch's encoder's exactly; with one, y may differ from torch's
   x @ R in the last bits of float32 (another order of the same products). */
static void encode_int8_row(const uint16_t *restrict x, const float *restrict rot, const int head_dim,
                            unsigned char *restrict dst) {
    float v[XPYD_MAX_HEAD_DIM], y[XPYD_MAX_HEAD_DIM];
    for (int d = 0; d < head_dim; d++) v[d] = bf16_to_f32(x[d]);
    if (rot) {
        for (int j = 0; j < head_dim; j++) y[j] = 0.0f;
        for (int i = 0; i < head_dim; i++)
            for (int j = 0; j < head_dim; j++) y[j] += v[i] * rot[i * head_dim + j];
    } else {
        memcpy(y, v, sizeof(float) * (size_t)head_dim);
    }
    float amax = 0.0f;
    for (int d = 0; d < head_dim; d++) amax = fmaxf(amax, fabsf(y[d]));
    const float s = fminf(amax / 127.0f, 65504.0f);
    const uint16_t half = f32_to_f16(s);
    const float step = f16_to_f32(half);
    for (int d = 0; d < head_dim; d++) {
        const float c = step > 0.0f ? fminf(fmaxf(nearbyintf(y[d] / step), -127.0f), 127.0f) : 0.0f;
        dst[d] = (unsigned char)(int8_t)c;
    }
    dst[head_dim] = (unsigned char)(half & 0xFFu);
    dst[head_dim + 1] = (unsigned char)(half >> 8);
}

/* One (request, KV head) item: softmax(q k^T * scale) v for the `group` query heads sharing that KV head.
   `head` is the pool shifted to this KV head (bytes); `table` the request's block ids. With fp8 codes, the
   K scale `k_scale` joins the score scale and the V scale multiplies the output: both are powers of two,
   so this equals dequantizing every element first. With int8 rows, each row's scale does the same for its
   score (K) and its softmax weight (V).
   always_inline: the dispatch below compiles it once per common (group, head_dim), both constant, so the
   loops unroll (15-20% faster than the generic copy in an A/B here); other shapes run the generic copy. */
static inline __attribute__((always_inline)) void attend_item(
    const uint16_t *q, const unsigned char *head, const int64_t *table, int64_t n, int64_t block_stride,
    int64_t block_size, int64_t token_stride, int64_t k_off, int64_t v_off, float scale, float *scores,
    uint16_t *out, const int group, const int head_dim, const int kind, float k_scale,
    float v_scale, const float *rot) {
    const int ES = kind ? 1 : 2;
    const int int8 = kind == KV_INT8, fp8 = kind && !int8;
    const int row_bytes = head_dim * ES + (int8 ? XPYD_INT8_SCALE_BYTES : 0);
    if (fp8) { /* powers of two: exact */
        k_scale *= fp8_unit(kind);
        v_scale *= fp8_unit(kind);
    }
    float qf[XPYD_MAX_GROUP][XPYD_MAX_HEAD_DIM], acc[XPYD_MAX_GROUP][XPYD_MAX_HEAD_DIM];
    float row[XPYD_MAX_HEAD_DIM], top[XPYD_MAX_GROUP], sum[XPYD_MAX_GROUP];
    const float score_scale = fp8 ? scale * k_scale : scale;
    for (int g = 0; g < group; g++) {
        for (int d = 0; d < head_dim; d++) {
            qf[g][d] = bf16_to_f32(q[g * head_dim + d]);
            acc[g][d] = 0.0f;
        }
        top[g] = -3.0e38f;
    }
    if (rot) /* int8 rows stored rotated (kv_rotation): q' = q R in float32, so that q' . k' = q . k */
        for (int g = 0; g < group; g++) {
            float turned[XPYD_MAX_HEAD_DIM] = {0};
            for (int i = 0; i < head_dim; i++)
                for (int j = 0; j < head_dim; j++) turned[j] += qf[g][i] * rot[i * head_dim + j];
            for (int j = 0; j < head_dim; j++) qf[g][j] = turned[j];
        }
    XPYD_FOR_ROWS(k_off, kt, { /* scores = q . k */
        load_row(row, kt, kind, head_dim);
        const float row_scale = int8 ? score_scale * f16_scale(kt, head_dim) : score_scale;
        for (int g = 0; g < group; g++) {
            float s = 0.0f;
            for (int d = 0; d < head_dim; d++) s += qf[g][d] * row[d];
            s *= row_scale;
            scores[g * n + t] = s;
            if (s > top[g]) top[g] = s;
        }
    });
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
    XPYD_FOR_ROWS(v_off, vt, { /* acc = sum_t p_t v_t */
        load_row(row, vt, kind, head_dim);
        const float v_row = int8 ? f16_scale(vt, head_dim) : 1.0f;
        for (int g = 0; g < group; g++) {
            const float p = int8 ? scores[g * n + t] * v_row : scores[g * n + t];
            for (int d = 0; d < head_dim; d++) acc[g][d] += p * row[d];
        }
    });
    for (int g = 0; g < group; g++) {
        const float inv = 1.0f / sum[g];
        if (rot) { /* the output of rotated values, turned back: o = o' R^T (R^T's rows follow R's), in float32
                      before the one rounding; summed over j outside so the d loop vectorizes */
            const float *rot_t = rot + head_dim * head_dim;
            float o[XPYD_MAX_HEAD_DIM] = {0};
            for (int j = 0; j < head_dim; j++) {
                const float a = acc[g][j] * inv;
                for (int d = 0; d < head_dim; d++) o[d] += a * rot_t[j * head_dim + d];
            }
            for (int d = 0; d < head_dim; d++) out[g * head_dim + d] = f32_to_bf16(o[d]);
            continue;
        }
        for (int d = 0; d < head_dim; d++) {
            const float o = acc[g][d] * inv;
            out[g * head_dim + d] = f32_to_bf16(fp8 ? o * v_scale : o);
        }
    }
}

/* The shapes of common models get their own compiled copy (group = heads / kv_heads), per element type. */
#define XPYD_SHAPE(G, D, KIND)                                                                              \
    if (group == G && head_dim == D) {                                                                      \
        attend_item(q, head, table, n, block_stride, block_size, token_stride, k_off, v_off, scale, scores, \
                    out, G, D, KIND, k_scale, v_scale, rot);                                                \
        return;                                                                                             \
    }

#define XPYD_ATTEND(NAME, KIND)                                                                             \
    static void NAME(const uint16_t *q, const unsigned char *head, const int64_t *table, int64_t n,         \
                     int64_t block_stride, int64_t block_size, int64_t token_stride, int64_t k_off,         \
                     int64_t v_off, float scale, float *scores, uint16_t *out, int group, int head_dim,     \
                     float k_scale, float v_scale, const float *rot) {                                      \
        XPYD_SHAPE(3, 64, KIND) /* SmolLM2-135M */                                                          \
        XPYD_SHAPE(4, 64, KIND) /* Llama 3.2 1B, SmolLM2-360M-ish */                                        \
        XPYD_SHAPE(8, 64, KIND) /* TinyLlama */                                                             \
        XPYD_SHAPE(4, 128, KIND) /* Llama 3 8B, Mistral 7B */                                               \
        XPYD_SHAPE(8, 128, KIND) /* Llama 3 70B */                                                          \
        XPYD_SHAPE(7, 64, KIND) /* Qwen2 0.5B */                                                            \
        XPYD_SHAPE(6, 128, KIND) /* Qwen2 1.5B */                                                           \
        XPYD_SHAPE(1, 64, KIND)                                                                             \
        XPYD_SHAPE(1, 128, KIND)                                                                            \
        attend_item(q, head, table, n, block_stride, block_size, token_stride, k_off, v_off, scale, scores, \
                    out, group, head_dim, KIND, k_scale, v_scale, rot);                                     \
    }

XPYD_ATTEND(attend_bf16, KV_BF16)
XPYD_ATTEND(attend_e4m3, KV_E4M3)
XPYD_ATTEND(attend_e5m2, KV_E5M2)
XPYD_ATTEND(attend_int8, KV_INT8)

int xpyd_abi_version(void) { return 5; }

/* The kernel's own float32 -> binary16 conversion, for the tests: out[i] = f32_to_f16(in[i]) (vector: F16C's
   where the CPU has it) or f16_from_scalar (bit arithmetic). */
int xpyd_f32_to_f16(const float *in, int64_t n, int vector, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = vector ? f32_to_f16(in[i]) : f16_from_scalar(in[i]);
    return 0;
}

/* The three entry points: bfloat16 pools (kind KV_BF16, es = 2), fp8 pools of one-byte codes (KV_E4M3 or
   KV_E5M2; es = 1; k_scales/v_scales the layer's per-KV-head scales) and int8 pools (KV_INT8, es = 1, rows of
   head_dim codes + their binary16 scale; no per-head scales). */
static int decode_attention(const uint16_t *q, int64_t q_row, const unsigned char *k_new, int64_t k_new_row,
                            const unsigned char *v_new, int64_t v_new_row, unsigned char *pool, int64_t block_stride,
                            int64_t head_stride, int64_t k_off, int64_t v_off, int64_t token_stride,
                            int64_t block_size, const int64_t *tables, int64_t table_row, const int64_t *lens,
                            int batch, int heads, int kv_heads, int head_dim, float scale, uint16_t *out,
                            int threads, const int kind, const float *k_scales,
                            const float *v_scales, const float *rot) {
    if (batch <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || head_dim > XPYD_MAX_HEAD_DIM ||
        heads / kv_heads > XPYD_MAX_GROUP || threads <= 0 || block_size <= 0)
        return -1;
    for (int b = 0; b < batch; b++)
        if (lens[b] <= 0) return -2;
    for (int b = 0; b < batch; b++) {
        const int64_t used = (lens[b] + block_size - 1) / block_size;
        for (int64_t j = 0; j < used; j++)
            if (tables[b * table_row + j] < 0) return -4;
    }
    const int group = heads / kv_heads;
    const int64_t es = kind ? 1 : 2;
    const int64_t row_bytes = es * head_dim + (kind == KV_INT8 ? XPYD_INT8_SCALE_BYTES : 0);
    int failed = 0;

#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : failed)
    for (int item = 0; item < batch * kv_heads; item++) {
        const int b = item / kv_heads, h = item % kv_heads;
        const int64_t n = lens[b], last = n - 1;
        const int64_t *table = tables + b * table_row;
        unsigned char *head = pool + (int64_t)h * head_stride * es;
        unsigned char *row = head + (table[last / block_size] * block_stride + (last % block_size) * token_stride) * es;
        if (kind == KV_INT8) { /* bfloat16 values, rows of head_dim elements: encoded here */
            encode_int8_row((const uint16_t *)k_new + b * k_new_row + (int64_t)h * head_dim, rot, head_dim,
                            row + k_off * es);
            encode_int8_row((const uint16_t *)v_new + b * v_new_row + (int64_t)h * head_dim, rot, head_dim,
                            row + v_off * es);
        } else {
            memcpy(row + k_off * es, k_new + b * k_new_row * es + h * row_bytes, (size_t)row_bytes);
            memcpy(row + v_off * es, v_new + b * v_new_row * es + h * row_bytes, (size_t)row_bytes);
        }

        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)n);
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const uint16_t *qh = q + b * q_row + (int64_t)h * group * head_dim;
        uint16_t *oh = out + ((int64_t)b * heads + h * group) * head_dim;
        if (kind == KV_INT8)
            attend_int8(qh, head, table, n, block_stride, block_size, token_stride, k_off, v_off, scale, scores, oh,
                        group, head_dim, 1.0f, 1.0f, rot);
        else if (kind == KV_E4M3)
            attend_e4m3(qh, head, table, n, block_stride, block_size, token_stride, k_off, v_off, scale, scores, oh,
                        group, head_dim, k_scales[h], v_scales[h], NULL);
        else if (kind == KV_E5M2)
            attend_e5m2(qh, head, table, n, block_stride, block_size, token_stride, k_off, v_off, scale, scores, oh,
                        group, head_dim, k_scales[h], v_scales[h], NULL);
        else
            attend_bf16(qh, head, table, n, block_stride, block_size, token_stride, k_off, v_off, scale, scores, oh,
                        group, head_dim, 1.0f, 1.0f, NULL);
        free(scores);
    }
    return failed ? -3 : 0;
}

/* Returns 0, or a negative code for arguments the kernel does not handle (nothing is written then):
   -1 sizes, -2 a request with no token, -3 out of memory (the new K/V are written then), -4 a negative block id among those it would touch. */
int xpyd_decode_attention_bf16(
    const uint16_t *q, int64_t q_row,          /* [B, heads, head_dim]: row stride q_row, heads contiguous */
    const uint16_t *k_new, int64_t k_new_row,  /* [B, kv_heads, head_dim] */
    const uint16_t *v_new, int64_t v_new_row,
    uint16_t *pool, int64_t block_stride, int64_t head_stride, /* [blocks, kv_heads, layers, 2, bs, head_dim] */
    int64_t k_off, int64_t v_off,              /* the layer's K and V within a (block, head): layer*layer_stride (+kv) */
    int64_t token_stride, int64_t block_size,  /* row stride inside a block (head_dim when contiguous); rows per block */
    const int64_t *tables, int64_t table_row,  /* [B, >= ceil(lens[b] / block_size)] block ids, row stride table_row */
    const int64_t *lens,                       /* lens[b]: tokens to attend over, the new one included */
    int batch, int heads, int kv_heads, int head_dim, float scale,
    uint16_t *out,                             /* [B, heads, head_dim] contiguous */
    int threads) {
    return decode_attention(q, q_row, (const unsigned char *)k_new, k_new_row, (const unsigned char *)v_new, v_new_row,
                            (unsigned char *)pool, block_stride, head_stride, k_off, v_off, token_stride, block_size,
                            tables, table_row, lens, batch, heads, kv_heads, head_dim, scale, out, threads, KV_BF16,
                            NULL, NULL, NULL);
}

/* The same over a pool of fp8 codes (one byte each; strides in bytes): k_new/v_new are the step's codes
   (quantized by the caller), `format` 1 (e4m3) or 2 (e5m2), k_scales/v_scales [kv_heads] the layer's scales
   (powers of two). q and out stay bfloat16. Same return codes, and -1 for another format. */
int xpyd_decode_attention_fp8(
    const uint16_t *q, int64_t q_row, const uint8_t *k_new, int64_t k_new_row, const uint8_t *v_new,
    int64_t v_new_row, uint8_t *pool, int64_t block_stride, int64_t head_stride, int64_t k_off, int64_t v_off,
    int64_t token_stride, int64_t block_size, const int64_t *tables, int64_t table_row, const int64_t *lens,
    int batch, int heads, int kv_heads, int head_dim, float scale, uint16_t *out, int threads, int format,
    const float *k_scales, const float *v_scales) {
    if (format != 1 && format != 2) return -1;
    return decode_attention(q, q_row, k_new, k_new_row, v_new, v_new_row, pool, block_stride, head_stride, k_off,
                            v_off, token_stride, block_size, tables, table_row, lens, batch, heads, kv_heads, head_dim,
                            scale, out, threads, format, k_scales, v_scales, NULL);
}

/* The same over a pool of int8 rows (one byte each; strides in bytes): a row is head_dim signed codes and then
   its scale, a little-endian binary16 (head_dim + 2 bytes; int8.h); k_new/v_new [B, kv_heads, head_dim] are the
   step's K/V as bfloat16 values (row strides in elements), encoded into their rows here (`encode_int8_row`). No
   per-head scales: each row carries its own.
   q and out stay bfloat16. `rot` (NULL: none) is the float32 rotation R the rows were quantized in (kv_rotation:
   a row holds the codes of x R), [2, head_dim, head_dim]: R, then R^T: q is turned by R and the output back by
   R^T, in float32. Same return codes. */
int xpyd_decode_attention_int8(
    const uint16_t *q, int64_t q_row, const uint16_t *k_new, int64_t k_new_row, const uint16_t *v_new,
    int64_t v_new_row, uint8_t *pool, int64_t block_stride, int64_t head_stride, int64_t k_off, int64_t v_off,
    int64_t token_stride, int64_t block_size, const int64_t *tables, int64_t table_row, const int64_t *lens,
    int batch, int heads, int kv_heads, int head_dim, float scale, uint16_t *out, int threads, const float *rot) {
    return decode_attention(q, q_row, (const unsigned char *)k_new, k_new_row, (const unsigned char *)v_new,
                            v_new_row, pool, block_stride, head_stride, k_off,
                            v_off, token_stride, block_size, tables, table_row, lens, batch, heads, kv_heads, head_dim,
                            scale, out, threads, KV_INT8, NULL, NULL, rot);
}

/* The kernel's binary16 -> float32 conversion of int8 rows' scales on its own, for the tests: out[i] = value of
   halves[i], through F16C where the CPU has it (vector = 1; the kernel's path) or bit arithmetic (vector = 0). */
int xpyd_f16_to_f32(const uint16_t *halves, int64_t n, int vector, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = vector ? f16_to_f32(halves[i]) : f16_scalar(halves[i]);
    return 0;
}

/* The kernel's fp8 conversion on its own (format 1: e4m3, 2: e5m2), for the tests: out[i] = value of codes[i],
   through the row conversion (vector = 1: whole rows of 256 codes, as vectors where the CPU has them) or the
   per-code bit arithmetic (vector = 0). */
int xpyd_fp8_to_f32(const uint8_t *codes, int64_t n, int format, int vector, float *out) {
    if (format != 1 && format != 2) return -1;
    const float unit = fp8_unit(format);
    for (int64_t i = 0; i < n; i += 256) {
        const int rows = n - i < 256 ? (int)(n - i) : 256;
        if (!vector)
            for (int j = 0; j < rows; j++) out[i + j] = fp8_scalar(codes[i + j], format);
        else if (format == 1)
            fp8_row(out + i, codes + i, 1, rows);
        else
            fp8_row(out + i, codes + i, 2, rows);
        for (int j = 0; j < rows; j++) out[i + j] *= unit;
    }
    return 0;
}
