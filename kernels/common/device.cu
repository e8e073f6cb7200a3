// Device discovery helpers shared by every kernel family.
#include "krk.h"

#include <atomic>
#include <cstdio>
#include <cuda_runtime.h>

extern "C" int krk_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); // no driver or no device: clear the error, report none
        return 0;
    }
    return n;
}

extern "C" int krk_device_sm_count(void)
{
    static int n = 0;
    if (n == 0) {
        int dev = 0, v = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0) {
            (void)cudaGetLastError();
            return 132;
        }
        n = v;
    }
    return n;
}

extern "C" enum kr_status krk_device_describe(int dev, char *name, int n)
{
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return KR_ERR_CUDA;
    }
    snprintf(name, (size_t)n, "%s sm_%d%d", prop.name, prop.major, prop.minor);
    return KR_OK;
}

static std::atomic<bool> g_pdl{false};

extern "C" void krk_set_pdl(bool on)
{
    g_pdl.store(on, std::memory_order_relaxed);
}

extern "C" bool krk_pdl(void)
{
    return g_pdl.load(std::memory_order_relaxed);
}

static std::atomic<bool> g_state_stream{true};

extern "C" void krk_set_state_streaming(bool on)
{
    g_state_stream.store(on, std::memory_order_relaxed);
}

extern "C" bool krk_state_streaming(void)
{
    return g_state_stream.load(std::memory_order_relaxed);
}
