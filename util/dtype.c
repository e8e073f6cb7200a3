#include "dtype.h"

#include "log.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} g_dtypes[KR_DTYPE_COUNT] = {
    [KR_DTYPE_F32] = {"F32", 4}, [KR_DTYPE_F16] = {"F16", 2},     [KR_DTYPE_BF16] = {"BF16", 2},
    [KR_DTYPE_F8_E4M3] = {"F8_E4M3", 1}, [KR_DTYPE_I32] = {"I32", 4}, [KR_DTYPE_I64] = {"I64", 8},
};

size_t kr_dtype_size(enum kr_dtype dt)
{
    return (unsigned)dt < KR_DTYPE_COUNT ? g_dtypes[dt].size : 0;
}

const char *kr_dtype_name(enum kr_dtype dt)
{
    return (unsigned)dt < KR_DTYPE_COUNT ? g_dtypes[dt].name : "?";
}

int kr_dtype_parse(const char *name, enum kr_dtype *out)
{
    for (int i = 0; i < KR_DTYPE_COUNT; i++) {
        if (!strcmp(name, g_dtypes[i].name)) {
            *out = (enum kr_dtype)i;
            return 0;
        }
    }
    return -1;
}

void kr_convert_to_f32(float *dst, const void *src, enum kr_dtype dt, size_t n)
{
    switch (dt) {
    case KR_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        return;
    /* memcpy loads: checkpoint data need not be aligned (safetensors does not promise it) */
    case KR_DTYPE_BF16: {
        const unsigned char *s = src;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = kr_bf16_to_f32(h);
        }
        return;
    }
    case KR_DTYPE_F16: {
        const unsigned char *s = src;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = kr_f16_to_f32(h);
        }
        return;
    }
    case KR_DTYPE_F8_E4M3: {
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++) {
            dst[i] = kr_e4m3_to_f32(s[i]);
        }
        return;
    }
    default:
        KR_ASSERT(!"kr_convert_to_f32: not a float dtype");
    }
}
