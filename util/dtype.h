#pragma once
/* Element types of weights and activations, and scalar conversions to fp32. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kr_dtype {
    KR_DTYPE_F32 = 0,
    KR_DTYPE_F16 = 1,
    KR_DTYPE_BF16 = 2,
    KR_DTYPE_F8_E4M3 = 3, /* DeepSeek FP8 weights (with block scales) */
    KR_DTYPE_I32 = 4,
    KR_DTYPE_I64 = 5,
    KR_DTYPE_COUNT
};

/* Bytes per element. */
size_t kr_dtype_size(enum kr_dtype dt);
/* Name as safetensors spells it ("F32", "BF16", ...). */
const char *kr_dtype_name(enum kr_dtype dt);
/* Parses a safetensors dtype name; returns 0 on success, -1 for an unknown or unsupported name. */
int kr_dtype_parse(const char *name, enum kr_dtype *out);

static inline float kr_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; NaN stays NaN. */
static inline uint16_t kr_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((u >> 16) | 0x40);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float kr_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* FP8 e4m3fn (no infinities; 0x7f/0xff are NaN). */
static inline float kr_e4m3_to_f32(uint8_t v)
{
    uint32_t sign = v >> 7, exp = (v >> 3) & 0xfu, man = v & 0x7u;
    float r;
    if (exp == 15 && man == 7) {
        r = __builtin_nanf("");
    } else if (exp == 0) {
        r = (float)man / 8.0f / 64.0f; /* 2^-6 * man/8 */
    } else {
        r = (1.0f + (float)man / 8.0f) * __builtin_ldexpf(1.0f, (int)exp - 7);
    }
    return sign ? -r : r;
}

/* Converts n elements of `src` (of type dt: F32, F16 or BF16) to fp32. */
void kr_convert_to_f32(float *dst, const void *src, enum kr_dtype dt, size_t n);

#ifdef __cplusplus
}
#endif
