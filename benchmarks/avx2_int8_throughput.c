/* Throughput of the AVX2 instructions the 4-bit tiled matmul (quant_ops.c, tile_avx2_q4)
 * is made of, per core clock: how many vpmaddubsw + vpaddw pairs a core retires per cycle,
 * with and without the weight broadcast each pair takes.
 *
 *   gcc -O2 -mavx2 -mfma benchmarks/avx2_int8_throughput.c -o /tmp/int8_tp && /tmp/int8_tp
 *
 * The clock is estimated first from a chain of dependent scalar additions (one per cycle).
 * docs/profile.md, "Eleventh round", has the AMD Zen 3 figures. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define N 100000000L
#define TIME(NAME, PER_ITER, BODY, ...)                                                   \
    do {                                                                                  \
        const double t0 = seconds();                                                      \
        for (long i = 0; i < N; i++) __asm__ volatile(BODY ::"r"(buf) : __VA_ARGS__);    \
        const double per_cycle = (PER_ITER) * N / ((seconds() - t0) * ghz * 1e9);          \
        printf("%-44s %.2f per cycle\n", NAME, per_cycle);                               \
    } while (0)

int main(void) {
    static int buf[16] __attribute__((aligned(64)));
    double t0 = seconds();
    long s = 0;
    for (long i = 0; i < 4 * N; i++) __asm__ volatile("add $1, %0" : "+r"(s));
    const double ghz = 4.0 * N / (seconds() - t0) / 1e9;
    printf("clock (dependent adds): %.2f GHz\n", ghz);
    TIME("vpaddw, 8 independent", 8.0,
         "vpaddw %%ymm0,%%ymm8,%%ymm8\n vpaddw %%ymm0,%%ymm9,%%ymm9\n vpaddw %%ymm0,%%ymm10,%%ymm10\n"
         "vpaddw %%ymm0,%%ymm11,%%ymm11\n vpaddw %%ymm0,%%ymm12,%%ymm12\n vpaddw %%ymm0,%%ymm13,%%ymm13\n"
         "vpaddw %%ymm0,%%ymm14,%%ymm14\n vpaddw %%ymm0,%%ymm15,%%ymm15\n",
         "ymm8", "ymm9", "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15");
    TIME("vpmaddubsw, 4 independent", 4.0,
         "vpmaddubsw %%ymm0,%%ymm1,%%ymm4\n vpmaddubsw %%ymm0,%%ymm2,%%ymm5\n"
         "vpmaddubsw %%ymm0,%%ymm1,%%ymm6\n vpmaddubsw %%ymm0,%%ymm2,%%ymm7\n",
         "ymm4", "ymm5", "ymm6", "ymm7");
    TIME("vpmaddubsw + vpaddw into 4 sums", 4.0,
         "vpmaddubsw %%ymm0,%%ymm1,%%ymm4\n vpaddw %%ymm4,%%ymm8,%%ymm8\n"
         "vpmaddubsw %%ymm0,%%ymm2,%%ymm5\n vpaddw %%ymm5,%%ymm9,%%ymm9\n"
         "vpmaddubsw %%ymm0,%%ymm1,%%ymm6\n vpaddw %%ymm6,%%ymm10,%%ymm10\n"
         "vpmaddubsw %%ymm0,%%ymm2,%%ymm7\n vpaddw %%ymm7,%%ymm11,%%ymm11\n",
         "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11");
    TIME("vpbroadcastd + vpmaddubsw + vpaddw (the tile's step)", 4.0,
         "vpbroadcastd (%0),%%ymm3\n vpmaddubsw %%ymm3,%%ymm1,%%ymm4\n vpaddw %%ymm4,%%ymm8,%%ymm8\n"
         "vpbroadcastd 4(%0),%%ymm3\n vpmaddubsw %%ymm3,%%ymm2,%%ymm5\n vpaddw %%ymm5,%%ymm9,%%ymm9\n"
         "vpbroadcastd 8(%0),%%ymm12\n vpmaddubsw %%ymm12,%%ymm1,%%ymm6\n vpaddw %%ymm6,%%ymm10,%%ymm10\n"
         "vpbroadcastd 12(%0),%%ymm13\n vpmaddubsw %%ymm13,%%ymm2,%%ymm7\n vpaddw %%ymm7,%%ymm11,%%ymm11\n",
         "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", "ymm12", "ymm13");
    TIME("vpmaddwd + vpaddd into 4 sums", 4.0,
         "vpmaddwd %%ymm0,%%ymm1,%%ymm4\n vpaddd %%ymm4,%%ymm8,%%ymm8\n"
         "vpmaddwd %%ymm0,%%ymm2,%%ymm5\n vpaddd %%ymm5,%%ymm9,%%ymm9\n"
         "vpmaddwd %%ymm0,%%ymm1,%%ymm6\n vpaddd %%ymm6,%%ymm10,%%ymm10\n"
         "vpmaddwd %%ymm0,%%ymm2,%%ymm7\n vpaddd %%ymm7,%%ymm11,%%ymm11\n",
         "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11");
    TIME("vfmadd231ps, 8 independent", 8.0,
         "vfmadd231ps %%ymm0,%%ymm1,%%ymm8\n vfmadd231ps %%ymm0,%%ymm2,%%ymm9\n"
         "vfmadd231ps %%ymm0,%%ymm1,%%ymm10\n vfmadd231ps %%ymm0,%%ymm2,%%ymm11\n"
         "vfmadd231ps %%ymm0,%%ymm1,%%ymm12\n vfmadd231ps %%ymm0,%%ymm2,%%ymm13\n"
         "vfmadd231ps %%ymm0,%%ymm1,%%ymm14\n vfmadd231ps %%ymm0,%%ymm2,%%ymm15\n",
         "ymm8", "ymm9", "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15");
    return 0;
}
