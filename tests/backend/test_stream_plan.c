/* The cut of krk_stream_gemm's work over its blocks (kernels/include/krk/stream-plan.h), played out
 * on the CPU the way the kernel's blocks run it: each block walks its range of iterations tile by
 * tile, writes whole tiles itself, leaves part-tiles in the slot krk_sp_slot names and counts
 * itself in on the tile; the last to arrive adds the partials of the blocks krk_sp_block names, in
 * block order. The blocks' steps are interleaved in random orders. Each iteration adds a distinct
 * power-of-two-free integer, so a tile's result is its exact sum only when every iteration was
 * counted once: a lost, doubled or overwritten partial, a wrong first/last block or a second
 * "last" block shows as a wrong sum or a failed check. Shapes: the 8B models' weights on 78, 114
 * and 132 SMs (tiles of 128 rows, 64-column steps), and random ones down to one iteration per
 * block. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "krk/stream-plan.h"

/* What a block does next: its segments in order, one step each (a segment's partial written and
 * counted in, or a whole tile written). */
struct seg {
    int tile, kb, ke;
};

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* The value iteration (tile, k) adds: distinct per iteration, small enough that sums stay exact. */
static int64_t value(int tile, int k)
{
    return (int64_t)tile * 1000003 + (int64_t)k * 7 + 1;
}

static void play(int tiles, int kt, int grid, uint64_t seed)
{
    const int64_t iters = (int64_t)tiles * kt;
    cr_assert(grid >= 1 && iters >= grid);
    /* each block's segments, as the kernel forms them */
    struct seg **segs = calloc((size_t)grid, sizeof *segs);
    int *n_seg = calloc((size_t)grid, sizeof *n_seg), *next = calloc((size_t)grid, sizeof *next);
    cr_assert(segs && n_seg && next);
    int64_t covered = 0;
    for (int b = 0; b < grid; b++) {
        const int64_t it0 = krk_sp_begin(iters, grid, b), it_end = krk_sp_begin(iters, grid, b + 1);
        cr_assert_gt(it_end, it0, "block %d of %d has no iteration (%lld)", b, grid, (long long)iters);
        cr_assert_eq(krk_sp_block(iters, grid, it0), b);
        cr_assert_eq(krk_sp_block(iters, grid, it_end - 1), b);
        segs[b] = calloc((size_t)(it_end - it0), sizeof **segs);
        cr_assert(segs[b]);
        for (int64_t it = it0; it < it_end;) {
            const int tile = (int)(it / kt), kb = (int)(it - (int64_t)tile * kt);
            const int ke = (int)((int64_t)kt < kb + (it_end - it) ? (int64_t)kt : kb + (it_end - it));
            segs[b][n_seg[b]++] = (struct seg){tile, kb, ke};
            it += ke - kb;
            covered += ke - kb;
        }
        /* at most two part-tiles, the first and the last segment */
        for (int s = 1; s + 1 < n_seg[b]; s++) {
            cr_assert(segs[b][s].kb == 0 && segs[b][s].ke == kt, "block %d: a part-tile inside its range", b);
        }
    }
    cr_assert_eq(covered, iters);
    int64_t *y = calloc((size_t)tiles, sizeof *y), *part = calloc((size_t)grid * 2, sizeof *part);
    int *written = calloc((size_t)tiles, sizeof *written), *counter = calloc((size_t)tiles, sizeof *counter);
    int *slot_tile = malloc((size_t)grid * 2 * sizeof *slot_tile); /* which tile a slot holds (-1: none) */
    cr_assert(y && part && written && counter && slot_tile);
    for (int i = 0; i < grid * 2; i++) {
        slot_tile[i] = -1;
    }
    /* interleave the blocks' steps at random until every block is done */
    int left = grid;
    uint64_t s = seed | 1;
    while (left > 0) {
        int b = (int)(rng_next(&s) % (uint64_t)grid);
        while (next[b] == n_seg[b]) {
            b = (b + 1) % grid;
        }
        const struct seg g = segs[b][next[b]++];
        left -= next[b] == n_seg[b];
        int64_t sum = 0;
        for (int k = g.kb; k < g.ke; k++) {
            sum += value(g.tile, k);
        }
        if (g.kb == 0 && g.ke == kt) {
            y[g.tile] = sum;
            written[g.tile]++;
            continue;
        }
        const int sl = krk_sp_slot(iters, grid, kt, b, g.tile);
        cr_assert(slot_tile[b * 2 + sl] == -1 || slot_tile[b * 2 + sl] == g.tile,
                  "block %d writes tile %d over tile %d in slot %d", b, g.tile, slot_tile[b * 2 + sl], sl);
        slot_tile[b * 2 + sl] = g.tile;
        part[b * 2 + sl] = sum;
        const int64_t t0 = (int64_t)g.tile * kt;
        const int bf = krk_sp_block(iters, grid, t0), bl = krk_sp_block(iters, grid, t0 + kt - 1);
        cr_assert(bf <= b && b <= bl && bl > bf, "tile %d: block %d outside its blocks %d..%d", g.tile, b, bf, bl);
        if (counter[g.tile]++ == bl - bf) { /* the last: the partials in block order */
            int64_t total = 0;
            for (int bb = bf; bb <= bl; bb++) {
                const int q = krk_sp_slot(iters, grid, kt, bb, g.tile);
                cr_assert_eq(slot_tile[bb * 2 + q], g.tile, "tile %d: block %d's slot %d holds tile %d", g.tile,
                             bb, q, slot_tile[bb * 2 + q]);
                total += part[bb * 2 + q];
            }
            y[g.tile] = total;
            written[g.tile]++;
        }
    }
    for (int t = 0; t < tiles; t++) {
        int64_t want = 0;
        for (int k = 0; k < kt; k++) {
            want += value(t, k);
        }
        cr_assert_eq(written[t], 1, "tiles %d, kt %d, grid %d: tile %d written %d times", tiles, kt, grid, t,
                     written[t]);
        cr_assert_eq(y[t], want, "tiles %d, kt %d, grid %d: tile %d sums to %lld, not %lld", tiles, kt, grid, t,
                     (long long)y[t], (long long)want);
    }
    for (int b = 0; b < grid; b++) {
        free(segs[b]);
    }
    free(segs);
    free(n_seg);
    free(next);
    free(y);
    free(part);
    free(written);
    free(counter);
    free(slot_tile);
}

