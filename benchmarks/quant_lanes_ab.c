/* The AVX2 per-row kernel on 4-bit codes in rows (row-scale tables, two levels joined) against the
 * lane kernel on the same codes in the lane layout (quant_ops.c), one activation row, the same
 * weights: checks the outputs are equal bit for bit, then times both alternately (wall time, and
 * the ratio of the calling thread's CPU time). VNNI=1 in the environment: the AVX-512 VNNI per-row
 * kernel against its lane kernel instead (an AVX-512 VNNI CPU). TABLES=0: both transpose the scales
 * per call instead of reading row-scale tables.
 *
 *   gcc -O3 -fopenmp -std=gnu11 -ffp-contract=off -DKERNEL_SOURCE='"../pagedllm/native/quant_ops.c"' \
 *       benchmarks/quant_lanes_ab.c -o /tmp/quant_lanes_ab -lm
 *   OMP_NUM_THREADS=1 /tmp/quant_lanes_ab N K ITERS [MINS=1] [LEVELS=2] [COPIES=1]
 *
 * MINS 1: Q4_1-style scales and mins (zero 0); 0: Q4_0-style (zero 8). COPIES > 1 cycles through
 * that many copies of the matrix, to stream it from memory instead of the caches.
 * (KERNEL_SOURCE is relative to this file.)
 */
#include KERNEL_SOURCE
#include <stdio.h>
#include <time.h>

/* interleaved: [passes][blocks][4 chunks][32 bytes]; chunk ch, byte 4j+t: low = w[8p+j][32b+8ch+t],
   high = w[8p+j][32b+8ch+4+t] */
static void interleave_q4(const uint8_t *q, int64_t N, int64_t Kp, uint8_t *out) {
    const int64_t row_bytes = Kp / 2, blocks = Kp / 32, passes = (N + 7) / 8;
    for (int64_t p = 0; p < passes; p++)
        for (int64_t b = 0; b < blocks; b++)
            for (int ch = 0; ch < 4; ch++)
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) {
                        int64_t n = 8 * p + j;
                        int lo = 0, hi = 0;
                        if (n < N) {
                            lo = weight_q(q + n * row_bytes, 32 * b + 8 * ch + t, 4);
                            hi = weight_q(q + n * row_bytes, 32 * b + 8 * ch + 4 + t, 4);
                        }
                        out[((p * blocks + b) * 4 + ch) * 32 + 4 * j + t] = (uint8_t)(lo | hi << 4);
                    }
}

static void table(const uint16_t *s, int64_t N, int64_t per_row, int cols, uint16_t *out) {
    int64_t passes = (N + cols - 1) / cols;
    for (int64_t p = 0; p < passes; p++) for (int64_t j = 0; j < per_row; j++) for (int c = 0; c < cols; c++)
        out[(p * per_row + j) * cols + c] = cols * p + c < N ? s[(cols * p + c) * per_row + j] : 0;
}

static double cpu_now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static double wall_now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

TARGET_AVX2 int main(int argc, char **argv) {
    int64_t N = atoi(argv[1]), K = atoi(argv[2]); int iters = atoi(argv[3]); int mins = argc > 4 ? atoi(argv[4]) : 1;
    int levels = argc > 5 ? atoi(argv[5]) : 2; int copies = argc > 6 ? atoi(argv[6]) : 1;
    int64_t Kp = K, blocks = Kp / 32, rb = Kp / 2;
    srand(1);
    uint8_t *q = malloc(copies * N * rb), *qi = malloc(copies * ((N + 7) / 8) * 8 * rb);
    uint16_t *d = malloc(N * blocks * 2), *m = malloc(N * blocks * 2);
    const int vnni = getenv("VNNI") && atoi(getenv("VNNI")), cols = vnni ? 16 : 8;
    uint16_t *dt = malloc(((N + 15) / 16) * 16 * blocks * 2), *mt = malloc(((N + 15) / 16) * 16 * blocks * 2);
    for (int64_t i = 0; i < copies * N * rb; i++) q[i] = rand();
    for (int64_t i = 0; i < N * blocks; i++) { d[i] = _cvtss_sh((rand() % 1000) * 1e-5f, 0); m[i] = _cvtss_sh(-(rand() % 1000) * 1e-5f, 0); }
    for (int c = 0; c < copies; c++) interleave_q4(q + c * N * rb, N, Kp, qi + c * ((N + 7) / 8) * 8 * rb);
    table(d, N, blocks, cols, dt); table(m, N, blocks, cols, mt);
    float *x = malloc(K * 4); for (int64_t i = 0; i < K; i++) x[i] = (rand() % 2001 - 1000) * 1e-3f;
    int8_t *xq = malloc(Kp), *xq2 = malloc(Kp); float *dx = malloc(blocks * 4); int32_t *xs = malloc(blocks * 4);
    quantize_activations(1, x, 1, K, Kp, xq, levels == 2 ? xq2 : 0, dx, xs);
    float *y0 = malloc(N * 4), *y1 = malloc(N * 4);
    int zero = mins ? 0 : 8;
    int8_t *x2 = levels == 2 ? xq2 : 0;
    RowKernel rows_k = AVX2_ROWS, lanes_k = AVX2_LANES;
    if (vnni) rows_k = VNNI_ROWS, lanes_k = VNNI_LANES;
    if (getenv("TABLES") && !atoi(getenv("TABLES"))) dt = mt = 0;
    uint16_t *mm = mins ? m : 0, *mmt = mins ? mt : 0;
    gemm_rows(rows_k, q, d, mm, dt, mmt, N, Kp, 4, 1, zero, 0, xq, x2, dx, xs, 1, y0);
    gemm_rows(lanes_k, qi, d, mm, dt, mmt, N, Kp, 4, 1, zero, 1, xq, x2, dx, xs, 1, y1);
    int bad = 0; for (int64_t i = 0; i < N; i++) bad += memcmp(&y0[i], &y1[i], 4) != 0;
    printf("N %ld K %ld mins %d levels %d copies %d: mismatches %d (y0[5]=%g y1[5]=%g)\n", N, K, mins, levels, copies, bad, y0[5], y1[5]);
    for (int round = 0; round < 3; round++) {
        double c0 = cpu_now(), w0 = wall_now();
        for (int it = 0; it < iters; it++) { int c = it % copies; gemm_rows(rows_k, q + c * N * rb, d, mm, dt, mmt, N, Kp, 4, 1, zero, 0, xq, x2, dx, xs, 1, y0); }
        double c1 = cpu_now(), w1 = wall_now();
        for (int it = 0; it < iters; it++) { int c = it % copies; gemm_rows(lanes_k, qi + c * ((N + 7) / 8) * 8 * rb, d, mm, dt, mmt, N, Kp, 4, 1, zero, 1, xq, x2, dx, xs, 1, y1); }
        double c2 = cpu_now(), w2 = wall_now();
        double bytes = N * (rb + blocks * 2 * (mins ? 2 : 1));
        printf("old %.2f us (%.1f GB/s wall) | lane %.2f us (%.1f GB/s wall) | cpu old/lane %.3f\n", (w1 - w0) / iters * 1e6,
               bytes / ((w1 - w0) / iters) / 1e9, (w2 - w1) / iters * 1e6, bytes / ((w2 - w1) / iters) / 1e9, (c1 - c0) / (c2 - c1));
    }
    return 0;
}
