#pragma once
/* How krk_stream_gemm (kernels/gemm/stream.cu) cuts a product over its blocks, shared by the kernel
 * and its CPU test (tests/backend/test_stream_plan.c). The iterations are the tiles of weight rows
 * times their kt column steps, in order (iteration i: tile i / kt, step i % kt); block b of `grid`
 * takes iterations [begin(b), begin(b + 1)). A block's range covers whole tiles, whose results it
 * writes itself, and at most two part-tiles (the one its range starts in and the one it ends in),
 * whose partial sums it leaves in its slot 0 and slot 1; the last block to finish a shared tile adds
 * the partials of blocks first..last of the tile in block order. Plain C, no device header. */
#include <stdint.h>

#ifdef __CUDACC__
#define KRK_SP_FN __host__ __device__ static inline
#else
#define KRK_SP_FN static inline
#endif

/* First iteration of block b (iters >= grid >= 1, 0 <= b <= grid). */
KRK_SP_FN int64_t krk_sp_begin(int64_t iters, int grid, int64_t b)
{
    return b * iters / grid;
}

/* The block whose range holds iteration i (the largest b with begin(b) <= i). */
KRK_SP_FN int krk_sp_block(int64_t iters, int grid, int64_t i)
{
    return (int)(((i + 1) * grid - 1) / iters);
}

/* The slot in which block b keeps its partial sums of `tile`: 0 when its range starts in the tile,
 * else 1 (the tile its range ends in). */
KRK_SP_FN int krk_sp_slot(int64_t iters, int grid, int kt, int b, int tile)
{
    return krk_sp_begin(iters, grid, b) / kt == tile ? 0 : 1;
}
