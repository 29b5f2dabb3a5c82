/* The AMX-BF16 tile loop's ceiling on one core: the dense kernel's 2 x 2 inner loop (two row
 * tiles by two weight groups, four TDPBF16PS per 32-input block) with nothing else around it.
 *
 *     gcc -O2 -o /tmp/amx_tile_ceiling benchmarks/amx_tile_ceiling.c
 *     /tmp/amx_tile_ceiling A_STRIDE BLOCKS ROW_PAIRS WEIGHT_BLOCKS
 *
 * A_STRIDE: bytes between activation rows (1152 for 576 bfloat16 inputs, 64 for tiles stored
 * whole); BLOCKS: 32-input blocks per row pair (9 for the kernel's K blocks at 576 inputs);
 * ROW_PAIRS: row-tile pairs cycled through (their bytes: ROW_PAIRS x 32 x A_STRIDE); WEIGHT_BLOCKS:
 * blocks of each of the two weight panels cycled through (1 KiB a block). Prints ns per block and
 * TFLOP/s (best of 5). Linux x86-64 with AMX-BF16 only; the values are ones, the sums discarded.
 * docs/benchmarks.md, "The dense kernel's tile loop against its ceiling", has the figures. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(void){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
/* 2x2 over blocks b of one row-tile pair with A stride `as` bytes, A advancing `ab` bytes a block
   (cycling within asz), B: two panels of `nb` blocks (1 KiB each) */
__attribute__((target("amx-tile,amx-bf16,avx512f")))
int main(int argc, char **argv) {
    syscall(SYS_arch_prctl, 0x1023, 18);
    cfg_t c; memset(&c,0,sizeof c); c.palette=1; for(int t=0;t<8;t++){c.rows[t]=16;c.colsb[t]=64;}
    _tile_loadconfig(&c);
    long as = atol(argv[1]), nblk = atol(argv[2]), nrowpairs = atol(argv[3]), nb = atol(argv[4]);
    /* A: nrowpairs row pairs of 32 rows x (nblk*64 B) with row stride as (>= nblk*64) */
    long asz = nrowpairs * 32 * as;
    char *A = aligned_alloc(64, asz), *B = aligned_alloc(64, 2 * nb * 1024);
    memset(A, 1, asz); memset(B, 1, 2*nb*1024);
    long iters = 0; double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now(); iters = 0;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int outer = 0; outer < 200; outer++)
        for (long rp = 0; rp < nrowpairs; rp++) {
            const char *a0 = A + rp * 32 * as, *a1 = a0 + 16 * as;
            for (long b = 0; b < nblk; b++) {
                const long bb = b % nb;
                _tile_loadd(6, B + 1024 * bb, 64);
                _tile_loadd(4, a0 + 64 * b, as);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, B + nb * 1024 + 1024 * bb, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, a1 + 64 * b, as);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
                iters++;
            }
        }
        double t = now() - t0; if (t < best) best = t;
    }
    printf("as %ld nblk %ld rowpairs %ld (A %ld KB) nb %ld: %.1f ns/iter %.2f TFLOP/s\n", as, nblk, nrowpairs, asz >> 10, nb, best / iters * 1e9, iters * 4.0 * 16*16*32*2 / best / 1e12);
    return 0;
}
