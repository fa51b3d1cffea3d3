/* int8 KV rows -> float32: `head_dim` signed codes (two's complement bytes) followed by the row's scale, an IEEE
   binary16 in little-endian byte order (xpyd/model/kv_int8.py encodes them, and decode_attention.c the step's). A code's value is code * scale in
   float32; int8_row converts the codes (exact: |code| <= 127), f16_scale the scale (exact: every half is a float).
   The codes convert 16 (AVX-512) or 8 (AVX2) per instruction, elsewhere and for a row's tail one at a time; the
   scale, one per row, by F16C's scalar conversion where the CPU has it, else by bit arithmetic (the same
   numbers; both checked against torch over all 65536 halves: tests/integration/test_native_int8.py via
   xpyd_f16_to_f32). */
#ifndef XPYD_INT8_H
#define XPYD_INT8_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Bytes after a row's codes: its binary16 scale. */
#define XPYD_INT8_SCALE_BYTES 2

/* One half's value by bit arithmetic: normal numbers rebase the exponent (15 -> 127), subnormals are
   mantissa * 2^-24 (exact), infinities and NaNs keep their class. */
static inline float f16_scalar(const uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    uint32_t bits;
    float v;
    if (exponent == 0) {
        v = (float)mantissa * 0x1p-24f;
        memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    memcpy(&v, &bits, 4);
    return v;
}

static inline __attribute__((always_inline)) float f16_to_f32(const uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return f16_scalar(h);
#endif
}

/* float32 -> binary16, rounded to nearest even (as torch converts): normal halves rebase the exponent and round
   the 13 bits dropped, values below 2^-14 become subnormal halves (value * 2^24, rounded), values that round to
   2^16 or more infinity, NaN a quiet NaN. */
static inline uint16_t f16_from_scalar(const float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7FFFFFFFu;
    if (x > 0x7F800000u) return sign | 0x7E00u;
    if (x >= 0x477FF000u) return sign | 0x7C00u; /* >= 65520: rounds past 65504 */
    if (x < 0x38800000u) {                        /* below 2^-14 */
        float a;
        memcpy(&a, &x, 4);
        return sign | (uint16_t)nearbyintf(a * 0x1p24f); /* exact scaling; 1024 is the smallest normal's bits */
    }
    const uint32_t mantissa = x & 0x7FFFFFu, rest = mantissa & 0x1FFFu;
    uint32_t h = (((x >> 23) - 112u) << 10) | (mantissa >> 13);
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* (a carry moves into the exponent, as it should) */
    return sign | (uint16_t)h;
}

static inline __attribute__((always_inline)) uint16_t f32_to_f16(const float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, 0); /* 0: round to nearest even */
#else
    return f16_from_scalar(f);
#endif
}

/* The scale stored after a row's `head_dim` codes (little-endian binary16). */
static inline __attribute__((always_inline)) float f16_scale(const uint8_t *row, const int head_dim) {
    return f16_to_f32((uint16_t)(row[head_dim] | (uint16_t)row[head_dim + 1] << 8));
}

/* row[d] = the signed code src[d] as float32, d < n. */
static inline __attribute__((always_inline)) void int8_row(float *restrict row, const uint8_t *restrict src,
                                                           const int n) {
    int d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= n; d += 16) {
        const __m128i codes = _mm_loadu_si128((const __m128i *)(src + d));
        _mm512_storeu_ps(row + d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)));
    }
#elif defined(__AVX2__)
    for (; d + 8 <= n; d += 8) {
        const __m128i codes = _mm_loadl_epi64((const __m128i *)(src + d));
        _mm256_storeu_ps(row + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
    }
#endif
    for (; d < n; d++) row[d] = (float)(int8_t)src[d];
}

#endif