Test(stream_plan, the_8b_weights_on_h100_and_h200_sm_counts)
{
    /* rows, cols of the Nemotron-H / DSA 8B decode weights (bench/bench_gemv.c) */
    static const int64_t shapes[][2] = {{18560, 4096}, {4096, 8192}, {21504, 4096}, {4096, 21504}, {6144, 4096},
                                        {4096, 4096},  {131072, 4096}, {2304, 4096}, {14336, 1536}, {131, 512},
                                        {4000, 1000},  {1, 512},      {300, 72}};
    static const int sms[] = {78, 114, 132};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        for (int bm = 128; bm <= 256; bm *= 2) {
            const int tiles = (int)((shapes[i][0] + bm - 1) / bm), kt = (int)((shapes[i][1] + 63) / 64);
            for (size_t j = 0; j < sizeof sms / sizeof sms[0]; j++) {
                const int64_t iters = (int64_t)tiles * kt;
                const int grid = iters < sms[j] ? (int)iters : sms[j];
                play(tiles, kt, grid, 0x9e3779b97f4a7c15ull + i * 31 + j);
            }
        }
    }
}

Test(stream_plan, random_shapes_down_to_one_iteration_per_block)
{
    uint64_t s = 12345;
    for (int rep = 0; rep < 3000; rep++) {
        const int tiles = 1 + (int)(rng_next(&s) % 40), kt = 1 + (int)(rng_next(&s) % 70);
        const int64_t iters = (int64_t)tiles * kt;
        const int grid = 1 + (int)(rng_next(&s) % (uint64_t)(iters < 300 ? iters : 300));
        play(tiles, kt, grid, rng_next(&s));
    }
}
