/* Native kernels of pagedllm's weight-only quantized linear layers.
 *
 * One weight layout serves every format (GGUF Q4_0, Q4_1, Q8_0 and the RTN
 * int4 / int8 formats): a row of K weights is K / 32 blocks of 32, and
 *
 *     w[k] = d[k / G] * (q[k] - zero) + m[k / G]        (m absent: 0)
 *
 * with q unsigned (4 or 8 bits), d and m float16 per group of G = 32 * r
 * weights, and one integer zero point per format (Q4_0: 8, Q8_0 stored as
 * q + 128: 128, Q4_1: 0 with mins). K is padded to a multiple of 64 (and of G)
 * with weights whose d and m are 0.
 *
 * q bytes, per row: 4-bit, K / 2 bytes where byte i of each 64-weight group
 * holds weight i in its low nibble and weight 32 + i in its high one (so one
 * 32-byte load unpacks into 64 weights in order); 8-bit, K bytes in order.
 * Lane layout (4-bit codes, the per-row lane kernels'; `lanes` in the calls below): the
 * outputs in passes of LANE_COLS = 8, N a multiple of 8, each pass's codes together
 * ([N / 8][Kp / 32][4][32] bytes, as many as the rows take): chunk c of block b of a pass
 * holds weights 32 b + 8 c .. + 7 of its 8 outputs, byte 4 j + t output j's weight
 * 32 b + 8 c + t in its low nibble and 32 b + 8 c + 4 + t in its high one. One 32-byte load
 * then feeds vpmaddubsw with 4 weights of each of 8 outputs per int32 lane against one
 * broadcast dword of activations, so a block's sum per output builds up in the lanes
 * (in int16: 8 pair sums of at most 2 x 15 x 128 each fit) with no horizontal reduction.
 * AVX-512 VNNI (lane_pass_vnni) loads two chunks per zmm and runs two passes side by side.
 *
 * The activations are quantized per 32-block to int8 with a float scale
 * (as llama.cpp's Q8 activations are), so a block's dot product is one
 * integer sum, dot - zero * xsum, scaled by dx * d (plus m * dx * xsum).
 * With two levels (xq2 given) each block also carries the residual of the
 * first level at a scale 256 times finer: x ~ dx * (256 q1 + q2), a 16-bit
 * fixed-point activation, and the block's integer sum is
 * (sum w q1 << 8) + sum w q2 - zero * xsum with xsum = 256 sum q1 + sum q2
 * (below 2^31 for every code width). The float work per block is the same
 * as with one level; only the integer work doubles.
 * Every path computes exactly these integer sums and follows one float
 * sequence per output, so every path gives the same bits.
 *
 * Paths, chosen at run time (__builtin_cpu_supports, CPUID) or forced by the caller:
 *   3  AVX-512 VNNI + AMX-INT8: from AMX_MIN_ROWS activation rows (either level count),
 *      TDPBSUD on 16 x 16 tiles computes the block sums (see gemm_amx); fewer rows run path 2.
 *   2  AVX-512 VNNI. Few activation rows: per output, vpdpbusd multiplies 64
 *      unsigned weight bytes by 64 signed activation bytes; the per-lane terms
 *      (activation scale of each 4-weight lane, zero-point correction, min
 *      term) are precomputed per activation row, one reduction per output.
 *      A 4-bit matrix in the lane layout takes lane_pass_vnni instead (no
 *      reduction), and the tiled kernel unpacks it a pass at a time.
 *   1  AVX2 + FMA (no VNNI): vpmaddubsw + vpmaddwd; 8-bit codes through the
 *      sign trick (|w| times x with w's sign), whose int16 pairs cannot
 *      saturate since |w| <= 128 and |x| <= 127 (so 8-bit codes need zero
 *      128, as Q8_0 and int8 have; any other takes the portable path); the
 *      tiled kernel for 8-bit codes widens codes and activations to int16 and
 *      takes vpmaddwd alone (tile_avx2_q8). Its per-row kernel reads each pass's
 *      scales and mins from a row-scale table (see gemm_rows) where the caller
 *      gives one, else transposes them per call. A 4-bit matrix in the lane layout
 *      (above) takes the lane kernel instead (lane_pass_avx2), and its tiled kernel
 *      unpacks its codes from that layout a pass at a time.
 *   0  portable C, the reference the others are tested against.
 * Many rows (from quant_tiled_min_rows()), paths 2 and 1 take a
 * tiled kernel: the activations are transposed so that one vector holds 4
 * consecutive bytes of 16 (zmm) or 8 (ymm) rows; each weight dword (4 codes of
 * one output, unpacked to bytes once per call) is broadcast and one vpdpbusd /
 * vpmaddubsw gives that output's partial sums for all those rows. So the
 * unpacked weights are reused by every row, and a block's scale costs one
 * multiply per (block, output, vector of rows) instead of per (block, output, row).
 * A call with many rows (a prefill chunk) takes its row tiles in bands that fit
 * in L2, and unpacks each output group's codes once per band.
 * The tile kernels' inner loops are written for what GCC makes of them: fully
 * unrolled with every running sum in a register (checked in the object code; a
 * sum spilled or regrouped costs 1.3-1.4x, docs/benchmarks.md "Packed matmuls,
 * many rows").
 * Parallel loops use the OpenMP runtime PyTorch has already loaded.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "work_share.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define QUANT_X86 1
#endif

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Activation rows, quantized: xq [rows, Kp] int8 in [-127, 127]; per 32-block,
 * dx [rows, Kp / 32] the block's scale and xsum [rows, Kp / 32] = sum(xq of the
 * block). With two levels, xq2 [rows, Kp] int8 in [-127, 127] holds the
 * residual: t = x / d (d = amax / 127), q1 = round(t), q2 = round(256 (t - q1)),
 * and then dx = d / 256, xsum = 256 sum q1 + sum q2. Elements k >= K are zero.
 * Every path rounds the same way (to nearest even; t - q1 and the product by
 * 256 are exact) and writes the same bytes. */
typedef struct {
    int8_t *xq;    /* the row's Kp codes (the first level) */
    int8_t *xq2;   /* the second level's Kp codes, or NULL for one level */
    float *dx;     /* Kp / 32 blocks */
    int32_t *xsum; /* Kp / 32 blocks */
} ActivationRow;

static inline int32_t clamp127(int32_t v) { return v < -127 ? -127 : v > 127 ? 127 : v; }

/* Block [b, b + 32) of row xr (K elements, b < K). */
static void quantize_block_portable(const float *xr, int64_t b, int64_t K, ActivationRow out) {
    float amax = 0.0f;
    for (int64_t k = b; k < b + 32 && k < K; k++) amax = fmaxf(amax, fabsf(xr[k]));
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum1 = 0, sum2 = 0;
    for (int64_t k = b; k < b + 32; k++) {
        const float t = k < K ? xr[k] * inv : 0.0f;
        const int32_t q1 = (int32_t)lrintf(t);
        out.xq[k] = (int8_t)q1;
        sum1 += q1;
        if (out.xq2) {
            const int32_t q2 = clamp127((int32_t)lrintf((t - (float)q1) * 256.0f));
            out.xq2[k] = (int8_t)q2;
            sum2 += q2;
        }
    }
    out.xsum[b / 32] = out.xq2 ? 256 * sum1 + sum2 : sum1;
    out.dx[b / 32] = out.xq2 ? d * (1.0f / 256.0f) : d;
}

#ifdef QUANT_X86
/* 32 int32 codes (each in [-127, 127]) stored as bytes in order; returns their sum. */
__attribute__((target("avx2,fma,f16c"))) static int32_t store_codes_avx2(const __m256i q[4], int8_t *dst) {
    /* packs interleave 128-bit lanes: dwords come out as a0 b0 c0 d0 a1 b1 c1 d1 */
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)dst, bytes);
    const __m256i lane_sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(lane_sums), _mm256_extracti128_si256(lane_sums, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4);
}

/* A whole block (b + 32 <= K) with 8-float vectors: the same bytes as the portable code. */
__attribute__((target("avx2,fma,f16c"))) static void quantize_block_avx2(const float *xr, int64_t b,
                                                                         ActivationRow out) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], amax8 = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(xr + b + 8 * j);
        amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[j], magnitude));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4), d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m256 t[4];
    __m256i q[4];
    for (int j = 0; j < 4; j++) {
        t[j] = _mm256_mul_ps(v[j], _mm256_set1_ps(inv));
        q[j] = _mm256_cvtps_epi32(t[j]);
    }
    const int32_t sum1 = store_codes_avx2(q, out.xq + b);
    if (!out.xq2) {
        out.dx[b / 32] = d;
        out.xsum[b / 32] = sum1;
        return;
    }
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (int j = 0; j < 4; j++) { /* t - q1 is exact, and so is its product by 256 */
        const __m256 rest = _mm256_sub_ps(t[j], _mm256_cvtepi32_ps(q[j]));
        q[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(256.0f))), lo), hi);
    }
    const int32_t sum2 = store_codes_avx2(q, out.xq2 + b);
    out.dx[b / 32] = d * (1.0f / 256.0f);
    out.xsum[b / 32] = 256 * sum1 + sum2;
}

/* One row: whole blocks with vectors, a partial last block with the portable code. */
__attribute__((target("avx2,fma,f16c"))) static void quantize_row_avx2(const float *xr, int64_t K, int64_t Kp,
                                                                       ActivationRow out) {
    int64_t b = 0;
    for (; b + 32 <= K; b += 32) quantize_block_avx2(xr, b, out);
    for (; b < Kp; b += 32) quantize_block_portable(xr, b, K, out);
}

#define TARGET_AVX512_QUANT __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

/* quantize_block_avx2 with two 16-float vectors: the same bytes (the same products, the same
 * rounding to nearest even; the codes are in [-127, 127], so the saturating narrowing keeps them). */
TARGET_AVX512_QUANT static void quantize_block_avx512(const float *xr, int64_t b, ActivationRow out) {
    const __m512 v0 = _mm512_loadu_ps(xr + b), v1 = _mm512_loadu_ps(xr + b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 t0 = _mm512_mul_ps(v0, _mm512_set1_ps(inv)), t1 = _mm512_mul_ps(v1, _mm512_set1_ps(inv));
    const __m512i q0 = _mm512_cvtps_epi32(t0), q1 = _mm512_cvtps_epi32(t1);
    _mm_storeu_si128((__m128i *)(out.xq + b), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(out.xq + b + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t sum1 = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    if (!out.xq2) {
        out.dx[b / 32] = d;
        out.xsum[b / 32] = sum1;
        return;
    }
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512 by256 = _mm512_set1_ps(256.0f);
    /* t - q1 is exact, and so is its product by 256 */
    const __m512i r0 = _mm512_min_epi32(_mm512_max_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t0, _mm512_cvtepi32_ps(q0)), by256)), lo), hi);
    const __m512i r1 = _mm512_min_epi32(_mm512_max_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t1, _mm512_cvtepi32_ps(q1)), by256)), lo), hi);
    _mm_storeu_si128((__m128i *)(out.xq2 + b), _mm512_cvtsepi32_epi8(r0));
    _mm_storeu_si128((__m128i *)(out.xq2 + b + 16), _mm512_cvtsepi32_epi8(r1));
    out.dx[b / 32] = d * (1.0f / 256.0f);
    out.xsum[b / 32] = 256 * sum1 + _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
}

TARGET_AVX512_QUANT static void quantize_row_avx512(const float *xr, int64_t K, int64_t Kp, ActivationRow out) {
    int64_t b = 0;
    for (; b + 32 <= K; b += 32) quantize_block_avx512(xr, b, out);
    for (; b < Kp; b += 32) quantize_block_portable(xr, b, K, out);
}
#endif

/* isa >= 1 takes the AVX2 code for whole blocks (every CPU with a vector path has AVX2), isa >= 2
 * (AVX-512 VNNI and up) the AVX-512 code. xq2: the second level's codes [rows, Kp], or NULL for one
 * level. */
void quantize_activations(int isa, const float *x, int64_t rows, int64_t K, int64_t Kp, int8_t *xq, int8_t *xq2,
                          float *dx, int32_t *xsum) {
    _Pragma("omp parallel for schedule(static) if(rows >= 8)")
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * K;
        ActivationRow out = {xq + r * Kp, xq2 ? xq2 + r * Kp : 0, dx + r * (Kp / 32), xsum + r * (Kp / 32)};
#ifdef QUANT_X86
        if (isa >= 2) {
            quantize_row_avx512(xr, K, Kp, out);
            continue;
        }
        if (isa >= 1) {
            quantize_row_avx2(xr, K, Kp, out);
            continue;
        }
#endif
        for (int64_t b = 0; b < Kp; b += 32) quantize_block_portable(xr, b, K, out);
    }
    (void)isa;
}

/* ------------------------------------------------------------ portable path */

static inline int weight_q(const uint8_t *row, int64_t k, int bits) {
    if (bits == 8) return row[k];
    uint8_t byte = row[(k / 64) * 32 + (k % 32)];
    return (k % 64) < 32 ? (byte & 0x0f) : (byte >> 4);
}

#define LANE_COLS 8 /* outputs per pass of the lane layout (see the top of the file) */

/* Code k of output n: rows as above, or (lanes, 4-bit codes) the lane layout. */
static inline int code_at(const uint8_t *q, int64_t n, int64_t k, int bits, int64_t row_bytes, int lanes) {
    if (!lanes || bits != 4) return weight_q(q + n * row_bytes, k, bits);
    const int64_t within = k % 32, t8 = within % 8;
    const uint8_t byte = q[(n / LANE_COLS) * LANE_COLS * row_bytes + (k / 32 * 4 + within / 8) * 32 +
                           4 * (n % LANE_COLS) + (t8 & 3)];
    return t8 < 4 ? (byte & 0x0f) : (byte >> 4);
}

/* One output . one activation row in the float sequence every path follows (the batch
 * invariance of the quantized layers rests on it): per 32-block b in order, the exact integer
 * sum isum = sum (q - zero) * x (x = 256 q1 + q2 with two levels), then
 * acc = fma(isum, dx * dw, acc) and, with mins, acc = fma(dx * xsum, mw, acc). */
static float dot_portable(const uint8_t *q, int64_t n, int64_t row_bytes, int lanes, const uint16_t *drow,
                          const uint16_t *mrow, int64_t Kp, int bits, int r, int32_t zero, const int8_t *xq, const int8_t *xq2, const float *dx,
                          const int32_t *xsum) {
    float acc = 0.0f;
    for (int64_t b = 0; b < Kp / 32; b++) {
        int32_t dot = 0;
        for (int64_t k = 32 * b; k < 32 * b + 32; k++)
            dot += code_at(q, n, k, bits, row_bytes, lanes) * (xq2 ? 256 * xq[k] + xq2[k] : xq[k]);
        const float dxb = dx[b], scale = dxb * half_to_float(drow[b / r]);
        acc = fmaf((float)(dot - zero * xsum[b]), scale, acc);
        if (mrow) acc = fmaf(dxb * (float)xsum[b], half_to_float(mrow[b / r]), acc);
    }
    return acc;
}

/* y[i, n] for outputs [n0, n0 + count) and every row i, one dot_portable each. */
static void gemm_outputs_portable(const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t n0, int64_t count,
                                  int64_t N, int64_t Kp, int bits, int r, int32_t zero, int lanes, const int8_t *xq,
                                  const int8_t *xq2, const float *dx, const int32_t *xsum, int64_t rows, float *y) {
    const int64_t row_bytes = bits == 4 ? Kp / 2 : Kp, scales_per_row = Kp / 32 / r;
    for (int64_t n = n0; n < n0 + count; n++)
        for (int64_t i = 0; i < rows; i++)
            y[i * N + n] = dot_portable(q, n, row_bytes, lanes, d + n * scales_per_row, m ? m + n * scales_per_row : 0,
                                        Kp, bits, r, zero, xq + i * Kp, xq2 ? xq2 + i * Kp : 0, dx + i * (Kp / 32),
                                        xsum + i * (Kp / 32));
}

/* ------------------------------------------------------------ AVX-512 VNNI path */

#ifdef QUANT_X86
/* A per-row kernel of one ISA: outputs in the vector lanes, `cols` per pass. */
typedef void (*TransposeScales)(const uint16_t *s, int64_t n0, int64_t count, int64_t blocks, int r, float *out);
typedef void (*RowPass)(const uint8_t *q, int64_t row_bytes, int64_t n0, int64_t count, int64_t Kp, int bits,
                        int zero, const int8_t *xq, const int8_t *xq2, const int16_t *x16, const float *dx,
                        const int32_t *xsum, const float *dw, const float *mw, const uint16_t *dt,
                        const uint16_t *mt, int r_shift, const uint8_t *next, float *out);
typedef struct {
    TransposeScales transpose; /* a pass's scales and mins into [blocks][cols] floats */
    RowPass pass;              /* one activation row . the pass's outputs */
    int64_t cols;              /* outputs per pass, at most MAX_ROW_COLS */
    int64_t prefetch_passes;   /* a pass prefetches the weights of the pass this far ahead */
    /* where the pass takes the activations prepared once per call (its x16 argument; NULL: x16 is
       NULL): join(xq, xq2, n, bits, out) writes join_bytes bytes per code and level for n codes
       (the AVX2 row kernel: two levels joined as int16 256 xq + xq2; the lane kernel: each dword
       of codes broadcast to a vector) */
    void (*join)(const int8_t *xq, const int8_t *xq2, int64_t n, int bits, int16_t *out);
    int64_t join_bytes;
    int join_one_level; /* join one level too, not only two; and the pass needs the join (without
                           it, out of memory, the passes take the portable path) */
    int tables; /* the pass reads a row-scale table (see gemm_rows, cols wide) in place of dw / mw */
} RowKernel;

#define MAX_ROW_COLS 16

/* y [rows, N] by passes of k.cols outputs, the parallel work items; each pass transposes its
 * scales once (or reads them from the row-scale tables dt / mt, where the kernel takes them and
 * they are given) and runs every row on them (its weights stay in L1 for the later rows).
 * A row-scale table of s [N][per_row] float16 (scales or mins) is [ceil(N / cols)][per_row][cols]:
 * entry (p, j, c) = s[p cols + c][j], 0 past N (quant_ops.row_scale_tables). The same values in
 * the order a pass reads them, one vector per group instead of a transpose on every call. */
static void gemm_rows(RowKernel k, const uint8_t *q, const uint16_t *d, const uint16_t *m, const uint16_t *dt,
                      const uint16_t *mt, int64_t N, int64_t Kp, int bits, int r, int zero, int lanes,
                      const int8_t *xq, const int8_t *xq2, const float *dx, const int32_t *xsum, int64_t rows,
                      float *y) {
    const int64_t row_bytes = bits == 4 ? Kp / 2 : Kp, blocks = Kp / 32;
    const int64_t cols = k.cols, num_passes = (N + cols - 1) / cols;
    if (!m) mt = 0;
    if (!k.tables || (m && !mt)) dt = mt = 0;
    const int r_shift = r == 4 ? 2 : r == 2 ? 1 : 0;
    /* the rows' activations prepared once per call, for a kernel that takes them so (NULL when out
       of memory: the pass then takes them as bytes, the same sums); 64-byte aligned rows */
    const int64_t prep_stride = Kp * k.join_bytes * (xq2 ? 2 : 1);
    char *prep = k.join && (xq2 || k.join_one_level) ? aligned_alloc(64, (size_t)(rows * prep_stride)) : 0;
    if (prep) k.join(xq, xq2, rows * Kp, bits, (int16_t *)prep);
    const int portable = k.join_one_level && !prep;
    WorkShare ws; /* each thread the static split's passes, then the others' last ones (work_share.h) */
    work_share_init(&ws, num_passes, work_share_threads(num_passes), 1);
    _Pragma("omp parallel if(num_passes > 1 && N * Kp * rows >= 65536)")
    {
        float *dw = malloc((size_t)(2 * blocks * cols) * sizeof(float)), *mw = m ? dw + blocks * cols : 0;
        float out[MAX_ROW_COLS];
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        WorkItem it;
        while (work_share_next(&ws, me, nth, &it)) {
            const int64_t p = it.unit, n0 = p * cols, count = N - n0 < cols ? N - n0 : cols;
            if (!dw || portable) { /* out of memory: the same numbers one output at a time */
                gemm_outputs_portable(q, d, m, n0, count, N, Kp, bits, r, zero, lanes, xq, xq2, dx, xsum, rows, y);
                continue;
            }
            /* a pass of the thread's own share prefetches the one k.prefetch_passes on in it */
            const int64_t ahead = n0 + k.prefetch_passes * cols;
            const uint8_t *next = it.own && p + k.prefetch_passes < it.share_hi ? q + ahead * row_bytes : 0;
            /* a pass's table rows start where its first output's scales do in s: at n0 * per_row */
            const uint16_t *ds_src = dt ? dt : d, *ms_src = dt ? mt : m;
            const uint16_t *dtp = dt ? dt + n0 * (blocks / r) : 0, *mtp = mt ? mt + n0 * (blocks / r) : 0;
            if (next) { /* and that pass's scales and mins (or table rows), which the pass would wait for */
                const int64_t scale_bytes = cols * (blocks / r) * 2;
                const char *ds = (const char *)(ds_src + ahead * (blocks / r));
                const char *ms = ms_src ? (const char *)(ms_src + ahead * (blocks / r)) : 0;
                for (int64_t off = 0; off < scale_bytes + 63; off += 64) {
                    _mm_prefetch(ds + off, _MM_HINT_T0);
                    if (ms) _mm_prefetch(ms + off, _MM_HINT_T0);
                }
            }
            if (!dt) {
                k.transpose(d, n0, count, blocks, r, dw);
                if (m) k.transpose(m, n0, count, blocks, r, mw);
            }
            for (int64_t i = 0; i < rows; i++) {
                k.pass(q, row_bytes, n0, count, Kp, bits, zero, xq + i * Kp, xq2 ? xq2 + i * Kp : 0,
                       prep ? (const int16_t *)(prep + i * prep_stride) : 0, dx + i * blocks,
                       xsum + i * blocks, dw, mw, dtp, mtp, r_shift, i == 0 ? next : 0, out);
                memcpy(y + i * N + n0, out, (size_t)count * sizeof(float));
            }
        }
        free(dw);
    }
    free(prep);
}

#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

/* Group g (64 weights) of a row as 64 unsigned bytes in order. */
TARGET_VNNI static inline __m512i unpack_group_vnni(const uint8_t *qrow, int64_t g, int bits) {
    if (bits == 8) return _mm512_loadu_si512((const void *)(qrow + g * 64));
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i packed = _mm256_loadu_si256((const __m256i *)(qrow + g * 32));
    __m256i lo = _mm256_and_si256(packed, low4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

#define VNNI_ROW_COLS 16 /* outputs per per-row pass: one int32 / float lane each */
#ifndef ROW_PREFETCH_PASSES
#define ROW_PREFETCH_PASSES 2 /* a per-row pass prefetches the weights of the pass this far ahead (1-4 measure alike) */
#endif

/* The 16 lane sums (4 weights each) of weights w . activations xv, or with two levels
 * (xv2: the second level) (w . xv << 8) + w . xv2: exact, and linear in the lanes. */
TARGET_VNNI static inline __m512i lane_sums_vnni(__m512i w, __m512i xv, __m512i xv2, int two) {
    const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
    return two ? _mm512_dpbusd_epi32(_mm512_slli_epi32(a, 8), w, xv2) : a;
}

/* Group g (64 weights, two 32-blocks) of outputs rows[0..16) . xv (and xv2) -> s0 / s1 [16 outputs]:
 * each block's exact integer sum. Pairs of outputs are reduced as soon as they exist. */
TARGET_VNNI static inline void block_sums_vnni(const uint8_t *const rows[VNNI_ROW_COLS], int64_t g, int bits,
                                               __m512i xv, __m512i xv2, int two, __m512i *s0, __m512i *s1) {
    __m512i u[8], v[4];
    for (int j = 0; j < 8; j++) { /* per 128-bit chunk: lanes 0+2, 1+3 of outputs 2j, 2j + 1 */
        const __m512i a = lane_sums_vnni(unpack_group_vnni(rows[2 * j], g, bits), xv, xv2, two);
        const __m512i b = lane_sums_vnni(unpack_group_vnni(rows[2 * j + 1], g, bits), xv, xv2, two);
        u[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
        if (j % 2) /* per chunk: its 4-lane sum of outputs 2j - 2 .. 2j + 1 */
            v[j / 2] = _mm512_add_epi32(_mm512_unpacklo_epi64(u[j - 1], u[j]), _mm512_unpackhi_epi64(u[j - 1], u[j]));
    }
    /* chunks 0 + 1 are the first block, 2 + 3 the second */
    const __m512i x = _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i y = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(3, 1, 3, 1)));
    *s0 = _mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0));
    *s1 = _mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1));
}

/* In place: r[i][j] -> r[j][i] for 16 rows of 16 16-bit values, in 256-bit registers
 * (on AMD Zen 4 a 512-bit shuffle costs two of these). */
TARGET_VNNI static inline void transpose16_epi16(__m256i r[16]) {
    __m256i a[16], b[16];
    for (int i = 0; i < 8; i++) { /* 128-bit lane L of a[2i] / a[2i + 1]: rows 2i, 2i + 1 of columns 8L + 0..3 / 8L + 4..7 */
        a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int q = 0; q < 4; q++) { /* rows 4q .. 4q + 3; b[4q + k]: columns 8L + 2k, 8L + 2k + 1 */
        const __m256i *x = a + 4 * q;
        b[4 * q] = _mm256_unpacklo_epi32(x[0], x[2]);
        b[4 * q + 1] = _mm256_unpackhi_epi32(x[0], x[2]);
        b[4 * q + 2] = _mm256_unpacklo_epi32(x[1], x[3]);
        b[4 * q + 3] = _mm256_unpackhi_epi32(x[1], x[3]);
    }
    for (int h = 0; h < 2; h++) /* rows 8h .. 8h + 7; a[8h + c]: lane L holds them for column 8L + c */
        for (int k = 0; k < 4; k++) {
            a[8 * h + 2 * k] = _mm256_unpacklo_epi64(b[8 * h + k], b[8 * h + 4 + k]);
            a[8 * h + 2 * k + 1] = _mm256_unpackhi_epi64(b[8 * h + k], b[8 * h + 4 + k]);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm256_permute2x128_si256(a[c], a[8 + c], 0x20);
        r[8 + c] = _mm256_permute2x128_si256(a[c], a[8 + c], 0x31);
    }
}

/* The per-block scales (or mins) of outputs [n0, n0 + count) as floats, transposed to
 * [blocks][16] so one block's values of the pass's outputs are one vector (zeros past count).
 * The float16 values are transposed as they are and converted after, one vector per block. */
TARGET_VNNI static void transpose_scales_vnni(const uint16_t *s, int64_t n0, int64_t count, int64_t blocks, int r,
                                              float *out) {
    const int64_t per_row = blocks / r;
    for (int64_t k0 = 0; k0 < per_row; k0 += 16) {
        const int64_t nk = per_row - k0 < 16 ? per_row - k0 : 16;
        if (nk < 16 && per_row >= 2) { /* a tail: each row's values two at a time, gathered as dwords */
            const __mmask16 live = (__mmask16)((1u << count) - 1u);
            const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_epi32((int32_t)per_row));
            for (int64_t k = 0; k < nk; k += 2) {
                /* the pair (k, k + 1), or for an odd last value (k - 1, k): never past the row's end */
                const int64_t first = k + 1 < nk ? k : k - 1;
                const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at,
                                                                  (const void *)(s + n0 * per_row + k0 + first), 2);
                const __m512 lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
                const __m512 hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
                for (int64_t j = first; j < first + 2; j++) {
                    if (j < k) continue;
                    for (int rr = 0; rr < r; rr++) _mm512_storeu_ps(out + ((k0 + j) * r + rr) * 16, j == first ? lo : hi);
                }
            }
            continue;
        }
        const __mmask16 mask = (__mmask16)((1u << nk) - 1u);
        __m256i v[16];
        for (int j = 0; j < 16; j++)
            v[j] = j < count ? _mm256_maskz_loadu_epi16(mask, s + (n0 + j) * per_row + k0) : _mm256_setzero_si256();
        transpose16_epi16(v);
        for (int64_t k = 0; k < nk; k++) {
            const __m512 f = _mm512_cvtph_ps(v[k]);
            for (int rr = 0; rr < r; rr++) _mm512_storeu_ps(out + ((k0 + k) * r + rr) * 16, f);
        }
    }
}

/* Block b's scales (or mins) of a pass's 16 outputs: from its row-scale table t (float16,
 * [groups][16], see gemm_rows) where given, else from the pass's transposed floats w. */
TARGET_VNNI static inline __m512 vnni_scales(const float *w, const uint16_t *t, int64_t b, int r_shift) {
    return t ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + (b >> r_shift) * VNNI_ROW_COLS)))
             : _mm512_loadu_ps(w + b * VNNI_ROW_COLS);
}

/* Block b's float work of a per-row pass, in dot_portable's sequence for its 16 outputs: acc +
 * (isum - zero * xsum) * (dx * scale), then, with mins, + (dx * xsum) * min. */
TARGET_VNNI static inline __m512 vnni_block_out(__m512 acc, __m512i isum, int64_t b, int zero, const float *dx,
                                                const int32_t *xsum, const float *dw, const float *mw,
                                                const uint16_t *dt, const uint16_t *mt, int r_shift, int mins) {
    if (zero) isum = _mm512_add_epi32(isum, _mm512_set1_epi32(-zero * xsum[b]));
    const float dxb = dx[b];
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(dxb), vnni_scales(dw, dt, b, r_shift));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc);
    return mins ? _mm512_fmadd_ps(_mm512_set1_ps(dxb * (float)xsum[b]), vnni_scales(mw, mt, b, r_shift), acc) : acc;
}

/* Outputs [n0, n0 + count) (count <= 16) . one quantized activation row, in dot_portable's
 * float sequence with the 16 outputs in the lanes. dw / mw: transpose_scales_vnni of the pass.
 * next: the weights of a later pass, prefetched a share per group, or 0. */
TARGET_VNNI static inline __attribute__((always_inline)) void row_pass_vnni(
    const uint8_t *q, int64_t row_bytes, int64_t n0, int64_t count, int64_t Kp, int bits, int zero,
    const int8_t *xq, const int8_t *xq2, const float *dx, const int32_t *xsum, const float *dw, const float *mw,
    const uint16_t *dt, const uint16_t *mt, int r_shift, const uint8_t *next, float *out) {
    const uint8_t *rows[VNNI_ROW_COLS];
    for (int j = 0; j < VNNI_ROW_COLS; j++) rows[j] = q + (n0 + (j < count ? j : 0)) * row_bytes; /* spare lanes: any row */
    const int64_t prefetch_step = ((VNNI_ROW_COLS * row_bytes / (Kp / 64)) + 63) / 64 * 64;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < Kp / 64; g++) {
        if (next) /* the later pass's weights (contiguous), a share of its lines per group */
            for (int64_t off = g * prefetch_step; off < (g + 1) * prefetch_step; off += 64)
                _mm_prefetch((const char *)(next + off), _MM_HINT_T0);
        const __m512i xv = _mm512_loadu_si512((const void *)(xq + g * 64));
        const __m512i xv2 = xq2 ? _mm512_loadu_si512((const void *)(xq2 + g * 64)) : _mm512_setzero_si512();
        __m512i sums[2];
        block_sums_vnni(rows, g, bits, xv, xv2, xq2 != 0, &sums[0], &sums[1]);
        for (int h = 0; h < 2; h++)
            acc = vnni_block_out(acc, sums[h], 2 * g + h, zero, dx, xsum, dw, mw, dt, mt, r_shift, mw || mt);
    }
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << count) - 1u), acc);
}

/* row_pass_vnni compiled once per code width and level count, so the inner loops test neither. */
TARGET_VNNI static void row_pass_vnni_bits(const uint8_t *q, int64_t row_bytes, int64_t n0, int64_t count, int64_t Kp,
                                     int bits, int zero, const int8_t *xq, const int8_t *xq2, const int16_t *x16,
                                     const float *dx, const int32_t *xsum, const float *dw, const float *mw,
                                     const uint16_t *dt, const uint16_t *mt, int r_shift, const uint8_t *next,
                                     float *out) {
    (void)x16;
#define ROW_PASS_VNNI(bits_, xq2_) \
    row_pass_vnni(q, row_bytes, n0, count, Kp, bits_, zero, xq, xq2_, dx, xsum, dw, mw, dt, mt, r_shift, next, out)
    if (bits == 4 && xq2) ROW_PASS_VNNI(4, xq2);
    else if (bits == 4) ROW_PASS_VNNI(4, 0);
    else if (xq2) ROW_PASS_VNNI(8, xq2);
    else ROW_PASS_VNNI(8, 0);
#undef ROW_PASS_VNNI
}

static const RowKernel VNNI_ROWS = {transpose_scales_vnni, row_pass_vnni_bits, VNNI_ROW_COLS, ROW_PREFETCH_PASSES, NULL,
                                    0, 0, 1};

/* Lanes 0-7: a's two halves (lanes 0-7 and 8-15) added; lanes 8-15: b's. */
TARGET_VNNI static inline __m512i fold_passes_vnni(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xee));
}

/* The lane layout's kernel on AVX-512 VNNI: two passes of the layout (outputs [n0, n0 + 16);
 * count 8: one) . one activation row, in dot_portable's float sequence. A 64-byte load of a
 * pass's block holds two chunks: lanes 0-7 chunk 2h of its 8 outputs, lanes 8-15 chunk 2h + 1.
 * vpdpbusd multiplies each nibble half by a vector whose halves broadcast the two chunks'
 * activation dwords: one vpermd per block and level puts the block's dwords 0, 1, 4, 5 in each
 * 128-bit lane of the low half and 2, 3, 6, 7 in the high half, and one in-lane vpshufd then
 * picks each operand. Each lane sums 16 products of one output per block, and one fold of the
 * two passes' halves (lanes 0-7 + 8-15) gives the 16 outputs' exact block sums in order: the
 * integers of row_pass_vnni, with no reduction tree and no unpack beyond the nibble masks. */
TARGET_VNNI static inline __attribute__((always_inline)) void lane_pass_vnni(
    const uint8_t *pa, const uint8_t *pb, int64_t blocks, int zero, const int8_t *xq, const int8_t *xq2,
    const float *dx, const int32_t *xsum, const float *dw, const float *mw, const uint16_t *dt, const uint16_t *mt,
    int r_shift, const int two, const int mins, const uint8_t *next, int64_t count, float *out) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i spread = _mm512_setr_epi32(0, 1, 4, 5, 0, 1, 4, 5, 2, 3, 6, 7, 2, 3, 6, 7);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (next) { /* the later pair's block b: 128 bytes of each of its passes */
            _mm_prefetch((const char *)(next + b * 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + b * 128 + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + (blocks + b) * 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + (blocks + b) * 128 + 64), _MM_HINT_T0);
        }
        const __m512i x1 = _mm512_permutexvar_epi32(
            spread, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xq + 32 * b))));
        const __m512i x2 = two ? _mm512_permutexvar_epi32(
                                     spread, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xq2 + 32 * b))))
                               : x1;
        __m512i a1 = _mm512_setzero_si512(), b1 = a1, a2 = a1, b2 = a1;
        for (int h = 0; h < 2; h++) {
            const __m512i pka = _mm512_loadu_si512((const void *)(pa + b * 128 + 64 * h));
            const __m512i pkb = _mm512_loadu_si512((const void *)(pb + b * 128 + 64 * h));
            const __m512i loa = _mm512_and_si512(pka, low4), hia = _mm512_and_si512(_mm512_srli_epi16(pka, 4), low4);
            const __m512i lob = _mm512_and_si512(pkb, low4), hib = _mm512_and_si512(_mm512_srli_epi16(pkb, 4), low4);
            /* dword 2h of each 128-bit lane for the low nibbles, 2h + 1 for the high ones */
            const __m512i xlo = _mm512_shuffle_epi32(x1, h ? _MM_PERM_CCCC : _MM_PERM_AAAA);
            const __m512i xhi = _mm512_shuffle_epi32(x1, h ? _MM_PERM_DDDD : _MM_PERM_BBBB);
            a1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a1, loa, xlo), hia, xhi);
            b1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(b1, lob, xlo), hib, xhi);
            if (two) {
                const __m512i xlo2 = _mm512_shuffle_epi32(x2, h ? _MM_PERM_CCCC : _MM_PERM_AAAA);
                const __m512i xhi2 = _mm512_shuffle_epi32(x2, h ? _MM_PERM_DDDD : _MM_PERM_BBBB);
                a2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a2, loa, xlo2), hia, xhi2);
                b2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(b2, lob, xlo2), hib, xhi2);
            }
        }
        /* lanes 0-7: pass a's block sums, 8-15: pass b's */
        __m512i isum = fold_passes_vnni(a1, b1);
        if (two) isum = _mm512_add_epi32(_mm512_slli_epi32(isum, 8), fold_passes_vnni(a2, b2));
        acc = vnni_block_out(acc, isum, b, zero, dx, xsum, dw, mw, dt, mt, r_shift, mins);
    }
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << count) - 1u), acc);
}

/* lane_pass_vnni as a RowPass (bits is 4; count 16, or 8 for a matrix's last, odd pass),
 * compiled per level count and mins. */
TARGET_VNNI static void lane_pass_vnni_bits(const uint8_t *q, int64_t row_bytes, int64_t n0, int64_t count, int64_t Kp,
                                            int bits, int zero, const int8_t *xq, const int8_t *xq2, const int16_t *x16,
                                            const float *dx, const int32_t *xsum, const float *dw, const float *mw,
                                            const uint16_t *dt, const uint16_t *mt, int r_shift, const uint8_t *next,
                                            float *out) {
    const uint8_t *pa = q + n0 * row_bytes, *pb = count > LANE_COLS ? pa + LANE_COLS * row_bytes : pa;
    const int64_t blocks = Kp / 32;
    (void)bits, (void)x16;
#define LANE_PASS_VNNI(two_, mins_) \
    lane_pass_vnni(pa, pb, blocks, zero, xq, xq2, dx, xsum, dw, mw, dt, mt, r_shift, two_, mins_, next, count, out)
    const int mins = mw || mt;
    if (xq2 && mins) LANE_PASS_VNNI(1, 1);
    else if (xq2) LANE_PASS_VNNI(1, 0);
    else if (mins) LANE_PASS_VNNI(0, 1);
    else LANE_PASS_VNNI(0, 0);
#undef LANE_PASS_VNNI
}

static const RowKernel VNNI_LANES = {transpose_scales_vnni, lane_pass_vnni_bits, VNNI_ROW_COLS, ROW_PREFETCH_PASSES,
                                     NULL, 0, 0, 1};
/* ------------------------------------------------------------ many rows: the tiled kernels */

#define VNNI_TILE_ROWS 16 /* activation rows per zmm: one int32 lane each */
#define VNNI_TILE_COLS 8  /* outputs per register tile: 8 int32 + 8 float accumulators */
#define AVX2_TILE_ROWS 8  /* per ymm */
#define AVX2_TILE_COLS 4  /* 4 int16 + 4 float accumulators of 16 ymm registers */
#define MAX_TILE_OUT (VNNI_TILE_ROWS * VNNI_TILE_COLS)

/* The activations of one call in the tiled kernels' order. Tile t holds rows
 * [tile_rows * t, tile_rows * (t + 1)); lanes of rows past the last are zero
 * (and never stored). */
typedef struct {
    int64_t tile_rows, num_tiles, num_blocks;
    int8_t *x;   /* [tiles][Kp / 4][tile_rows][4]: lane i of quad l is row i's xq[4l .. 4l + 4) */
    int8_t *x2;  /* the second level's codes in the same order, or NULL for one level */
    float *dx;   /* [tiles][blocks][tile_rows] the block's activation scale */
    float *xs;   /* [tiles][blocks][tile_rows] dx * xsum: the min term's activation side */
    int32_t *zc; /* [tiles][blocks][tile_rows] -zero * xsum: the zero-point correction */
    int16_t *x16; /* wide kernels instead of x and x2: [tiles][Kp / 2][tile_rows][2] each row's
                     activation as one int16, (first level << 8) + second (or the one level) */
} RowTiles;

static int row_tiles_alloc(RowTiles *t, int64_t tile_rows, int have_x2, int wide, int64_t rows, int64_t Kp) {
    const int64_t blocks = Kp / 32, tiles = (rows + tile_rows - 1) / tile_rows;
    t->tile_rows = tile_rows;
    t->num_tiles = tiles;
    t->num_blocks = blocks;
    t->x = wide ? 0 : calloc((size_t)(tiles * tile_rows * Kp), 1);
    t->x2 = have_x2 && !wide ? calloc((size_t)(tiles * tile_rows * Kp), 1) : 0;
    t->x16 = wide ? calloc((size_t)(tiles * tile_rows * Kp), sizeof(int16_t)) : 0;
    t->dx = calloc((size_t)(tiles * blocks * tile_rows), sizeof(float));
    t->xs = calloc((size_t)(tiles * blocks * tile_rows), sizeof(float));
    t->zc = calloc((size_t)(tiles * blocks * tile_rows), sizeof(int32_t));
    return (wide ? t->x16 != 0 : t->x && (!have_x2 || t->x2)) && t->dx && t->xs && t->zc;
}

/* Rows [i0, i1) of the activations into t's order (row_tiles_alloc'ed). */
static void row_tiles_fill(RowTiles *t, const int8_t *xq, const int8_t *xq2, const float *dx, const int32_t *xsum,
                           int64_t i0, int64_t i1, int64_t Kp, int32_t zero) {
    const int64_t tile_rows = t->tile_rows, blocks = Kp / 32, quads = Kp / 4;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t tile = i / tile_rows, lane = i % tile_rows;
        const int64_t at = tile * tile_rows * Kp + lane * 4;
        if (t->x16) { /* pair l of the row: lane `lane` of pair l's tile_rows x 2 */
            int16_t *dst = t->x16 + tile * tile_rows * Kp + lane * 2;
            const int8_t *a = xq + i * Kp, *b = xq2 ? xq2 + i * Kp : 0;
            for (int64_t k = 0; k < Kp; k += 2) {
                dst[k * tile_rows] = (int16_t)(b ? a[k] * 256 + b[k] : a[k]);
                dst[k * tile_rows + 1] = (int16_t)(b ? a[k + 1] * 256 + b[k + 1] : a[k + 1]);
            }
        }
        for (int64_t l = 0; t->x && l < quads; l++) memcpy(t->x + at + l * tile_rows * 4, xq + i * Kp + 4 * l, 4);
        for (int64_t l = 0; t->x2 && l < quads; l++) memcpy(t->x2 + at + l * tile_rows * 4, xq2 + i * Kp + 4 * l, 4);
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = (tile * blocks + b) * tile_rows + lane;
            const int32_t sum = xsum[i * blocks + b];
            t->dx[at] = dx[i * blocks + b];
            t->xs[at] = dx[i * blocks + b] * (float)sum;
            t->zc[at] = -zero * sum;
        }
    }
}

static void row_tiles_free(RowTiles *t) {
    free(t->x16);
    free(t->x);
    free(t->x2);
    free(t->dx);
    free(t->xs);
    free(t->zc);
}

/* out [blocks] float: block b's value of a row of blocks / r float16 scales (no row: zeros). */
__attribute__((target("avx2,fma,f16c"))) static void unpack_scales(const uint16_t *row, int64_t blocks, int r,
                                                                   float *out) {
    if (!row) {
        memset(out, 0, (size_t)blocks * sizeof(float));
        return;
    }
    const int64_t num = blocks / r;
    int64_t j = 0;
    for (; j + 8 <= num; j += 8)
        _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + j))));
    for (; j < num; j++) out[j] = _cvtsh_ss(row[j]);
    for (int64_t b = blocks - 1; r > 1 && b >= 0; b--) out[b] = out[b / r]; /* in place: b / r <= b */
}

/* Outputs [n0, n0 + count) (count <= cols) unpacked into a tile's scratch: codes [cols][Kp]
 * one byte per weight (codes NULL: not these), dw / mw [cols][blocks] float per-block scales /
 * mins; outputs past count are zero. */
__attribute__((target("avx2,fma,f16c"))) static void unpack_outputs(const uint8_t *q, const uint16_t *d,
                                                                    const uint16_t *m, int64_t n0, int64_t count,
                                                                    int64_t cols, int64_t Kp, int bits, int r,
                                                                    uint8_t *codes, float *dw, float *mw) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const int64_t row_bytes = bits == 4 ? Kp / 2 : Kp, scales_per_row = Kp / 32 / r, blocks = Kp / 32;
    for (int64_t c = 0; c < cols; c++) {
        uint8_t *dst = codes ? codes + c * Kp : 0;
        if (!codes) {
            /* the scales only (a lane-layout matrix's codes come from unpack_lane_outputs) */
        } else if (c >= count) {
            memset(dst, 0, (size_t)Kp);
        } else if (bits == 8) {
            memcpy(dst, q + (n0 + c) * row_bytes, (size_t)Kp);
        } else {
            const uint8_t *src = q + (n0 + c) * row_bytes;
            for (int64_t g = 0; g < Kp / 64; g++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(src + g * 32));
                _mm256_storeu_si256((__m256i *)(dst + g * 64), _mm256_and_si256(packed, low4));
                _mm256_storeu_si256((__m256i *)(dst + g * 64 + 32),
                                    _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4));
            }
        }
        unpack_scales(c < count ? d + (n0 + c) * scales_per_row : 0, blocks, r, dw + c * blocks);
        if (mw) unpack_scales(c < count ? m + (n0 + c) * scales_per_row : 0, blocks, r, mw + c * blocks);
    }
}

/* unpack_outputs for the wide kernel (8-bit codes, zero 128): codes [cols][Kp] int16 q - 128;
 * outputs past count are zero. */
__attribute__((target("avx2,fma,f16c"))) static void unpack_outputs16(const uint8_t *q, const uint16_t *d,
                                                                      const uint16_t *m, int64_t n0, int64_t count,
                                                                      int64_t cols, int64_t Kp, int r, int16_t *codes,
                                                                      float *dw, float *mw) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const int64_t scales_per_row = Kp / 32 / r, blocks = Kp / 32;
    for (int64_t c = 0; c < cols; c++) {
        int16_t *dst = codes + c * Kp;
        const uint8_t *src = q + (n0 + c) * Kp;
        if (c >= count) {
            memset(dst, 0, (size_t)Kp * sizeof(int16_t));
        } else {
            for (int64_t k = 0; k < Kp; k += 32) {
                const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(src + k)), flip);
                _mm256_storeu_si256((__m256i *)(dst + k), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)));
                _mm256_storeu_si256((__m256i *)(dst + k + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)));
            }
        }
        unpack_scales(c < count ? d + (n0 + c) * scales_per_row : 0, blocks, r, dw + c * blocks);
        if (mw) unpack_scales(c < count ? m + (n0 + c) * scales_per_row : 0, blocks, r, mw + c * blocks);
    }
}

/* out[c * tile_rows + i] = output c of the tile . activation row i of tile t, for the
 * outputs unpacked by unpack_outputs. A kernel is one TileShape: */
typedef void (*TileKernel)(const RowTiles *rt, int64_t t, const uint8_t *codes, const float *dw, const float *mw,
                           int64_t Kp, int zero, float *out);

/* AVX-512 VNNI, 16 rows x 8 outputs, any codes; two: the activations have two levels
 * (rt->x2), whose sums are kept apart per block and joined as (first << 8) + second. */
TARGET_VNNI static inline __attribute__((always_inline)) void tile_vnni_levels(
    const RowTiles *rt, int64_t t, const uint8_t *codes, const float *dw, const float *mw, int64_t Kp, int zero,
    int two, float *out) {
    const int64_t blocks = rt->num_blocks;
    const int8_t *x = rt->x + t * VNNI_TILE_ROWS * Kp, *x2 = two ? rt->x2 + t * VNNI_TILE_ROWS * Kp : 0;
    __m512 acc[VNNI_TILE_COLS];
    _Pragma("GCC unroll 8")
    for (int c = 0; c < VNNI_TILE_COLS; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = (t * blocks + b) * VNNI_TILE_ROWS;
        const __m512i init = zero ? _mm512_loadu_si512((const void *)(rt->zc + at)) : _mm512_setzero_si512();
        __m512i dot[VNNI_TILE_COLS], dot2[VNNI_TILE_COLS];
        _Pragma("GCC unroll 8")
        for (int c = 0; c < VNNI_TILE_COLS; c++) {
            dot[c] = two ? _mm512_setzero_si512() : init;
            dot2[c] = init;
        }
        /* fully unrolled: with a loop, GCC moves the 16 integer sums between registers every step */
        const uint8_t *cb = codes + 32 * b;
        _Pragma("GCC unroll 8")
        for (int s = 0; s < 8; s++) {
            const int64_t off = (8 * b + s) * VNNI_TILE_ROWS * 4;
            const __m512i xv = _mm512_loadu_si512((const void *)(x + off));
            const __m512i xv2 = two ? _mm512_loadu_si512((const void *)(x2 + off)) : _mm512_setzero_si512();
            _Pragma("GCC unroll 8")
            for (int c = 0; c < VNNI_TILE_COLS; c++) {
                int32_t w4;
                memcpy(&w4, cb + c * Kp + 4 * s, 4);
                const __m512i w = _mm512_set1_epi32(w4);
                dot[c] = _mm512_dpbusd_epi32(dot[c], w, xv);
                if (two) dot2[c] = _mm512_dpbusd_epi32(dot2[c], w, xv2);
            }
        }
        const __m512 dxv = _mm512_loadu_ps(rt->dx + at);
        const __m512 xsv = mw ? _mm512_loadu_ps(rt->xs + at) : _mm512_setzero_ps();
        _Pragma("GCC unroll 8")
        for (int c = 0; c < VNNI_TILE_COLS; c++) {
            const __m512i d = two ? _mm512_add_epi32(_mm512_slli_epi32(dot[c], 8), dot2[c]) : dot[c];
            const __m512 scale = _mm512_mul_ps(dxv, _mm512_set1_ps(dw[c * blocks + b]));
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[c]);
            if (mw) acc[c] = _mm512_fmadd_ps(xsv, _mm512_set1_ps(mw[c * blocks + b]), acc[c]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int c = 0; c < VNNI_TILE_COLS; c++) _mm512_storeu_ps(out + c * VNNI_TILE_ROWS, acc[c]);
}

TARGET_VNNI static void tile_vnni(const RowTiles *rt, int64_t t, const uint8_t *codes, const float *dw,
                                  const float *mw, int64_t Kp, int zero, float *out) {
    if (rt->x2) tile_vnni_levels(rt, t, codes, dw, mw, Kp, zero, 1, out);
    else tile_vnni_levels(rt, t, codes, dw, mw, Kp, zero, 0, out);
}

/* ------------------------------------------------------------ AVX2 + FMA path */

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

/* The 8 lane sums (4 weights each) of one block: sum q * x for 4-bit codes (their zero point
 * is applied to the block sum), sum (q - 128) * x for 8-bit ones, whose zero must be 128:
 * q - 128 is a signed byte, |q - 128| <= 128. */
TARGET_AVX2 static inline __m256i block_lanes_avx2(__m256i w, __m256i x, int bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 8) {
        __m256i sw = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(sw), _mm256_sign_epi8(x, sw)), ones);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones); /* 2 * 15 * 127: no saturation */
}

#define AVX2_ROW_COLS 8 /* outputs per per-row pass: one int32 / float lane each */
#ifndef AVX2_ROW_PREFETCH_PASSES
#define AVX2_ROW_PREFETCH_PASSES 4 /* the same 32 outputs ahead as the VNNI kernel's 2 passes of 16 */
#endif

/* Half h (one 32-block) of group g of a weight row, one byte per weight. */
TARGET_AVX2 static inline __m256i unpack_block_avx2(const uint8_t *qrow, int64_t g, int h, int bits) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(qrow + g * 64 + 32 * h));
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(qrow + g * 32));
    return _mm256_and_si256(h ? _mm256_srli_epi16(packed, 4) : packed, _mm256_set1_epi8(0x0f));
}

/* block_lanes_avx2 of one level, or with two (x2: the second level) (w . x << 8) + w . x2 per lane. */
TARGET_AVX2 static inline __m256i levels_lanes_avx2(__m256i w, __m256i x, __m256i x2, int two, int bits) {
    const __m256i a = block_lanes_avx2(w, x, bits);
    return two ? _mm256_add_epi32(_mm256_slli_epi32(a, 8), block_lanes_avx2(w, x2, bits)) : a;
}

/* Outputs 0-7's sums from pair[p], the hadd of outputs 2p and 2p + 1's lanes: per 128-bit half
 * the 4-lane sums of outputs 0-3 and 4-7, then the halves added. */
TARGET_AVX2 static inline __m256i output_sums_avx2(const __m256i pair[4]) {
    const __m256i k0 = _mm256_hadd_epi32(pair[0], pair[1]), k1 = _mm256_hadd_epi32(pair[2], pair[3]);
    return _mm256_add_epi32(_mm256_permute2x128_si256(k0, k1, 0x20), _mm256_permute2x128_si256(k0, k1, 0x31));
}

/* Block h of group g of outputs rows[0..8) . x (and x2) -> [8 outputs] each one's exact integer sum.
 * Pairs are reduced as soon as they exist, so few registers are live (AVX2 has 16). */
TARGET_AVX2 static inline __m256i block_sums_avx2(const uint8_t *const rows[AVX2_ROW_COLS], int64_t g, int h, int bits,
                                                  __m256i x, __m256i x2, int two) {
    __m256i pair[4];
    for (int p = 0; p < 4; p++)
        pair[p] = _mm256_hadd_epi32(levels_lanes_avx2(unpack_block_avx2(rows[2 * p], g, h, bits), x, x2, two, bits),
                                    levels_lanes_avx2(unpack_block_avx2(rows[2 * p + 1], g, h, bits), x, x2, two, bits));
    return output_sums_avx2(pair);
}

/* In place: v[r][c] -> v[c][r] for 8 rows of 8 floats. */
TARGET_AVX2 static inline void transpose8_avx2(__m256 v[8]) {
    __m256 t[8], u[8];
    for (int p = 0; p < 4; p++) {
        t[2 * p] = _mm256_unpacklo_ps(v[2 * p], v[2 * p + 1]);
        t[2 * p + 1] = _mm256_unpackhi_ps(v[2 * p], v[2 * p + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + k], 128-bit half L: rows 4i .. 4i + 3 of column 4L + k */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        v[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

/* Outputs [n0, n0 + count) of a lane-layout matrix (all in one pass) as codes [count][Kp], one
 * byte per weight in order (gemm_tiled unpacks whole passes, which its groups of outputs then
 * share): per block, the 4 chunks' low and high nibbles are the rows of an
 * 8 x 8 matrix of dwords (row 2 c + h: weights 8 c + 4 h .. + 3 of the 8 outputs), whose
 * transpose has output j's 32 weights in row j. */
TARGET_AVX2 static void unpack_lane_outputs(const uint8_t *q, int64_t n0, int64_t count, int64_t Kp, uint8_t *codes) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const int64_t first = n0 % LANE_COLS, blocks = Kp / 32;
    const uint8_t *pass = q + (n0 - first) * (Kp / 2);
    for (int64_t b = 0; b < blocks; b++) {
        __m256 v[8];
        for (int c = 0; c < 4; c++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(pass + b * 128 + 32 * c));
            v[2 * c] = _mm256_castsi256_ps(_mm256_and_si256(packed, low4));
            v[2 * c + 1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low4));
        }
        transpose8_avx2(v);
        for (int64_t c = 0; c < count; c++) _mm256_storeu_ps((float *)(codes + c * Kp + 32 * b), v[first + c]);
    }
}

/* Columns [base, base + 8) of the scales of rows n0 .. n0 + 7 (row stride per_row), all inside
 * the rows, as floats transposed: v[k] holds column base + k of the 8 rows. */
TARGET_AVX2 static inline __attribute__((always_inline)) void scale_columns_avx2(const uint16_t *s, int64_t n0,
                                                                                 int64_t per_row, int64_t base,
                                                                                 __m256 v[8]) {
    for (int j = 0; j < 8; j++) v[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + (n0 + j) * per_row + base)));
    transpose8_avx2(v);
}

/* The per-block scales (or mins) of outputs [n0, n0 + count) as floats, transposed to
 * [blocks][8] so one block's values of the pass's outputs are one vector (zeros past count). */
TARGET_AVX2 static void transpose_scales_avx2(const uint16_t *s, int64_t n0, int64_t count, int64_t blocks, int r,
                                              float *out) {
    const int64_t per_row = blocks / r;
    if (count == 8 && r == 1 && per_row >= 8) {
        /* every pass but a matrix's last, group 32: whole chunks, and a short last chunk as the
           row's last 8 columns (their first ones written again with the same values), every
           vector kept in a register. (A short chunk copied through the stack cost a
           store-forwarding stall per row, and a variable column index spilled every vector:
           together a third of a batch-1 step's matmul time on Zen 3.) */
        int64_t k0 = 0;
        for (; k0 + 8 <= per_row; k0 += 8) {
            __m256 v[8];
            scale_columns_avx2(s, n0, per_row, k0, v);
            for (int k = 0; k < 8; k++) _mm256_storeu_ps(out + (k0 + k) * 8, v[k]);
        }
        if (k0 < per_row) {
            __m256 v[8];
            scale_columns_avx2(s, n0, per_row, per_row - 8, v);
            for (int k = 0; k < 8; k++) _mm256_storeu_ps(out + (per_row - 8 + k) * 8, v[k]);
        }
        return;
    }
    for (int64_t k0 = 0; k0 < per_row; k0 += 8) { /* any count, group and width */
        const int64_t nk = per_row - k0 < 8 ? per_row - k0 : 8;
        __m256 v[8];
        for (int j = 0; j < 8; j++) {
            const uint16_t *src = s + (n0 + j) * per_row + k0;
            if (j < count && nk == 8) {
                v[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
                continue;
            }
            uint16_t h[8] = {0};
            for (int64_t k = 0; j < count && k < nk; k++) h[k] = src[k];
            v[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        }
        transpose8_avx2(v);
        for (int64_t k = 0; k < nk; k++)
            for (int rr = 0; rr < r; rr++) _mm256_storeu_ps(out + ((k0 + k) * r + rr) * 8, v[k]);
    }
}

/* One group g (64 weights: blocks 2g and 2g + 1) of one output's codes . joined activations x16
 * (int16, 256 q1 + q2, in join_levels_avx2's order for the code width): the two blocks' 8 lane sums,
 * one vpmaddwd per 2 inputs of both levels (the byte kernel takes two vpmaddubsw and two vpmaddwd
 * per 4). 4-bit: the group's 32 bytes widened to 16 bits once for both blocks (byte i: weight i
 * low, 32 + i high), x16 in order. 8-bit: each run of 32 codes read as int16 lanes (lane j: codes
 * 2j and 2j + 1), less 128 (their zero) and sign-extended from the lane's low and high bytes with
 * shifts, no shuffles (15% faster than widening with vpmovsxbw on Zen 3), against x16's even codes
 * then its odd ones. Exact: products at most 128 x 32,639, a lane sums 4. */
TARGET_AVX2 static inline __attribute__((always_inline)) void group_lanes_x16(const uint8_t *qrow, int64_t g, int bits,
                                                                              const int16_t *x16, __m256i *l0,
                                                                              __m256i *l1) {
    const __m256i *x = (const __m256i *)(x16 + 64 * g);
    __m256i w[4]; /* 4-bit: weights 0-15, 16-31, 32-47, 48-63 of the group; 8-bit: (0, 2, .., 30), (1, .., 31), (32, .., 62), (33, .., 63) */
    if (bits == 4) {
        const __m128i *p = (const __m128i *)(qrow + g * 32);
        const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128(p)), b = _mm256_cvtepu8_epi16(_mm_loadu_si128(p + 1));
        const __m256i low4 = _mm256_set1_epi16(0x0f);
        w[0] = _mm256_and_si256(a, low4), w[1] = _mm256_and_si256(b, low4);
        w[2] = _mm256_srli_epi16(a, 4), w[3] = _mm256_srli_epi16(b, 4);
    } else {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        const __m256i a = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qrow + g * 64)), flip);
        const __m256i b = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qrow + g * 64 + 32)), flip);
        w[0] = _mm256_srai_epi16(_mm256_slli_epi16(a, 8), 8), w[1] = _mm256_srai_epi16(a, 8);
        w[2] = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), w[3] = _mm256_srai_epi16(b, 8);
    }
    *l0 = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(x)), _mm256_madd_epi16(w[1], _mm256_loadu_si256(x + 1)));
    *l1 = _mm256_add_epi32(_mm256_madd_epi16(w[2], _mm256_loadu_si256(x + 2)), _mm256_madd_epi16(w[3], _mm256_loadu_si256(x + 3)));
}

/* Both blocks of group g of outputs rows[0..8) . joined activations x16 -> sums[2] [8 outputs]. */
TARGET_AVX2 static inline __attribute__((always_inline)) void group_sums_x16_avx2(
    const uint8_t *const rows[AVX2_ROW_COLS], int64_t g, int bits, const int16_t *x16, __m256i sums[2]) {
    __m256i pair0[4], pair1[4];
    for (int p = 0; p < 4; p++) {
        __m256i a0, a1, b0, b1;
        group_lanes_x16(rows[2 * p], g, bits, x16, &a0, &a1);
        group_lanes_x16(rows[2 * p + 1], g, bits, x16, &b0, &b1);
        pair0[p] = _mm256_hadd_epi32(a0, b0);
        pair1[p] = _mm256_hadd_epi32(a1, b1);
    }
    sums[0] = output_sums_avx2(pair0);
    sums[1] = output_sums_avx2(pair1);
}

/* Outputs [n0, n0 + count) (count <= 8) . one quantized activation row, in dot_portable's
 * float sequence with the 8 outputs in the lanes (see row_pass_vnni). 8-bit codes need zero 128. */
TARGET_AVX2 static inline __attribute__((always_inline)) void row_pass_avx2(
    const uint8_t *q, int64_t row_bytes, int64_t n0, int64_t count, int64_t Kp, int bits, int zero,
    const int8_t *xq, const int8_t *xq2, const int16_t *x16, const int joined, const float *dx, const int32_t *xsum,
    const float *dw, const float *mw, const uint16_t *dt, const uint16_t *mt, int r_shift, const int table,
    const uint8_t *next, float *out) {
    const uint8_t *rows[AVX2_ROW_COLS];  /* spare lanes: any row */
    for (int j = 0; j < AVX2_ROW_COLS; j++) rows[j] = q + (n0 + (j < count ? j : 0)) * row_bytes;
    const int64_t prefetch_step = ((AVX2_ROW_COLS * row_bytes / (Kp / 64)) + 63) / 64 * 64;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < Kp / 64; g++) {
        if (next) /* the later pass's weights (contiguous), a share of its lines per group */
            for (int64_t off = g * prefetch_step; off < (g + 1) * prefetch_step; off += 64)
                _mm_prefetch((const char *)(next + off), _MM_HINT_T0);
        __m256i sums[2];
        if (joined) {
            group_sums_x16_avx2(rows, g, bits, x16, sums);
        } else {
            for (int h = 0; h < 2; h++) {
                const int64_t b = 2 * g + h;
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
                const __m256i x2 = xq2 ? _mm256_loadu_si256((const __m256i *)(xq2 + 32 * b)) : _mm256_setzero_si256();
                sums[h] = block_sums_avx2(rows, g, h, bits, x, x2, xq2 != 0);
            }
        }
        for (int h = 0; h < 2; h++) {
            const int64_t b = 2 * g + h;
            __m256i isum = sums[h];
            if (zero && bits == 4) isum = _mm256_add_epi32(isum, _mm256_set1_epi32(-zero * xsum[b]));
            const float dxb = dx[b];
            /* the block's scales (and mins) of the 8 outputs: the pass's table row, or its transpose */
            const __m256 dwb = table ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + (b >> r_shift) * AVX2_ROW_COLS)))
                                     : _mm256_loadu_ps(dw + b * AVX2_ROW_COLS);
            const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(dxb), dwb);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
            if (table ? mt != 0 : mw != 0) {
                const __m256 mwb = table ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + (b >> r_shift) * AVX2_ROW_COLS)))
                                         : _mm256_loadu_ps(mw + b * AVX2_ROW_COLS);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dxb * (float)xsum[b]), mwb, acc);
            }
        }
    }
    float lanes[AVX2_ROW_COLS];
    _mm256_storeu_ps(lanes, acc);
    memcpy(out, lanes, (size_t)count * sizeof(float));
}

/* row_pass_avx2 compiled once per code width, level count and scale source, so the inner
 * loops test none of them (table: a literal at both calls below). */
TARGET_AVX2 static inline __attribute__((always_inline)) void row_pass_avx2_levels(
    const uint8_t *q, int64_t row_bytes, int64_t n0, int64_t count, int64_t Kp, int bits, int zero,
    const int8_t *xq, const int8_t *xq2, const int16_t *x16, const float *dx, const int32_t *xsum, const float *dw,
    const float *mw, const uint16_t *dt, const uint16_t *mt, int r_shift, const int table, const uint8_t *next,
    float *out) {
#define AVX2_ROW_PASS(bits_, xq_, xq2_, x16_, joined_)                                                         \
    row_pass_avx2(q, row_bytes, n0, count, Kp, bits_, zero, xq_, xq2_, x16_, joined_, dx, xsum, dw, mw, dt, mt, \
                  r_shift, table, next, out)
    /* two levels come joined (gemm_rows, AVX2_ROWS.join); one level as bytes */
    if (bits == 4 && x16) AVX2_ROW_PASS(4, 0, 0, x16, 1);
    else if (x16) AVX2_ROW_PASS(8, 0, 0, x16, 1);
    else if (bits == 4 && xq2) AVX2_ROW_PASS(4, xq, xq2, 0, 0);
    else if (bits == 4) AVX2_ROW_PASS(4, xq, 0, 0, 0);
    else if (xq2) AVX2_ROW_PASS(8, xq, xq2, 0, 0);
    else AVX2_ROW_PASS(8, xq, 0, 0, 0);
#undef AVX2_ROW_PASS
}

TARGET_AVX2 static void row_pass_avx2_bits(const uint8_t *q, int64_t row_bytes, int64_t n0, int64_t count, int64_t Kp,
                                     int bits, int zero, const int8_t *xq, const int8_t *xq2, const int16_t *x16,
                                     const float *dx, const int32_t *xsum, const float *dw, const float *mw,
                                     const uint16_t *dt, const uint16_t *mt, int r_shift, const uint8_t *next,
                                     float *out) {
    if (dt)
        row_pass_avx2_levels(q, row_bytes, n0, count, Kp, bits, zero, xq, xq2, x16, dx, xsum, dw, mw, dt, mt, r_shift,
                             1, next, out);
    else
        row_pass_avx2_levels(q, row_bytes, n0, count, Kp, bits, zero, xq, xq2, x16, dx, xsum, dw, mw, dt, mt, r_shift,
                             0, next, out);
}

/* x16 = 256 xq + xq2 for n (a multiple of 32: rows x Kp) codes of two levels, exact in int16, in the
 * order group_lanes_x16 reads for the code width: in order for 4-bit codes; for 8-bit ones each run of
 * 32 as its 16 even-indexed codes, then its 16 odd ones. */
TARGET_AVX2 static void join_levels_avx2(const int8_t *xq, const int8_t *xq2, int64_t n, int bits, int16_t *x16) {
    if (bits == 4) {
        for (int64_t i = 0; i < n; i += 16) {
            const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq + i)));
            const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq2 + i)));
            _mm256_storeu_si256((__m256i *)(x16 + i), _mm256_add_epi16(_mm256_slli_epi16(a, 8), b));
        }
        return;
    }
    const __m256i high = _mm256_set1_epi16((short)0xff00);
    for (int64_t i = 0; i < n; i += 32) { /* a code pair as one int16 lane: the even code its low byte */
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + i)), b = _mm256_loadu_si256((const __m256i *)(xq2 + i));
        _mm256_storeu_si256((__m256i *)(x16 + i),
                            _mm256_add_epi16(_mm256_slli_epi16(a, 8), _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8)));
        _mm256_storeu_si256((__m256i *)(x16 + i + 16), _mm256_add_epi16(_mm256_and_si256(a, high), _mm256_srai_epi16(b, 8)));
    }
}

static const RowKernel AVX2_ROWS = {transpose_scales_avx2, row_pass_avx2_bits, AVX2_ROW_COLS, AVX2_ROW_PREFETCH_PASSES,
                                    join_levels_avx2, 1, 0, 1};

/* The lane layout's pass (4-bit codes; see the top of the file): outputs [n0, n0 + 8) . one
 * activation row, in dot_portable's float sequence. Per block, 4 loads of 32 bytes give the low
 * and high nibbles of 8 outputs x 8 weights; vpmaddubsw multiplies each by one broadcast dword
 * of the level's activation bytes, and the pair sums add up in int16 (8 per block, at most
 * 8 x 2 x 15 x 128 = 30,720: exact); vpmaddwd by 256 (first level) and by 1 (second) then
 * gives each output's block sum in its int32 lane: the integers of the row kernel above, with
 * no reduction across lanes. The broadcast dwords come from xb ([Kp / 4][levels] vectors,
 * broadcast_codes_avx2, made once per call), so vpmaddubsw reads its operand from memory. */
TARGET_AVX2 static inline __attribute__((always_inline)) void lane_pass_avx2(
    const uint8_t *pass, int64_t blocks, int zero, const int8_t *xq, const int8_t *xq2, const float *dx,
    const int32_t *xsum, const __m256i *xb, const float *dw, const float *mw, const uint16_t *dt,
    const uint16_t *mt, int r_shift, const int two, const int table, const int mins, const uint8_t *next,
    float *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunks = pass + b * 128;
        if (next) { /* the later pass's block b: its codes are contiguous too */
            _mm_prefetch((const char *)(next + b * 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + b * 128 + 64), _MM_HINT_T0);
        }
        const int64_t levels = 1 + two;
        const __m256i *xv = xb + 8 * b * levels; /* the block's 8 broadcast dwords, [dword][level] */
        __m256i a = _mm256_setzero_si256(), a2 = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(chunks + 32 * c));
            const __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(lo, _mm256_loadu_si256(xv + 2 * c * levels)));
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xv + (2 * c + 1) * levels)));
            if (two) {
                a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(lo, _mm256_loadu_si256(xv + 2 * c * levels + 1)));
                a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xv + (2 * c + 1) * levels + 1)));
            }
        }
        __m256i isum = two ? _mm256_add_epi32(_mm256_madd_epi16(a, k256), _mm256_madd_epi16(a2, ones))
                           : _mm256_madd_epi16(a, ones);
        if (zero) isum = _mm256_add_epi32(isum, _mm256_set1_epi32(-zero * xsum[b]));
        const float dxb = dx[b];
        const __m256 dwb = table ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + (b >> r_shift) * LANE_COLS)))
                                 : _mm256_loadu_ps(dw + b * LANE_COLS);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_set1_ps(dxb), dwb), acc);
        if (mins) {
            const __m256 mwb = table ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + (b >> r_shift) * LANE_COLS)))
                                     : _mm256_loadu_ps(mw + b * LANE_COLS);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(dxb * (float)xsum[b]), mwb, acc);
        }
    }
    _mm256_storeu_ps(out, acc);
}

/* lane_pass_avx2 as a RowPass (bits is 4; count is 8: lane-layout matrices have whole passes),
 * compiled per level count, scale source and mins. */
TARGET_AVX2 static void lane_pass_avx2_bits(const uint8_t *q, int64_t row_bytes, int64_t n0, int64_t count, int64_t Kp,
                                            int bits, int zero, const int8_t *xq, const int8_t *xq2, const int16_t *x16,
                                            const float *dx, const int32_t *xsum, const float *dw, const float *mw,
                                            const uint16_t *dt, const uint16_t *mt, int r_shift, const uint8_t *next,
                                            float *out) {
    const uint8_t *pass = q + n0 * row_bytes;
    const int64_t blocks = Kp / 32;
    const __m256i *xb = (const __m256i *)x16; /* broadcast_codes_avx2's vectors (gemm_rows: never NULL) */
    (void)count, (void)bits;
#define LANE_PASS(two_, table_, mins_) \
    lane_pass_avx2(pass, blocks, zero, xq, xq2, dx, xsum, xb, dw, mw, dt, mt, r_shift, two_, table_, mins_, next, out)
#define LANE_PASS_MINS(two_, table_)   \
    if (table_ ? mt != 0 : mw != 0)    \
        LANE_PASS(two_, table_, 1);    \
    else                               \
        LANE_PASS(two_, table_, 0)
    if (xq2 && dt) LANE_PASS_MINS(1, 1);
    else if (xq2) LANE_PASS_MINS(1, 0);
    else if (dt) LANE_PASS_MINS(0, 1);
    else LANE_PASS_MINS(0, 0);
#undef LANE_PASS_MINS
#undef LANE_PASS
}

/* The lane kernel's activations for n codes (rows x Kp): each dword of 4 codes broadcast to a
 * vector, [n / 4][levels] (two levels: the first's vector, then the second's). */
TARGET_AVX2 static void broadcast_codes_avx2(const int8_t *xq, const int8_t *xq2, int64_t n, int bits, int16_t *out) {
    __m256i *v = (__m256i *)out;
    const int64_t levels = xq2 ? 2 : 1;
    for (int64_t i = 0; i < n / 4; i++) {
        int32_t w;
        memcpy(&w, xq + 4 * i, 4);
        _mm256_storeu_si256(v + levels * i, _mm256_set1_epi32(w));
        if (xq2) memcpy(&w, xq2 + 4 * i, 4), _mm256_storeu_si256(v + levels * i + 1, _mm256_set1_epi32(w));
    }
    (void)bits;
}

static const RowKernel AVX2_LANES = {transpose_scales_avx2, lane_pass_avx2_bits, LANE_COLS, AVX2_ROW_PREFETCH_PASSES,
                                     broadcast_codes_avx2, 8, 1, 1};

/* One block's integer sums of an AVX2 tile into its float accumulators: x scale x w scale,
 * plus the block's min term (Q4_1-style) when the weights have mins. */
TARGET_AVX2 static inline void tile_avx2_block_out(const RowTiles *rt, int64_t at, int64_t b, int64_t blocks,
                                                   const float *dw, const float *mw, const __m256i *sums,
                                                   __m256 *acc) {
    const __m256 dxv = _mm256_loadu_ps(rt->dx + at);
    for (int c = 0; c < AVX2_TILE_COLS; c++) {
        __m256 scale = _mm256_mul_ps(dxv, _mm256_set1_ps(dw[c * blocks + b]));
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[c]), scale, acc[c]);
    }
    if (mw) {
        const __m256 xsv = _mm256_loadu_ps(rt->xs + at);
        for (int c = 0; c < AVX2_TILE_COLS; c++)
            acc[c] = _mm256_fmadd_ps(xsv, _mm256_set1_ps(mw[c * blocks + b]), acc[c]);
    }
}

/* The running integer sums of an AVX2 tile pinned in registers after each step. Integer
 * additions are associative, and without this GCC regroups a block's 8 steps into a tree:
 * every product of the block computed first and parked on the stack (2-3x slower). */
TARGET_AVX2 static inline __attribute__((always_inline)) void keep_sums_avx2(__m256i *sums, __m256i *sums2,
                                                                             int two) {
    for (int c = 0; c < AVX2_TILE_COLS; c++) {
        __asm__("" : "+x"(sums[c]));
        if (two) __asm__("" : "+x"(sums2[c]));
    }
}

/* AVX2, 8 rows x 4 outputs, 4-bit codes only: vpmaddubsw pair sums of one block add up in
 * int16 without overflow (8 steps x 2 x 15 x 127 = 30480), per level; two levels (rt->x2)
 * are joined in int32 as (first << 8) + second. */
TARGET_AVX2 static inline __attribute__((always_inline)) void tile_avx2_q4_levels(
    const RowTiles *rt, int64_t t, const uint8_t *codes, const float *dw, const float *mw, int64_t Kp, int zero,
    int two, float *out) {
    const int64_t blocks = rt->num_blocks;
    const int8_t *x = rt->x + t * AVX2_TILE_ROWS * Kp, *x2 = two ? rt->x2 + t * AVX2_TILE_ROWS * Kp : 0;
    const __m256i ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
    __m256 acc[AVX2_TILE_COLS];
    for (int c = 0; c < AVX2_TILE_COLS; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = (t * blocks + b) * AVX2_TILE_ROWS;
        __m256i pairs[AVX2_TILE_COLS], pairs2[AVX2_TILE_COLS];
        for (int c = 0; c < AVX2_TILE_COLS; c++) pairs[c] = pairs2[c] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") /* GCC leaves it rolled: 8 compares and jumps a block, about 9% of the kernel */
        for (int s = 0; s < 8; s++) {
            const int64_t off = (8 * b + s) * AVX2_TILE_ROWS * 4;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + off));
            const __m256i xv2 = two ? _mm256_loadu_si256((const __m256i *)(x2 + off)) : _mm256_setzero_si256();
            for (int c = 0; c < AVX2_TILE_COLS; c++) {
                int32_t w4;
                memcpy(&w4, codes + c * Kp + 32 * b + 4 * s, 4);
                const __m256i w = _mm256_set1_epi32(w4);
                pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(w, xv));
                if (two) pairs2[c] = _mm256_add_epi16(pairs2[c], _mm256_maddubs_epi16(w, xv2));
            }
            keep_sums_avx2(pairs, pairs2, two);
        }
        const __m256i zc = _mm256_loadu_si256((const __m256i *)(rt->zc + at));
        __m256i sums[AVX2_TILE_COLS];
        for (int c = 0; c < AVX2_TILE_COLS; c++) {
            /* two levels: the first level's pair sums times 256 in the same vpmaddwd (exact:
               2 x 30480 x 256 < 2^31), so the join costs no shift */
            sums[c] = two ? _mm256_add_epi32(_mm256_madd_epi16(pairs[c], k256), _mm256_madd_epi16(pairs2[c], ones))
                          : _mm256_madd_epi16(pairs[c], ones);
            if (zero) sums[c] = _mm256_add_epi32(sums[c], zc);
        }
        tile_avx2_block_out(rt, at, b, blocks, dw, mw, sums, acc);
    }
    for (int c = 0; c < AVX2_TILE_COLS; c++) _mm256_storeu_ps(out + c * AVX2_TILE_ROWS, acc[c]);
}

TARGET_AVX2 static void tile_avx2_q4(const RowTiles *rt, int64_t t, const uint8_t *codes, const float *dw,
                                     const float *mw, int64_t Kp, int zero, float *out) {
    if (rt->x2) tile_avx2_q4_levels(rt, t, codes, dw, mw, Kp, zero, 1, out);
    else tile_avx2_q4_levels(rt, t, codes, dw, mw, Kp, zero, 0, out);
}

/* AVX2, 8 rows x 4 outputs, 8-bit codes (zero 128) as int16 q - 128 (unpack_outputs16) and
 * each row's activation as one int16 (RowTiles.x16): one vpmaddwd per 2 inputs of 8 rows,
 * for one activation level or two. Its products are exact and its sums exact int32 (|sum| <=
 * 32 x 32639 x 128 < 2^31), so each block's integer sum is (sum w . first << 8) + sum w . second,
 * the sum every other path computes: the same bits. Bytes would need vpmaddubsw's sign trick
 * (|w| . x with w's sign) and each level's products apart: about twice the instructions
 * (docs/benchmarks.md, "AVX2: 8-bit codes on vpmaddwd"). 4-bit codes stay bytes: widened they
 * measured slower. */
TARGET_AVX2 static void tile_avx2_q8(const RowTiles *rt, int64_t t, const uint8_t *codes8, const float *dw,
                                     const float *mw, int64_t Kp, int zero, float *out) {
    (void)zero; /* in the codes */
    const int16_t *codes = (const int16_t *)codes8, *x = rt->x16 + t * AVX2_TILE_ROWS * Kp;
    const int64_t blocks = rt->num_blocks;
    __m256 acc[AVX2_TILE_COLS];
    for (int c = 0; c < AVX2_TILE_COLS; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sums[AVX2_TILE_COLS];
        for (int c = 0; c < AVX2_TILE_COLS; c++) sums[c] = _mm256_setzero_si256();
        _Pragma("GCC unroll 16")
        for (int s = 0; s < 16; s++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + (16 * b + s) * AVX2_TILE_ROWS * 2));
            for (int c = 0; c < AVX2_TILE_COLS; c++) {
                int32_t w2;
                memcpy(&w2, codes + c * Kp + 32 * b + 2 * s, 4);
                sums[c] = _mm256_add_epi32(sums[c], _mm256_madd_epi16(xv, _mm256_set1_epi32(w2)));
            }
            keep_sums_avx2(sums, sums, 0);
        }
        tile_avx2_block_out(rt, (t * blocks + b) * AVX2_TILE_ROWS, b, blocks, dw, mw, sums, acc);
    }
    for (int c = 0; c < AVX2_TILE_COLS; c++) _mm256_storeu_ps(out + c * AVX2_TILE_ROWS, acc[c]);
}

/* A tile's outputs out[c * tile_rows + i] written to y[i * N + c] for rows i < num and
 * outputs c < count: one transposition in registers and one store per row instead of a
 * scalar store per value (16 x 8 of them for a VNNI tile, to rows far apart in y). */
typedef void (*TileStore)(const float *out, int64_t num, int64_t count, float *y, int64_t N);

TARGET_VNNI static inline __m256 upper_half_ps(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

TARGET_VNNI static void tile_store_vnni(const float *out, int64_t num, int64_t count, float *y, int64_t N) {
    __m512 r[VNNI_TILE_COLS], u[VNNI_TILE_COLS], w[VNNI_TILE_COLS];
    for (int c = 0; c < VNNI_TILE_COLS; c++) r[c] = _mm512_loadu_ps(out + c * VNNI_TILE_ROWS);
    /* per 128-bit lane L (rows 4L .. 4L + 3): pairs of outputs, then quads */
    for (int c = 0; c < VNNI_TILE_COLS; c += 2) {
        u[c] = _mm512_unpacklo_ps(r[c], r[c + 1]);     /* r_c[4L], r_c+1[4L], r_c[4L+1], r_c+1[4L+1] */
        u[c + 1] = _mm512_unpackhi_ps(r[c], r[c + 1]); /* the same for rows 4L + 2, 4L + 3 */
    }
    for (int h = 0; h < 2; h++) {  /* h: outputs 4h .. 4h + 3 */
        const int c = 4 * h;
        w[c] = _mm512_shuffle_ps(u[c], u[c + 2], 0x44);         /* row 4L */
        w[c + 1] = _mm512_shuffle_ps(u[c], u[c + 2], 0xee);     /* row 4L + 1 */
        w[c + 2] = _mm512_shuffle_ps(u[c + 1], u[c + 3], 0x44); /* row 4L + 2 */
        w[c + 3] = _mm512_shuffle_ps(u[c + 1], u[c + 3], 0xee); /* row 4L + 3 */
    }
    /* row 4L + j = lane L of w[j] (outputs 0-3) then lane L of w[4 + j] (outputs 4-7) */
    const __m512i lanes01 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i lanes23 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __mmask8 mask = (__mmask8)((1u << count) - 1u);
    for (int j = 0; j < 4; j++) {
        const __m512 a = _mm512_permutex2var_ps(w[j], lanes01, w[4 + j]); /* rows j, 4 + j */
        const __m512 b = _mm512_permutex2var_ps(w[j], lanes23, w[4 + j]); /* rows 8 + j, 12 + j */
        const __m256 rows[4] = {_mm512_castps512_ps256(a), upper_half_ps(a), _mm512_castps512_ps256(b),
                                upper_half_ps(b)};
        for (int k = 0; k < 4; k++) {
            const int64_t i = 4 * k + j;
            if (i < num) _mm256_mask_storeu_ps(y + i * N, mask, rows[k]);
        }
    }
}

TARGET_AVX2 static void tile_store_avx2(const float *out, int64_t num, int64_t count, float *y, int64_t N) {
    /* 4 outputs x 8 rows: two 4 x 4 transpositions, one per half of the rows */
    for (int h = 0; h < 2; h++) {
        __m128 c0 = _mm_loadu_ps(out + 4 * h), c1 = _mm_loadu_ps(out + AVX2_TILE_ROWS + 4 * h),
               c2 = _mm_loadu_ps(out + 2 * AVX2_TILE_ROWS + 4 * h), c3 = _mm_loadu_ps(out + 3 * AVX2_TILE_ROWS + 4 * h);
        _MM_TRANSPOSE4_PS(c0, c1, c2, c3);
        const __m128 rows[4] = {c0, c1, c2, c3};
        for (int k = 0; k < 4; k++) {
            const int64_t i = 4 * h + k;
            if (i >= num) break;
            if (count == AVX2_TILE_COLS) {
                _mm_storeu_ps(y + i * N, rows[k]);
            } else {
                float v[4];
                _mm_storeu_ps(v, rows[k]);
                memcpy(y + i * N, v, (size_t)count * sizeof(float));
            }
        }
    }
}

typedef struct {
    TileKernel kernel;
    TileStore store;
    int64_t rows, cols; /* activation rows x outputs per call */
    int wide;           /* int16 codes (unpack_outputs16) and activations (RowTiles.x16) */
} TileShape;

static const TileShape VNNI_TILE = {tile_vnni, tile_store_vnni, VNNI_TILE_ROWS, VNNI_TILE_COLS, 0};
static const TileShape AVX2_Q4_TILE = {tile_avx2_q4, tile_store_avx2, AVX2_TILE_ROWS, AVX2_TILE_COLS, 0};
static const TileShape AVX2_Q8_TILE = {tile_avx2_q8, tile_store_avx2, AVX2_TILE_ROWS, AVX2_TILE_COLS, 1};

#ifndef TILE_BAND_BYTES
#define TILE_BAND_BYTES (384 * 1024) /* activations per band of row tiles: half of a 768 KB-1 MB L2 */
#endif

/* silu(gate) * up, row by row (cpu_ops' silu_mul_f32_serial: no parallel region, since it runs
 * inside one, per tile): gate_up [rows, 2 n] (each row n gates then n ups), out [rows, n]. */
typedef void (*GluFn)(const void *gate_up, int64_t rows, int64_t n, void *out);

/* y [rows, N] through a tile kernel: groups of `cols` outputs are the parallel work items;
 * each unpacks its outputs once per band of row tiles and runs the band's tiles on them.
 * With `glu` (a SwiGLU's fused gate | up matrix: N = 2 glu_n, glu_n a multiple of cols, and of
 * LANE_COLS for a lane-layout matrix) y is [rows, glu_n] = glu of the product instead: an item is
 * a group of gate outputs and the same group of up outputs, and each tile's two results go
 * through glu at once (the bits of the product stored, then glu on the rows), so the product
 * is never written whole. Returns 0 when out of memory (y then incomplete: the caller
 * recomputes it another way). */
static int gemm_tiled(TileShape shape, const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t N,
                      int64_t Kp, int bits, int r, int zero, int lanes, const int8_t *xq, const int8_t *xq2, const float *dx,
                      const int32_t *xsum, int64_t rows, float *y, int64_t glu_n, GluFn glu) {
    const int64_t tile_rows = shape.rows, cols = shape.cols;
    const int64_t out_n = glu ? glu_n : N; /* y's row length; the outputs the groups cover */
    RowTiles rt;
    if (!row_tiles_alloc(&rt, tile_rows, xq2 != 0, shape.wide, rows, Kp)) {
        row_tiles_free(&rt);
        return 0;
    }
    const int64_t num_groups = (out_n + cols - 1) / cols, blocks = Kp / 32;
    const int64_t tile_bytes = tile_rows * Kp * (xq2 || shape.wide ? 2 : 1);
    const int64_t band = TILE_BAND_BYTES / tile_bytes > 4 ? TILE_BAND_BYTES / tile_bytes : 4;
    int failed = 0;
    lanes = lanes && bits == 4 && !shape.wide && LANE_COLS % cols == 0;
    /* items (group, band): each thread the static split's groups, band after band, then the
       others' last items (work_share.h) */
    WorkShare ws;
    work_share_init(&ws, num_groups, work_share_threads(num_groups), (rt.num_tiles + band - 1) / band);
    _Pragma("omp parallel if(num_groups > 1 && N * Kp * rows >= 65536)")
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        /* a lane-layout matrix's codes are unpacked a pass at a time: the groups of the pass
           (consecutive, so mostly on one thread) take theirs from it */
        const int64_t codes_bytes = (lanes ? LANE_COLS : cols) * Kp * (shape.wide ? 2 : 1);
        /* with glu: a second set (the up outputs') after the first */
        uint8_t *codes = malloc((size_t)(codes_bytes * (glu ? 2 : 1)));
        int64_t unpacked_pass[2] = {-1, -1};
        float *dw = malloc((size_t)(2 * blocks * cols * (glu ? 2 : 1)) * sizeof(float)), *mw = m ? dw + blocks * cols : 0;
        float out[MAX_TILE_OUT], out_up[MAX_TILE_OUT];
        float pair[MAX_TILE_OUT * 2], act[MAX_TILE_OUT]; /* a tile's gate | up rows, and their glu */
        if (!codes || !dw) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)") /* the activations in tile order, both threads */
        for (int64_t t = 0; t < rt.num_tiles; t++) {
            const int64_t i1 = (t + 1) * tile_rows < rows ? (t + 1) * tile_rows : rows;
            row_tiles_fill(&rt, xq, xq2, dx, xsum, t * tile_rows, i1, Kp, zero);
        }
        /* Many rows (a prefill chunk) go in bands of row tiles whose activations stay in L2
         * while every group of outputs passes over them; each band unpacks the codes again. */
        WorkItem it;
        while (work_share_next(&ws, me, nth, &it)) {
            const int64_t g = it.unit, t0 = it.round * band, t1 = t0 + band < rt.num_tiles ? t0 + band : rt.num_tiles;
            if (!codes || !dw) continue;
            const int64_t n0 = g * cols, count = out_n - n0 < cols ? out_n - n0 : cols;
            const uint8_t *group_codes[2];
            for (int half = 0; half < (glu ? 2 : 1); half++) { /* the gate group, then (glu) the up group */
                const int64_t at = n0 + half * glu_n;
                uint8_t *set = codes + half * codes_bytes;
                float *hdw = dw + half * 2 * blocks * cols, *hmw = m ? hdw + blocks * cols : 0;
                group_codes[half] = set;
                if (shape.wide) {
                    unpack_outputs16(q, d, m, at, count, cols, Kp, r, (int16_t *)set, hdw, hmw);
                } else if (lanes) { /* N (and glu_n) a multiple of LANE_COLS: every group is whole */
                    const int64_t pass = at / LANE_COLS;
                    if (pass != unpacked_pass[half]) unpack_lane_outputs(q, pass * LANE_COLS, LANE_COLS, Kp, set);
                    unpacked_pass[half] = pass;
                    group_codes[half] = set + (at % LANE_COLS) * Kp;
                    unpack_outputs(q, d, m, at, count, cols, Kp, bits, r, NULL, hdw, hmw);
                } else {
                    unpack_outputs(q, d, m, at, count, cols, Kp, bits, r, set, hdw, hmw);
                }
            }
            float *up_dw = dw + 2 * blocks * cols, *up_mw = m ? up_dw + blocks * cols : 0;
            for (int64_t step = 0; step < t1 - t0; step++) {
                /* odd groups walk the row tiles backwards: the tiles used last are still in L1 */
                const int64_t t = g % 2 ? t1 - 1 - step : t0 + step;
                shape.kernel(&rt, t, group_codes[0], dw, mw, Kp, zero, out);
                const int64_t num = rows - t * tile_rows < tile_rows ? rows - t * tile_rows : tile_rows;
                if (!glu) {
                    shape.store(out, num, count, y + t * tile_rows * N + n0, N);
                    continue;
                }
                shape.kernel(&rt, t, group_codes[1], up_dw, up_mw, Kp, zero, out_up);
                shape.store(out, num, count, pair, 2 * count);
                shape.store(out_up, num, count, pair + count, 2 * count);
                glu(pair, num, count, act);
                for (int64_t i = 0; i < num; i++)
                    memcpy(y + (t * tile_rows + i) * glu_n + n0, act + i * count, (size_t)count * sizeof(float));
            }
        }
        free(codes);
        free(dw);
    }
    row_tiles_free(&rt);
    return !failed;
}

/* ------------------------------------------------------------ AVX-512 + AMX-INT8 path
 *
 * Many rows on a CPU with AMX tiles (Sapphire Rapids and later): one TDPBSUD per 32-block
 * multiplies 16 activation rows (signed bytes, one tile row each, loaded straight from xq)
 * by 16 outputs' codes (unsigned bytes, 4 consecutive codes of an output per dword) into
 * 16 x 16 exact integer block sums. Those go through memory into zmm registers, where the
 * same per-block float sequence as every other path runs: acc = fma(isum, dx * dw, acc),
 * then with mins acc = fma(dx * xsum, mw, acc). So the path gives the other paths' bits;
 * the tiles only compute the integer sums faster. Two blocks per step use two sets of
 * tiles, so the TMUL unit works on one block while the vector units scale the other.
 * With two activation levels each block takes two TDPBSUDs on the same code tile, one per
 * level, into two sum tiles; the vector side joins them, (sum1 << 8) + sum2, before the same
 * float sequence. A step then holds one block instead of two. */

#define TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")))
#define AMX_TILE_ROWS 16
#define AMX_TILE_COLS 16

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) AmxConfig;

/* Tiles 0-3: integer sums [16 rows][16 outputs]; 4, 5: activations [16 rows][32 bytes];
 * 6, 7: codes [8 dwords of 4][16 outputs]. */
TARGET_AMX static void amx_configure(void) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = AMX_TILE_ROWS, c.colsb[t] = AMX_TILE_COLS * 4;
    for (int t = 4; t < 6; t++) c.rows[t] = AMX_TILE_ROWS, c.colsb[t] = 32;
    for (int t = 6; t < 8; t++) c.rows[t] = 8, c.colsb[t] = AMX_TILE_COLS * 4;
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(&c);
}

TARGET_AMX static void amx_release(void) { _tile_release(); }

/* The codes of outputs [n0, n0 + count) as TDPBSUD's right operand, per block b a
 * [8][16 outputs][4 codes] tile at out + 512 b; spare outputs repeat output n0. */
TARGET_AMX static void amx_pack_codes(const uint8_t *q, int64_t row_bytes, int64_t n0, int64_t count, int64_t Kp,
                                      int bits, uint8_t *out) {
    int32_t offsets[AMX_TILE_COLS];
    for (int j = 0; j < AMX_TILE_COLS; j++) offsets[j] = (int32_t)((j < count ? j : 0) * row_bytes);
    const __m512i index = _mm512_loadu_si512((const void *)offsets), low4 = _mm512_set1_epi8(0x0f);
    const uint8_t *base = q + n0 * row_bytes;
    if (bits == 4) { /* group g's dword kk: codes 4kk.. of block 2g in the low nibbles, of 2g + 1 in the high */
        for (int64_t g = 0; g < Kp / 64; g++)
            for (int kk = 0; kk < 8; kk++) {
                const __m512i v = _mm512_i32gather_epi32(index, (const void *)(base + g * 32 + 4 * kk), 1);
                _mm512_storeu_si512((void *)(out + (2 * g * 8 + kk) * 64), _mm512_and_si512(v, low4));
                _mm512_storeu_si512((void *)(out + ((2 * g + 1) * 8 + kk) * 64),
                                    _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
            }
        return;
    }
    for (int64_t b = 0; b < Kp / 32; b++)
        for (int kk = 0; kk < 8; kk++)
            _mm512_storeu_si512((void *)(out + (b * 8 + kk) * 64),
                                _mm512_i32gather_epi32(index, (const void *)(base + 32 * b + 4 * kk), 1));
}

/* Per activation row and block, the float / integer terms of the block sequence, per row
 * tile [tiles][blocks][16 rows] so that one block's terms of a tile are contiguous. */
typedef struct {
    float *dx;   /* the block's activation scale */
    float *xs;   /* dx * xsum */
    int32_t *zc; /* -zero * xsum */
} AmxRowTerms;

/* One block's 16 x 16 integer sums (in memory) into acc: row i's terms at dx[i], xs[i], zc[i].
 * sums2: the second level's sums, or NULL with one level. */
TARGET_AMX static inline __attribute__((always_inline)) void amx_block_out(
    const int32_t *sums, const int32_t *sums2, const float *dx, const float *xs, const int32_t *zc, int zero,
    __m512 dwv, __m512 mwv, int has_mins, __m512 acc[AMX_TILE_ROWS]) {
    _Pragma("GCC unroll 16")
    for (int i = 0; i < AMX_TILE_ROWS; i++) {
        __m512i v = _mm512_load_si512((const void *)(sums + i * AMX_TILE_COLS));
        if (sums2)
            v = _mm512_add_epi32(_mm512_slli_epi32(v, 8),
                                 _mm512_load_si512((const void *)(sums2 + i * AMX_TILE_COLS)));
        if (zero) v = _mm512_add_epi32(v, _mm512_set1_epi32(zc[i]));
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(dx[i]), dwv);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), scale, acc[i]);
        if (has_mins) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xs[i]), mwv, acc[i]);
    }
}

/* Blocks b, b + 1 into sum tiles c0, c1 (through activation tiles 4, 5 and code tiles 6, 7). */
#define AMX_DOT_PAIR(c0, c1, b)                                   \
    do {                                                          \
        _tile_zero(c0);                                           \
        _tile_zero(c1);                                           \
        _tile_loadd(4, x + 32 * (b), x_stride);                   \
        _tile_loadd(6, codes + 512 * (b), 64);                    \
        _tile_dpbsud(c0, 4, 6);                                   \
        _tile_loadd(5, x + 32 * ((b) + 1), x_stride);             \
        _tile_loadd(7, codes + 512 * ((b) + 1), 64);              \
        _tile_dpbsud(c1, 5, 7);                                   \
    } while (0)

/* Sum tiles c0, c1 (blocks 2p, 2p + 1) into buffer s. */
#define AMX_STORE_PAIR(c0, c1, s)                                 \
    do {                                                          \
        _tile_stored(c0, sums[s][0], AMX_TILE_COLS * 4);          \
        _tile_stored(c1, sums[s][1], AMX_TILE_COLS * 4);          \
    } while (0)

/* Buffer s (blocks 2p, 2p + 1) into the float accumulators, block by block. */
#define AMX_OUT_PAIR(s, p)                                                                                   \
    do {                                                                                                     \
        _Pragma("GCC unroll 2")                                                                              \
        for (int h = 0; h < 2; h++) {                                                                        \
            const int64_t bb = 2 * (p) + h;                                                                  \
            const __m512 dwv = _mm512_loadu_ps(dw + bb * AMX_TILE_COLS);                                     \
            const __m512 mwv = mw ? _mm512_loadu_ps(mw + bb * AMX_TILE_COLS) : _mm512_setzero_ps();          \
            amx_block_out(sums[s][h], 0, dx + 16 * bb, xs + 16 * bb, zc + 16 * bb, zero, dwv, mwv, mw != 0, acc); \
        }                                                                                                    \
    } while (0)

/* Two levels: block b's first level into sum tile c0, its second into c1, both against code
 * tile ct (6 or 7) through activation tiles 4 (x) and 5 (x2). */
#define AMX_DOT_LEVELS(c0, c1, ct, b)                             \
    do {                                                          \
        _tile_zero(c0);                                           \
        _tile_zero(c1);                                           \
        _tile_loadd(ct, codes + 512 * (b), 64);                   \
        _tile_loadd(4, x + 32 * (b), x_stride);                   \
        _tile_dpbsud(c0, 4, ct);                                  \
        _tile_loadd(5, x2 + 32 * (b), x_stride);                  \
        _tile_dpbsud(c1, 5, ct);                                  \
    } while (0)

/* Two levels: buffer s (block b's two sums) into the float accumulators. */
#define AMX_OUT_LEVELS(s, b)                                                                                 \
    do {                                                                                                     \
        const int64_t bb = (b);                                                                              \
        const __m512 dwv = _mm512_loadu_ps(dw + bb * AMX_TILE_COLS);                                         \
        const __m512 mwv = mw ? _mm512_loadu_ps(mw + bb * AMX_TILE_COLS) : _mm512_setzero_ps();              \
        amx_block_out(sums[s][0], sums[s][1], dx + 16 * bb, xs + 16 * bb, zc + 16 * bb, zero, dwv, mwv, mw != 0, \
                      acc);                                                                                  \
    } while (0)

/* Row tile [r0, r0 + 16) of activations x (and with two levels x2; rows of x_stride bytes)
 * . the packed outputs, stored to y rows r0.. (num rows, count outputs from column n0).
 * Software-pipelined over the pairs of blocks (two levels: over the blocks), three deep:
 * while the tiles multiply pair p + 1 (into sum tiles 0, 1 or 2, 3, by parity) and store
 * pair p to memory, the vector units scale pair p - 1, whose sums reached memory a step
 * earlier (a load right behind a tile store would wait for it). */
TARGET_AMX static inline __attribute__((always_inline)) void amx_tile(
    const int8_t *x, const int8_t *x2, int64_t x_stride, const AmxRowTerms *terms, int64_t r0, const uint8_t *codes,
    const float *dw, const float *mw, int64_t blocks, int zero, float *y, int64_t N, int64_t n0, int64_t count,
    int64_t num) {
    __m512 acc[AMX_TILE_ROWS];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < AMX_TILE_ROWS; i++) acc[i] = _mm512_setzero_ps();
    int32_t sums[2][2][AMX_TILE_ROWS * AMX_TILE_COLS] __attribute__((aligned(64)));
    const float *dx = terms->dx + r0 * blocks, *xs = terms->xs + r0 * blocks; /* r0 = 16 x the tile */
    const int32_t *zc = terms->zc + r0 * blocks;
    const int64_t pairs = blocks / 2; /* Kp is a multiple of 64: blocks is even */
    __asm__ volatile("" ::: "memory"); /* the packed codes are in memory before the tiles load them */
    if (x2) { /* the same schedule with one block per step: blocks is even */
        AMX_DOT_LEVELS(0, 1, 6, 0);
        for (int64_t b = 0; b < blocks; b += 2) {
            AMX_DOT_LEVELS(2, 3, 7, b + 1);
            AMX_STORE_PAIR(0, 1, 0);
            if (b > 0) AMX_OUT_LEVELS(1, b - 1);
            if (b + 2 < blocks) AMX_DOT_LEVELS(0, 1, 6, b + 2);
            AMX_STORE_PAIR(2, 3, 1);
            AMX_OUT_LEVELS(0, b);
        }
        AMX_OUT_LEVELS(1, blocks - 1);
    } else {
        AMX_DOT_PAIR(0, 1, 0);
        for (int64_t p = 0; p < pairs; p += 2) { /* even pairs in tiles 0, 1 and buffer 0, odd in 2, 3 and 1 */
            if (p + 1 < pairs) AMX_DOT_PAIR(2, 3, 2 * (p + 1));
            AMX_STORE_PAIR(0, 1, 0);
            if (p > 0) AMX_OUT_PAIR(1, p - 1);
            if (p + 1 < pairs) {
                if (p + 2 < pairs) AMX_DOT_PAIR(0, 1, 2 * (p + 2));
                AMX_STORE_PAIR(2, 3, 1);
                AMX_OUT_PAIR(0, p);
            }
        }
        AMX_OUT_PAIR((pairs - 1) % 2, pairs - 1);
    }
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    _Pragma("GCC unroll 16")
    for (int i = 0; i < AMX_TILE_ROWS; i++)
        if (i < num) _mm512_mask_storeu_ps(y + (r0 + i) * N + n0, mask, acc[i]);
}

/* amx_tile compiled per (levels, mins, zero point), so its inner loop tests none of them. */
#define AMX_TILE_CASES(X2)                                                                                       \
    do {                                                                                                         \
        if (mw && zero) amx_tile(x, X2, x_stride, terms, r0, codes, dw, mw, blocks, zero, y, N, n0, count, num); \
        else if (mw) amx_tile(x, X2, x_stride, terms, r0, codes, dw, mw, blocks, 0, y, N, n0, count, num);       \
        else if (zero) amx_tile(x, X2, x_stride, terms, r0, codes, dw, 0, blocks, zero, y, N, n0, count, num);   \
        else amx_tile(x, X2, x_stride, terms, r0, codes, dw, 0, blocks, 0, y, N, n0, count, num);                \
    } while (0)
TARGET_AMX static void amx_tile_mins(const int8_t *x, const int8_t *x2, int64_t x_stride, const AmxRowTerms *terms,
                                     int64_t r0, const uint8_t *codes, const float *dw, const float *mw,
                                     int64_t blocks, int zero, float *y, int64_t N, int64_t n0, int64_t count,
                                     int64_t num) {
    if (x2) AMX_TILE_CASES(x2);
    else AMX_TILE_CASES((const int8_t *)0);
}

/* y [rows, N] on the AMX tiles: groups of 16 outputs are the parallel work items; each
 * packs its codes once and runs every 16-row tile on them. xq2: the second activation
 * level, or NULL. Returns 0 when out of memory. */
static int gemm_amx(const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t N, int64_t Kp, int bits, int r,
                    int zero, const int8_t *xq, const int8_t *xq2, const float *dx, const int32_t *xsum, int64_t rows,
                    float *y) {
    const int64_t blocks = Kp / 32, row_bytes = bits == 4 ? Kp / 2 : Kp;
    const int64_t tiles = (rows + AMX_TILE_ROWS - 1) / AMX_TILE_ROWS, padded = tiles * AMX_TILE_ROWS;
    const int64_t full = rows / AMX_TILE_ROWS; /* tiles read straight from xq; the last partial one from tail */
    AmxRowTerms terms = {malloc((size_t)(padded * blocks) * sizeof(float)),
                         malloc((size_t)(padded * blocks) * sizeof(float)),
                         malloc((size_t)(padded * blocks) * sizeof(int32_t))};
    int8_t *tail = calloc((size_t)((xq2 ? 2 : 1) * AMX_TILE_ROWS * Kp), 1); /* with two levels, the second's after */
    int8_t *tail2 = xq2 && tail ? tail + AMX_TILE_ROWS * Kp : 0;
    int failed = !terms.dx || !terms.xs || !terms.zc || !tail;
    if (!failed) {
        for (int64_t i = 0; i < padded; i++)
            for (int64_t b = 0; b < blocks; b++) {
                const int32_t s = i < rows ? xsum[i * blocks + b] : 0;
                const float dxb = i < rows ? dx[i * blocks + b] : 0.0f;
                const int64_t at = ((i / AMX_TILE_ROWS) * blocks + b) * AMX_TILE_ROWS + i % AMX_TILE_ROWS;
                terms.dx[at] = dxb;
                terms.xs[at] = dxb * (float)s;
                terms.zc[at] = -zero * s;
            }
        if (full < tiles) memcpy(tail, xq + full * AMX_TILE_ROWS * Kp, (size_t)((rows - full * AMX_TILE_ROWS) * Kp));
        if (full < tiles && tail2)
            memcpy(tail2, xq2 + full * AMX_TILE_ROWS * Kp, (size_t)((rows - full * AMX_TILE_ROWS) * Kp));
        const int64_t num_groups = (N + AMX_TILE_COLS - 1) / AMX_TILE_COLS;
        _Pragma("omp parallel if(num_groups > 1 && N * Kp * rows >= 65536)")
        {
            uint8_t *codes = aligned_alloc(64, (size_t)(blocks * 512));
            float *dw = malloc((size_t)(2 * blocks * AMX_TILE_COLS) * sizeof(float));
            float *mw = m && dw ? dw + blocks * AMX_TILE_COLS : 0;
            if (!codes || !dw) {
                _Pragma("omp atomic write")
                failed = 1;
            } else {
                amx_configure();
            }
            _Pragma("omp for schedule(static)")
            for (int64_t g = 0; g < num_groups; g++) {
                if (!codes || !dw) continue;
                const int64_t n0 = g * AMX_TILE_COLS, count = N - n0 < AMX_TILE_COLS ? N - n0 : AMX_TILE_COLS;
                amx_pack_codes(q, row_bytes, n0, count, Kp, bits, codes);
                transpose_scales_vnni(d, n0, count, blocks, r, dw);
                if (m) transpose_scales_vnni(m, n0, count, blocks, r, mw);
                for (int64_t step = 0; step < tiles; step++) {
                    const int64_t t = g % 2 ? tiles - 1 - step : step; /* as gemm_tiled: warm tiles first */
                    const int64_t num = rows - t * AMX_TILE_ROWS < AMX_TILE_ROWS ? rows - t * AMX_TILE_ROWS : AMX_TILE_ROWS;
                    const int8_t *x = t < full ? xq + t * AMX_TILE_ROWS * Kp : tail;
                    const int8_t *x2 = !xq2 ? 0 : t < full ? xq2 + t * AMX_TILE_ROWS * Kp : tail2;
                    amx_tile_mins(x, x2, Kp, &terms, t * AMX_TILE_ROWS, codes, dw, mw, blocks, zero, y, N, n0, count, num);
                }
            }
            if (codes && dw) amx_release();
            free(codes);
            free(dw);
        }
    }
    free(terms.dx);
    free(terms.xs);
    free(terms.zc);
    free(tail);
    return !failed;
}

/* ------------------------------------------------------------ AVX-512 + AMX-BF16: bfloat16 activations
 *
 * With bfloat16 activations (a model run in bfloat16 with packed weights) there is nothing to
 * quantize: each group of 16 outputs has its codes dequantized once per call into a bfloat16
 * panel, w = bf16(d * (q - zero) + m) with the multiply and the add rounded apart, as
 * dequantize() and a cast to bfloat16 give them (so the panel holds the very weights of the
 * dense bfloat16 model made from the same file), and TDPBF16PS multiplies the activation rows
 * (the tile's A operand, loaded straight from x) by it. B wants the pairs of 2 consecutive
 * inputs of 16 outputs per row, so the panel is stored that way: per 32 inputs a [16 pairs]
 * [16 outputs][2] tile, the dequantized rows transposed as 16 x 16 dwords in registers.
 * Sums stay in float32 tiles over the whole of Kp (one accumulator per 16 x 16 block; two
 * row tiles by two groups' panels at a time, so every tile loaded serves two products) and are
 * rounded to bfloat16 once, at the end. A dense bfloat16 weight is stored once in the panels'
 * layout (gemm_amx_bf16_dense), so it needs no dequantization. */

#define TARGET_AMX_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma,amx-tile,amx-bf16")))

/* r[i] (16 dwords each) -> r[i] = column i of the 16 x 16 dword matrix the rows made. */
TARGET_AMX_BF16 static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i + 3 */
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);       /* lanes 0, 2 of rows 0-3, 4-7 */
        t[4 + j] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);   /* lanes 1, 3 */
        t[8 + j] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);        /* column j: lane 0 everywhere */
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);    /* column 8 + j: lane 2 */
        r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88); /* column 4 + j: lane 1 */
        r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xdd); /* column 12 + j: lane 3 */
    }
}

/* Outputs [n0, n0 + count) dequantized to bfloat16, as TDPBF16PS's B operand: block b's tile
 * at panel + 512 b, row kk holding inputs 32 b + 2 kk, 32 b + 2 kk + 1 of each output; the
 * outputs past count are zero. */
TARGET_AMX_BF16 static void bf16_panel(const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t n0,
                                       int64_t count, int64_t Kp, int bits, int r, int zero, uint16_t *panel) {
    const int64_t blocks = Kp / 32, groups = blocks / r, row_bytes = bits == 4 ? Kp / 2 : Kp;
    const __m512 zf = _mm512_set1_ps((float)zero);
    for (int64_t b = 0; b < blocks; b++) {
        __m512i rows[16];
        for (int64_t n = 0; n < 16; n++) {
            if (n >= count) {
                rows[n] = _mm512_setzero_si512();
                continue;
            }
            const uint8_t *qr = q + (n0 + n) * row_bytes;
            __m128i lo, hi; /* the block's 32 codes as bytes, 16 and 16 */
            if (bits == 4) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qr + (b / 2) * 32));
                const __m256i nib = b % 2 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f))
                                          : _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
                lo = _mm256_castsi256_si128(nib);
                hi = _mm256_extracti128_si256(nib, 1);
            } else {
                lo = _mm_loadu_si128((const __m128i *)(qr + b * 32));
                hi = _mm_loadu_si128((const __m128i *)(qr + b * 32 + 16));
            }
            const int64_t at = (n0 + n) * groups + b / r;
            const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d[at]));
            __m512 wl = _mm512_sub_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), zf,
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512 wh = _mm512_sub_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), zf,
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            wl = _mm512_mul_round_ps(wl, dv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            wh = _mm512_mul_round_ps(wh, dv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            if (m) {
                const __m512 mv = _mm512_set1_ps(_cvtsh_ss(m[at]));
                wl = _mm512_add_round_ps(wl, mv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                wh = _mm512_add_round_ps(wh, mv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            }
            rows[n] = (__m512i)_mm512_cvtne2ps_pbh(wh, wl);
        }
        transpose16_epi32(rows);
        for (int kk = 0; kk < 16; kk++) _mm512_store_si512((void *)(panel + 512 * b + 32 * kk), rows[kk]);
    }
}

/* Tiles 0-3: float32 sums [16 rows][16 outputs] (row tile i, group j at 2 i + j); 4, 5: row tiles
 * [16 rows][32 inputs]; 6, 7: the two groups' weight tiles [16 pairs][16 outputs x 2]. */
TARGET_AMX_BF16 static void amx_bf16_configure(void) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(&c);
}

/* exp(x) in float32 by the very operations of cpu_ops.c's vexp_any (clamped to [-87, 88.7], 2^k
 * times a degree-6 polynomial for 2^f), so that a fused SiLU gives silu_mul_bf16's bits. */
TARGET_AMX_BF16 static inline __m512 exp_like_cpu_ops(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.693147180559945f));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

TARGET_AMX_BF16 static inline __m512 round_to_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

/* silu(gate) * up for 16 outputs, each operand first rounded to bfloat16 as the plain product
 * stores it, then silu_mul_bf16's operations (silu rounded to bfloat16, the product rounded once
 * more): the bits of the matmul followed by cpu_ops' silu_mul. */
TARGET_AMX_BF16 static inline __m256i silu_mul_outputs(__m512 gate, __m512 up) {
    const __m512 g = round_to_bf16(gate), u = round_to_bf16(up);
    const __m512 e = exp_like_cpu_ops(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 act = round_to_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(act, u));
}

/* One row's outputs n0 .. of a 2 x 2 (its float32 sums lo, hi, bias added) into row `at` of y:
 * 32 outputs rounded to bfloat16 under `mask` (into yf: those values widened, as a float32 copy
 * of y would hold them), or with `glu` silu(lo) * hi, 16 outputs under the mask's low half. */
TARGET_AMX_BF16 static inline __attribute__((always_inline)) void bf16_store_row(
    uint16_t *y, float *yf, int64_t at, int64_t N, int64_t n0, __mmask32 mask, __m512 lo, __m512 hi, int glu) {
    if (glu) {
        _mm256_mask_storeu_epi16((void *)(y + at * N + n0), (__mmask16)mask, silu_mul_outputs(lo, hi));
    } else if (yf) {
        float *dst = yf + at * N + n0;
        _mm512_mask_storeu_ps(dst, (__mmask16)mask, _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(lo)));
        _mm512_mask_storeu_ps(dst + 16, (__mmask16)(mask >> 16), _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(hi)));
    } else {
        _mm512_mask_storeu_epi16((void *)(y + at * N + n0), mask, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* Rows of a finished 2 x 2 (outputs n0 .. of rows r0 ..) whose float32 sums wait to be rounded
 * and written. The dense kernel leaves each pair's epilogue here and does it a few rows at a
 * time inside the next pair's block loop, where the vector work runs beside the tile products
 * instead of after them; every output gets the same operations as written at once. */
#ifndef DENSE_BF16_PENDING_ROWS
#define DENSE_BF16_PENDING_ROWS 4 /* rows written per block of the next 2 x 2 */
#endif
typedef struct {
    float sums[4 * 256] __attribute__((aligned(64))); /* row tile i: group 0 at 512 i, group 1 at 512 i + 256 */
    __m512 bias[2];
    uint16_t *y;
    float *yf;
    int64_t N, r0, n0, num, done; /* rows [0, num) of the pair; those before `done` are written */
    __mmask32 mask;
    int two, has_bias, glu;
} Bf16Pending;

/* Write the pending rows up to `upto` (the rest stay pending). */
TARGET_AMX_BF16 static inline __attribute__((always_inline)) void pending_rows(Bf16Pending *p, int64_t upto) {
    if (upto > p->num) upto = p->num;
    for (; p->done < upto; p->done++) {
        const int64_t row = p->done, at = p->r0 + row;
        const float *s = p->sums + 512 * (row >> 4) + 16 * (row & 15);
        __m512 lo = _mm512_load_ps(s), hi = p->two ? _mm512_load_ps(s + 256) : lo;
        if (p->has_bias) lo = _mm512_add_ps(lo, p->bias[0]), hi = _mm512_add_ps(hi, p->bias[1]);
        bf16_store_row(p->y, p->yf, at, p->N, p->n0, p->mask, lo, hi, p->glu);
    }
}

/* Row tiles a0 and a1 (NULL: none; rows lda inputs apart) times the panels of two consecutive
 * groups, p0 and the one after it in memory (two = 0: the first only): 2 x 2 tiles of sums, so
 * each tile loaded serves two products, over blocks [b0, b1) (partial: the sums of the blocks
 * before b0, and where b1 < blocks those through b1, kept for the next call). Once b1 reaches
 * blocks, each output (the float32 sum over all the blocks in order, plus bias: float32, or
 * NULL) is rounded to bfloat16 into row r0 + ... of y (the rows past `rows` are not written);
 * each row's 32 outputs n0 .. (under `mask`) go out as one 64-byte store. With `glu` the two
 * groups are a gate's and an up's 16 outputs, and silu(gate) * up goes out instead: 16 outputs
 * n0 .. (under the mask's low half) of y, N wide. */
TARGET_AMX_BF16 static inline __attribute__((always_inline)) void amx_bf16_2x2(
    const uint16_t *p0, int two, const uint16_t *a0, const uint16_t *a1, int64_t blocks, int64_t lda,
    const __m512 *bias, uint16_t *y, int64_t N, int64_t r0, int64_t rows, int64_t n0, __mmask32 mask, float *sums,
    int64_t b0, int64_t b1, float *partial, float *yf, int glu, Bf16Pending *pend) {
    const uint16_t *p1 = p0 + 512 * blocks;
    if (b0 == 0) {
        _tile_zero(0);
        if (two) _tile_zero(1);
        if (a1) _tile_zero(2);
        if (a1 && two) _tile_zero(3);
    } else { /* the sums of blocks [0, b0), as an earlier call left them */
        _tile_loadd(0, partial, 64);
        if (two) _tile_loadd(1, partial + 256, 64);
        if (a1) _tile_loadd(2, partial + 512, 64);
        if (a1 && two) _tile_loadd(3, partial + 768, 64);
    }
    for (int64_t b = b0; b < b1; b++) {
        _tile_loadd(6, p0 + 512 * b, 64);
        _tile_loadd(4, a0 + 32 * b, lda * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, p1 + 512 * b, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (a1) {
            _tile_loadd(5, a1 + 32 * b, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
        if (pend && pend->done < pend->num) pending_rows(pend, pend->done + DENSE_BF16_PENDING_ROWS);
    }
    if (b1 < blocks) { /* more blocks to come: keep the sums (exactly: float32 in, float32 out) */
        _tile_stored(0, partial, 64);
        if (two) _tile_stored(1, partial + 256, 64);
        if (a1) _tile_stored(2, partial + 512, 64);
        if (a1 && two) _tile_stored(3, partial + 768, 64);
        return;
    }
    if (pend) { /* this 2 x 2's epilogue waits for the next one's block loop */
        pending_rows(pend, pend->num); /* the previous one's rows that its loop did not reach */
        _tile_stored(0, pend->sums, 64);
        if (two) _tile_stored(1, pend->sums + 256, 64);
        if (a1) _tile_stored(2, pend->sums + 512, 64);
        if (a1 && two) _tile_stored(3, pend->sums + 768, 64);
        pend->has_bias = bias != 0;
        if (bias) pend->bias[0] = bias[0], pend->bias[1] = bias[1];
        pend->y = y, pend->yf = yf, pend->N = N, pend->r0 = r0, pend->n0 = n0, pend->mask = mask;
        pend->two = two, pend->glu = glu, pend->done = 0;
        pend->num = rows - r0 < (a1 ? 32 : 16) ? rows - r0 : (a1 ? 32 : 16);
        return;
    }
    for (int64_t i = 0; i < (a1 ? 2 : 1); i++) {
        if (i == 0) {
            _tile_stored(0, sums, 64);
            if (two) _tile_stored(1, sums + 256, 64);
        } else {
            _tile_stored(2, sums, 64);
            if (two) _tile_stored(3, sums + 256, 64);
        }
        __asm__ volatile("" ::: "memory");
        const int64_t first = r0 + 16 * i, num = rows - first < 16 ? rows - first : 16;
        for (int64_t row = 0; row < num; row++) {
            __m512 lo = _mm512_load_ps(sums + 16 * row), hi = two ? _mm512_load_ps(sums + 256 + 16 * row) : lo;
            if (bias) lo = _mm512_add_ps(lo, bias[0]), hi = _mm512_add_ps(hi, bias[1]);
            bf16_store_row(y, yf, first + row, N, n0, mask, lo, hi, glu);
        }
    }
}

/* Activations as tiles read: x itself where its rows are whole blocks of Kp inputs, else a
 * zero-padded copy (every row when K < Kp; otherwise only a last, partial tile). */
typedef struct {
    const uint16_t *x;
    uint16_t *pad;
    int64_t direct, Kp;
} Bf16Rows;

static int bf16_rows_init(Bf16Rows *t, const uint16_t *x, int64_t rows, int64_t K, int64_t Kp) {
    t->x = x, t->Kp = Kp, t->direct = K == Kp ? rows / 16 : 0, t->pad = 0;
    const int64_t copied = rows - 16 * t->direct;
    if (!copied) return 1;
    t->pad = calloc((size_t)(((copied + 15) / 16) * 16 * Kp), 2);
    if (!t->pad) return 0;
    for (int64_t i = 0; i < copied; i++) memcpy(t->pad + i * Kp, x + (16 * t->direct + i) * K, (size_t)K * 2);
    return 1;
}

static inline const uint16_t *bf16_rows_tile(const Bf16Rows *t, int64_t tile) {
    return tile < t->direct ? t->x + 16 * tile * t->Kp : t->pad + 16 * (tile - t->direct) * t->Kp;
}

/* y [rows, N] bfloat16 = x [rows, K] bfloat16 . dequantized weights [N, K]^T. Returns 0 when
 * out of memory (y not written). */
TARGET_AMX_BF16 static int gemm_amx_bf16(const uint16_t *x, int64_t rows, int64_t K, const uint8_t *q,
                                         const uint16_t *d, const uint16_t *m, int64_t N, int64_t Kp, int bits,
                                         int r, int zero, uint16_t *y) {
    const int64_t blocks = Kp / 32, tiles = (rows + 15) / 16, pairs = (N + 31) / 32;
    Bf16Rows in;
    if (!bf16_rows_init(&in, x, rows, K, Kp)) return 0;
    int failed = 0;
    _Pragma("omp parallel if(pairs > 1 && N * Kp * rows >= 65536)")
    {
        uint16_t *panel = aligned_alloc(64, (size_t)(2 * blocks * 512) * 2); /* two groups' tiles */
        float sums[2 * 16 * 16] __attribute__((aligned(64)));
        if (!panel) {
            _Pragma("omp atomic write")
            failed = 1;
        } else {
            amx_bf16_configure();
        }
        _Pragma("omp for schedule(static)")
        for (int64_t gp = 0; gp < pairs; gp++) {
            if (!panel) continue;
            const int64_t n0 = gp * 32, count = N - n0 < 32 ? N - n0 : 32;
            const __mmask32 mask = (__mmask32)(count == 32 ? 0xffffffffu : (1u << count) - 1u);
            bf16_panel(q, d, m, n0, count < 16 ? count : 16, Kp, bits, r, zero, panel);
            if (count > 16) bf16_panel(q, d, m, n0 + 16, count - 16, Kp, bits, r, zero, panel + blocks * 512);
            for (int64_t t0 = 0; t0 < tiles; t0 += 2)
                amx_bf16_2x2(panel, count > 16, bf16_rows_tile(&in, t0), t0 + 1 < tiles ? bf16_rows_tile(&in, t0 + 1) : 0,
                             blocks, Kp, 0, y, N, 16 * t0, rows, n0, mask, sums, 0, blocks, 0, 0, 0, 0);
        }
        if (panel) _tile_release();
        free(panel);
    }
    free(in.pad);
    return !failed;
}

/* Bytes of activations per block of the dense kernel's rows: a block is multiplied by every pair
 * of groups before the next one is read, so it should stay in L2, and the larger it is, the
 * fewer times the weight is read again (147-295 KiB measured alike at 2,048 rows; 1 MiB 25%
 * slower). */
#ifndef DENSE_BF16_ROW_BLOCK_BYTES
#define DENSE_BF16_ROW_BLOCK_BYTES (256 << 10)
#endif
/* Bytes of the weight a thread takes through every row block before its next share: with a
 * row block it stays in L2 (512 KiB measured 5-10% ahead of none at 2,048 rows). */
#ifndef DENSE_BF16_WEIGHT_CHUNK_BYTES
#define DENSE_BF16_WEIGHT_CHUNK_BYTES (512 << 10)
#endif
/* Blocks of 32 inputs a pass over a row block takes at a time (0: all): the two groups' 18 KiB of
 * weight tiles then stay in L1 while the row tiles stream past, and the sums go to memory and
 * back between passes (exactly). 9 measured 5-8% ahead of all at 2,048 rows (576 inputs; 4,
 * 6, 12 and 16 between). */
#ifndef DENSE_BF16_K_BLOCKS
#define DENSE_BF16_K_BLOCKS 9
#endif
/* Output rows of at least this many bytes (an LM head's), from 512 rows, take the row pairs
 * outside the outputs: stores then stream into 32 rows at a time, not into every row of the
 * block (49152 x 576 at 2,048 rows: 1.45x faster; at 64-256 rows the same or a little slower). */
#ifndef DENSE_BF16_WIDE_ROW_BYTES
#define DENSE_BF16_WIDE_ROW_BYTES (32 << 10)
#endif

/* A dense kernel's bias for outputs n0 .. under mask (32 bits: the second 16 read only where the
 * mask reaches them, zero past it), as float32 vectors. */
TARGET_AMX_BF16 static inline void bias_pair(const uint16_t *bias, int64_t n0, __mmask32 mask, __m512 out[2]) {
    for (int h = 0; h < 2; h++) {
        const __m512i b32 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)(mask >> (16 * h)), bias + n0 + 16 * h));
        out[h] = _mm512_castsi512_ps(_mm512_slli_epi32(b32, 16));
    }
}

/* Row tiles [t_start, t_end) of y times group pair gp of the dense weight w, K-blocked (see
 * DENSE_BF16_K_BLOCKS; partial: a thread's buffer of 4 sum tiles per row-tile pair). With glu
 * the pair is a gate group and an up group, for outputs 16 gp .. of y. */
TARGET_AMX_BF16 static inline __attribute__((always_inline)) void dense_bf16_pair(const Bf16Rows *in, const uint16_t *w, int64_t blocks, int64_t Kp,
                                                   const uint16_t *bias, uint16_t *y, int64_t N, int64_t rows,
                                                   int64_t num_groups, int64_t gp, int64_t t_start, int64_t t_end,
                                                   int64_t k_step, float *partial, float *sums, float *yf, int glu,
                                                   Bf16Pending *pend) {
    const int64_t width = glu ? 16 : 32, n0 = gp * width, count = N - n0 < width ? N - n0 : width;
    const __mmask32 mask = (__mmask32)(count == 32 ? 0xffffffffu : (1u << count) - 1u);
    const int two = 2 * gp + 1 < num_groups;
    __m512 bias_v[2];
    if (bias) bias_pair(bias, n0, mask, bias_v);
    for (int64_t k0 = 0; k0 < blocks; k0 += k_step)
        for (int64_t t0 = t_start; t0 < t_end; t0 += 2)
            amx_bf16_2x2(w + 2 * gp * blocks * 512, two, bf16_rows_tile(in, t0),
                         t0 + 1 < t_end ? bf16_rows_tile(in, t0 + 1) : 0, blocks, Kp, bias ? bias_v : 0, y,
                         N, 16 * t0, rows, n0, mask, sums, k0, k0 + k_step < blocks ? k0 + k_step : blocks,
                         partial + (t0 - t_start) / 2 * 1024, yf, glu, pend);
}

/* y [rows, N] bfloat16 = x [rows, K] bfloat16 . w^T (+ bias [N] bfloat16, or NULL), w a dense
 * bfloat16 weight stored as TDPBF16PS's B operand (dense_bf16_pack's layout: per group of 16
 * outputs, per block of 32 inputs, a [16 pairs][16 outputs][2] tile; outputs past N and
 * inputs past K are zero). Each output is the float32 sum over the blocks in order, rounded
 * once, so a row's result does not depend on the other rows. Returns 0 when out of memory.
 * glu: w holds a gate's and an up's N outputs each, their groups of 16 in turn (gate group g
 * is group 2 g, up group g is group 2 g + 1), and y [rows, N] gets silu(gate) * up (bias NULL). */
TARGET_AMX_BF16 static int gemm_amx_bf16_dense(const uint16_t *x, int64_t rows, int64_t K, const uint16_t *w,
                                               int64_t N, int64_t Kp, const uint16_t *bias, uint16_t *y, float *yf,
                                               int glu) {
    if (rows <= 0 || N <= 0) return 1;
    const int64_t blocks = Kp / 32, tiles = (rows + 15) / 16, num_groups = (glu ? 2 : 1) * ((N + 15) / 16);
    const int64_t pairs = (num_groups + 1) / 2;
    /* as many row blocks as the size allows, all of about the same size (an even number of tiles) */
    int64_t most = DENSE_BF16_ROW_BLOCK_BYTES / (16 * Kp * 2);
    if (most < 2) most = 2;
    const int64_t row_blocks = (tiles + most - 1) / most;
    const int64_t block_tiles = ((tiles + row_blocks - 1) / row_blocks + 1) / 2 * 2;
    Bf16Rows in;
    if (!bf16_rows_init(&in, x, rows, K, Kp)) return 0;
    _Pragma("omp parallel if(pairs > 1 && N * Kp * rows >= 65536)")
    {
        float sums[2 * 16 * 16] __attribute__((aligned(64)));
        const int64_t k_step = DENSE_BF16_K_BLOCKS > 0 && DENSE_BF16_K_BLOCKS < blocks ? DENSE_BF16_K_BLOCKS : blocks;
        float *partial = k_step < blocks ? aligned_alloc(64, (size_t)((block_tiles + 1) / 2 * 1024) * 4) : 0;
        Bf16Pending pend;
        pend.num = pend.done = 0;
        amx_bf16_configure();
        /* each thread its own share of the outputs (its slice of the weight stays in its L2), and
         * every row block through it in turn */
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = pairs * me / nth, hi = pairs * (me + 1) / nth;
        int64_t chunk = DENSE_BF16_WEIGHT_CHUNK_BYTES / (32 * Kp * 2); /* group pairs per chunk */
        if (chunk < 1) chunk = 1;
        const int wide = N * 2 >= DENSE_BF16_WIDE_ROW_BYTES && rows >= 512;
        for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
            const int64_t c1 = c0 + chunk < hi ? c0 + chunk : hi;
            for (int64_t rb = 0; rb < row_blocks; rb++) {
                const int64_t start = rb * block_tiles, end = start + block_tiles < tiles ? start + block_tiles : tiles;
                if (!wide) {
                    for (int64_t gp = c0; gp < c1; gp++)
                        if (glu) /* apart, so the plain products' loop has no pending rows to look at */
                            dense_bf16_pair(&in, w, blocks, Kp, bias, y, N, rows, num_groups, gp, start, end, k_step,
                                            partial, sums, yf, 1, &pend);
                        else
                            dense_bf16_pair(&in, w, blocks, Kp, bias, y, N, rows, num_groups, gp, start, end, k_step,
                                            partial, sums, yf, 0, 0);
                } else { /* each row pair through the chunk's outputs: 32 rows write at a time, not 256 */
                    for (int64_t t0 = start; t0 < end; t0 += 2)
                        for (int64_t gp = c0; gp < c1; gp++)
                            dense_bf16_pair(&in, w, blocks, Kp, bias, y, N, rows, num_groups, gp, t0,
                                            t0 + 2 < end ? t0 + 2 : end, k_step, partial, sums, yf, glu, 0);
                }
            }
        }
        pending_rows(&pend, pend.num); /* the last pair's rows */
        _tile_release();
        free(partial);
    }
    free(in.pad);
    return 1;
}

/* ------------------------------------------------------------ AVX512-BF16 without AMX: dense bfloat16 weights
 *
 * The same packed weight (dense_bf16_pack's layout: per group of 16 outputs and block of 32
 * inputs, [16 pairs][16 outputs][2]) is what VDPBF16PS takes as a vector: one 64-byte row of a
 * tile is one pair of inputs for 16 outputs. Each activation pair (a dword of the row) is
 * broadcast and multiplied into the 16 outputs' float32 sums, DENSE_DP_ROWS rows by two groups
 * (32 outputs, or a SwiGLU's gate and up groups) at a time, so each weight vector loaded serves
 * 2 x DENSE_DP_ROWS products. Each output is the float32 sum over the pairs in order, rounded
 * once as the tiles' (bf16_store_row: the same epilogue, the same fused SiLU), so a row's result
 * does not depend on the other rows or the thread count. On AMD Zen 5 (no AMX) this ran
 * 1.0-1.9x oneDNN's bfloat16 matmul at 64 rows and 1.1-1.2x at 256 (docs/profile.md,
 * eighteenth round). */
#ifndef DENSE_DP_ROWS
#define DENSE_DP_ROWS 12 /* rows per register block: 24 accumulators, two weight vectors, a broadcast */
#endif
#ifndef DENSE_DP_ROW_BLOCK
#define DENSE_DP_ROW_BLOCK 256 /* rows taken through a thread's share of the outputs at a time */
#endif

/* Rows r0 .. r0 + nr of the activations (Bf16Rows: zero past K) times groups w0 and w1 (two
 * consecutive groups' panels, blocks of them), their outputs n0 .. into y / yf (bf16_store_row). */
TARGET_AMX_BF16 static inline __attribute__((always_inline)) void dense_dp_rows(
    const Bf16Rows *in, int64_t r0, const int nr, const uint16_t *w0, const uint16_t *w1, int64_t blocks,
    const __m512 *bias, uint16_t *y, float *yf, int64_t N, int64_t n0, __mmask32 mask, int glu, const char *pf) {
    __m512 acc[DENSE_DP_ROWS][2];
    const int32_t *xr[DENSE_DP_ROWS];
    for (int r = 0; r < nr; r++) {
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const int64_t row = r0 + r;
        xr[r] = (const int32_t *)(bf16_rows_tile(in, row / 16) + (row % 16) * in->Kp);
    }
    for (int64_t b = 0; b < blocks; b++) {
        const __m512i *a = (const __m512i *)(w0 + 512 * b), *c = (const __m512i *)(w1 + 512 * b);
        for (int kk = 0; kk < 16; kk++) {
            const __m512bh wa = (__m512bh)_mm512_loadu_si512(a + kk), wc = (__m512bh)_mm512_loadu_si512(c + kk);
            if (pf) { /* the next pair's panels (2 blocks x 1 KiB per block here), into L2 */
                _mm_prefetch(pf + 2048 * b + 128 * kk, _MM_HINT_T1);
                _mm_prefetch(pf + 2048 * b + 128 * kk + 64, _MM_HINT_T1);
            }
            for (int r = 0; r < nr; r++) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[r][16 * b + kk]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wa, xb);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], wc, xb);
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        __m512 lo = acc[r][0], hi = acc[r][1];
        if (bias) lo = _mm512_add_ps(lo, bias[0]), hi = _mm512_add_ps(hi, bias[1]);
        bf16_store_row(y, yf, r0 + r, N, n0, mask, lo, hi, glu);
    }
}

/* gemm_amx_bf16_dense's contract (y, yf, bias, glu) on VDPBF16PS. Returns 0 when out of memory. */
TARGET_AMX_BF16 static int gemm_dp_bf16_dense(const uint16_t *x, int64_t rows, int64_t K, const uint16_t *w,
                                              int64_t N, int64_t Kp, const uint16_t *bias, uint16_t *y, float *yf,
                                              int glu) {
    if (rows <= 0 || N <= 0) return 1;
    const int64_t blocks = Kp / 32, num_groups = (glu ? 2 : 1) * ((N + 15) / 16), pairs = (num_groups + 1) / 2;
    Bf16Rows in;
    if (!bf16_rows_init(&in, x, rows, K, Kp)) return 0;
    /* Items (group pair, row block): each thread its static share of the pairs, every row block
       through it in turn (its slice of the weight stays in its L2); a thread done with its
       share takes the others' last items (work_share.h) */
    WorkShare ws;
    work_share_init(&ws, pairs, work_share_threads(pairs), (rows + DENSE_DP_ROW_BLOCK - 1) / DENSE_DP_ROW_BLOCK);
    _Pragma("omp parallel if(pairs > 1 && N * Kp * rows >= 65536)")
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        WorkItem it;
        while (work_share_next(&ws, me, nth, &it)) {
            const int64_t gp = it.unit, rb = it.round * DENSE_DP_ROW_BLOCK;
            const int64_t re = rb + DENSE_DP_ROW_BLOCK < rows ? rb + DENSE_DP_ROW_BLOCK : rows;
            const int64_t width = glu ? 16 : 32, n0 = gp * width, count = N - n0 < width ? N - n0 : width;
            const __mmask32 mask = (__mmask32)(count == 32 ? 0xffffffffu : (1u << count) - 1u);
            const int two = glu || 2 * gp + 1 < num_groups;
            const uint16_t *w0 = w + 2 * gp * blocks * 512, *w1 = two ? w0 + blocks * 512 : w0;
            __m512 bias_v[2];
            if (bias) bias_pair(bias, n0, mask, bias_v);
            /* the first row tile prefetches the share's next pair's panels (2 blocks KiB,
               contiguous; past the weight's end a prefetch is dropped, never a fault) */
            const char *next = it.own && gp + 1 < it.share_hi ? (const char *)(w0 + 2 * blocks * 512) : 0;
            for (int64_t r0 = rb; r0 < re; r0 += DENSE_DP_ROWS) {
                const char *pf = r0 == rb ? next : 0;
                if (re - r0 >= DENSE_DP_ROWS)
                    dense_dp_rows(&in, r0, DENSE_DP_ROWS, w0, w1, blocks, bias ? bias_v : 0, y, yf, N, n0, mask, glu, pf);
                else
                    dense_dp_rows(&in, r0, (int)(re - r0), w0, w1, blocks, bias ? bias_v : 0, y, yf, N, n0, mask, glu, pf);
            }
        }
    }
    free(in.pad);
    return 1;
}

/* AVX512-BF16 (CPUID.7.1 EAX bit 5) with AVX-512 BW / VL: gemm_dp_bf16_dense runs. */
static int dp_bf16_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* AMX-TILE (CPUID.7.0 EDX bit 24) and the tile unit's `feature` bit (22: BF16, 25: INT8), and
 * the kernel's leave to use the tile data (Linux asks each process to request it; the request
 * is granted once and holds for every thread). */
static int amx_usable_with(unsigned feature) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << feature))) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* gemm_amx_bf16's needs: AMX-BF16 tiles, and what VDPBF16PS's kernels need (dp_bf16_usable). */
static int amx_bf16_usable(void) { return dp_bf16_usable() && amx_usable_with(22); }

#endif

/* ------------------------------------------------------------ dispatch */

/* The best path this CPU runs: 3 (AVX-512 VNNI + AMX-INT8), 2 (AVX-512 VNNI), 1 (AVX2 +
 * FMA + F16C) or 0 (portable C). */
int quant_isa(void) {
#ifdef QUANT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
        return amx_usable_with(25 /* AMX-INT8 */) ? 3 : 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return 1;
#endif
    return 0;
}

/* Rows from which a path takes its tiled kernel, by measurement (python -m
 * pagedllm.quant.kernel_bench and the row sweep in docs/benchmarks.md): below them
 * the per-row kernels, whose vectors hold one row, waste no lanes. */
#define VNNI_TILED_MIN_ROWS 3
#define AVX2_Q4_TILED_MIN_ROWS 4
#define AVX2_Q8_TILED_MIN_ROWS 5
/* With two activation levels a tile does twice the integer work on all its lanes, so the
 * per-row kernels stay ahead for longer (AMD Zen 4, kernel_bench --activations int16). */
#define VNNI_TILED_MIN_ROWS_TWO_LEVELS 8
#define AVX2_Q4_TILED_MIN_ROWS_TWO_LEVELS 6
/* 8-bit codes' tiled kernel does the same work for one level or two: the one-level
 * threshold (Sapphire Rapids, AVX2 path forced: 0.178 against 0.172 ms at 4 rows, 0.217
 * against 0.170 at 5, 1536 x 576; the LM head's shape crosses at 5 too) */
#define AVX2_Q8_TILED_MIN_ROWS_TWO_LEVELS 5
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 4 /* path 3: the AMX kernel from here (faster than path 2 from 4 rows, by kernel_bench); below, path 2 */
#endif
#ifndef AMX_MIN_ROWS_TWO_LEVELS
#define AMX_MIN_ROWS_TWO_LEVELS 8 /* two levels: from here AMX beats the VNNI tiled kernel, which starts here too; below, VNNI per row */
#endif

/* isa 3, 2 or 1, codes of `bits` bits, activations of `levels` levels (for 3: the rows from
 * which the AMX kernel runs); 0 for the portable path, which has no tiled kernel. */
int quant_tiled_min_rows(int isa, int bits, int levels) {
    const int two = levels == 2;
    if (isa == 3) return two ? AMX_MIN_ROWS_TWO_LEVELS : AMX_MIN_ROWS;
    if (isa >= 2) return two ? VNNI_TILED_MIN_ROWS_TWO_LEVELS : VNNI_TILED_MIN_ROWS;
    if (isa == 1 && bits == 4) return two ? AVX2_Q4_TILED_MIN_ROWS_TWO_LEVELS : AVX2_Q4_TILED_MIN_ROWS;
    if (isa == 1) return two ? AVX2_Q8_TILED_MIN_ROWS_TWO_LEVELS : AVX2_Q8_TILED_MIN_ROWS;
    return 0;
}

static void gemm_portable(const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t N, int64_t Kp, int bits,
                          int r, int32_t zero, int lanes, const int8_t *xq, const int8_t *xq2, const float *dx,
                          const int32_t *xsum, int64_t rows, float *y) {
    _Pragma("omp parallel for schedule(static) if(N * Kp * rows >= 65536)")
    for (int64_t n = 0; n < N; n++)
        gemm_outputs_portable(q, d, m, n, 1, N, Kp, bits, r, zero, lanes, xq, xq2, dx, xsum, rows, y);
}

/* y [rows, N] float32 = quantized activations [rows, Kp] . weights [N, Kp]^T; xq2: the
 * activations' second level, or NULL for one level (see quantize_activations).
 * isa: a path quant_isa() allows (3, 2, 1 or 0). The AVX-512 VNNI and the AVX2 paths take
 * their tiled kernels from tiled_min_rows rows on (quant_tiled_min_rows(isa, bits) by
 * default; other values for benchmarks and tests).
 * A path that cannot serve the arguments (AVX2 with 8-bit codes whose zero is not 128,
 * the tiled kernel out of memory) falls back to the next one down,
 * which gives the same bits. lanes: 4-bit codes in the lane layout (see the top of the file),
 * which the AVX2, AVX-512 VNNI and portable kernels read; the AMX path hands such a matrix to
 * path 2's (the engine makes it only where AVX2 or VNNI is the path). */
void quant_gemm(int isa, int64_t tiled_min_rows, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                const uint16_t *dt, const uint16_t *mt, int64_t N,
                int64_t Kp, int bits, int r, int32_t zero, int lanes, const int8_t *xq, const int8_t *xq2,
                const float *dx, const int32_t *xsum, int64_t rows, float *y) {
    lanes = lanes && bits == 4;
#ifdef QUANT_X86
    if (isa == 3) {
        /* AMX's tiles read rows: a lane-layout matrix takes path 2's kernels at any row count */
        if (!lanes && rows >= tiled_min_rows && gemm_amx(q, d, m, N, Kp, bits, r, zero, xq, xq2, dx, xsum, rows, y))
            return;
        /* few rows (or out of memory, or lanes): path 2 */
        tiled_min_rows = xq2 ? VNNI_TILED_MIN_ROWS_TWO_LEVELS : VNNI_TILED_MIN_ROWS;
        isa = 2;
    }
    if (isa == 2) {
        if (rows >= tiled_min_rows &&
            gemm_tiled(VNNI_TILE, q, d, m, N, Kp, bits, r, zero, lanes, xq, xq2, dx, xsum, rows, y, 0, NULL))
            return;
        gemm_rows(lanes ? VNNI_LANES : VNNI_ROWS, q, d, m, dt, mt, N, Kp, bits, r, zero, lanes, xq, xq2, dx, xsum, rows, y);
        return;
    }
    if (isa == 1 && (bits == 4 || zero == 128)) {
        if (rows >= tiled_min_rows && gemm_tiled(bits == 4 ? AVX2_Q4_TILE : AVX2_Q8_TILE, q, d, m, N, Kp, bits, r,
                                                 zero, lanes, xq, xq2, dx, xsum, rows, y, 0, NULL))
            return;
        gemm_rows(lanes ? AVX2_LANES : AVX2_ROWS, q, d, m, dt, mt, N, Kp, bits, r, zero, lanes, xq, xq2, dx, xsum, rows, y);
        return;
    }
#endif
    (void)isa; /* without x86, every path is the portable one */
    (void)tiled_min_rows;
    gemm_portable(q, d, m, N, Kp, bits, r, zero, lanes, xq, xq2, dx, xsum, rows, y);
}

/* quantize_activations (levels: 1 or 2) then quant_gemm, scratch from the heap: one call per
 * matmul. Returns 0 when out of memory (y not written). */
/* A call's activations quantized (quantize_activations) into one heap block: free(a->xq) releases it. */
typedef struct {
    int8_t *xq, *xq2; /* xq2: NULL for one level */
    float *dx;
    int32_t *xsum;
} QuantizedRows;

static int quantize_rows(int isa, int levels, const float *x, int64_t rows, int64_t K, int64_t Kp, QuantizedRows *a) {
    const int64_t blocks = Kp / 32, code_bytes = (levels == 2 ? 2 : 1) * rows * Kp;
    char *scratch = malloc((size_t)(code_bytes + rows * blocks * 8));
    if (!scratch) return 0;
    a->xq = (int8_t *)scratch;
    a->xq2 = levels == 2 ? a->xq + rows * Kp : 0;
    a->dx = (float *)(scratch + code_bytes); /* Kp is a multiple of 64: aligned */
    a->xsum = (int32_t *)(a->dx + rows * blocks);
    quantize_activations(isa, x, rows, K, Kp, a->xq, a->xq2, a->dx, a->xsum);
    return 1;
}

int quant_linear(int isa, int64_t tiled_min_rows, int levels, const float *x, int64_t rows, int64_t K,
                 const uint8_t *q, const uint16_t *d, const uint16_t *m, const uint16_t *dt, const uint16_t *mt,
                 int64_t N, int64_t Kp, int bits, int r, int32_t zero, int lanes, float *y) {
    QuantizedRows a;
    if (!quantize_rows(isa, levels, x, rows, K, Kp, &a)) return 0;
    quant_gemm(isa, tiled_min_rows, q, d, m, dt, mt, N, Kp, bits, r, zero, lanes, a.xq, a.xq2, a.dx, a.xsum, rows, y);
    free(a.xq);
    return 1;
}

/* Whether the layer stack takes quant_linear_glu: 1 (the default) where the product it saves
 * writing, rows x 2 inter floats, is GLU_FUSION_MIN_BYTES or more (smaller, it stays in the L2s,
 * and the one pass measured no faster: benchmarks/glu_fusion_bench.py), 2 at any size, 0 never
 * (the product then silu_mul). The same bits in every case. */
#define GLU_FUSION_MIN_BYTES (4 << 20)
static int glu_fusion = 1;
static int64_t glu_fused_calls; /* quant_linear_glu calls that did the work (quant_glu_fused_calls) */
void quant_set_glu_fusion(int on) { glu_fusion = on; }
int64_t quant_glu_fused_calls(void) { return __atomic_load_n(&glu_fused_calls, __ATOMIC_RELAXED); }

/* act [rows, inter] = glu(x . [gate | up]^T) for a SwiGLU's fused gate | up matrix (N = 2 inter
 * outputs: inter gates, then inter ups), where a tiled kernel takes these rows: the gate and
 * up groups of each item go through glu tile by tile (gemm_tiled), and the product [rows, 2 inter]
 * is never written. The same bits as quant_linear followed by glu on the rows. Returns 1 when
 * done, -1 where this path does not apply (few rows, an AMX-tiled matrix, inter not a multiple of
 * the tile's outputs, out of memory): the caller runs quant_linear and glu then. */
int quant_linear_glu(int isa, int64_t tiled_min_rows, int levels, const float *x, int64_t rows, int64_t K,
                     const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t inter, int64_t Kp, int bits, int r,
                     int32_t zero, int lanes, GluFn glu, float *act) {
#ifdef QUANT_X86
    lanes = lanes && bits == 4;
    TileShape shape;
    if (isa == 2 || (isa == 3 && lanes)) { /* AMX hands a lane-layout matrix to path 2 (quant_gemm) */
        if (isa == 3) tiled_min_rows = levels == 2 ? VNNI_TILED_MIN_ROWS_TWO_LEVELS : VNNI_TILED_MIN_ROWS;
        shape = VNNI_TILE;
    } else if (isa == 1 && (bits == 4 || zero == 128)) {
        shape = bits == 4 ? AVX2_Q4_TILE : AVX2_Q8_TILE;
    } else {
        return -1;
    }
    const int tile_lanes = lanes && !shape.wide && LANE_COLS % shape.cols == 0;
    if (!glu || rows < tiled_min_rows || rows < 1 || inter % shape.cols || (tile_lanes && inter % LANE_COLS))
        return -1;
    QuantizedRows a;
    if (!quantize_rows(isa, levels, x, rows, K, Kp, &a)) return -1;
    const int done = gemm_tiled(shape, q, d, m, 2 * inter, Kp, bits, r, zero, lanes, a.xq, a.xq2, a.dx, a.xsum, rows,
                                act, inter, glu);
    free(a.xq);
    if (done) __atomic_fetch_add(&glu_fused_calls, 1, __ATOMIC_RELAXED);
    return done ? 1 : -1;
#else
    (void)isa, (void)tiled_min_rows, (void)levels, (void)x, (void)rows, (void)K, (void)q, (void)d, (void)m,
        (void)inter, (void)Kp, (void)bits, (void)r, (void)zero, (void)lanes, (void)glu, (void)act;
    return -1;
#endif
}

/* Whether quant_linear_bf16 runs here (AMX-BF16 and its tile data granted); probed once. */
int quant_amx_bf16(void) {
#ifdef QUANT_X86
    static int usable = -1;
    if (usable < 0) usable = amx_bf16_usable();
    return usable;
#else
    return 0;
#endif
}

/* y [rows, N] bfloat16 = x [rows, K] bfloat16 . the packed weights' dequantized bfloat16 values
 * [N, K]^T on the AMX-BF16 tiles (gemm_amx_bf16). Returns 0 where the CPU has no AMX-BF16 or
 * memory ran out (y not written): the caller takes another path. */
int quant_linear_bf16(const uint16_t *x, int64_t rows, int64_t K, const uint8_t *q, const uint16_t *d,
                      const uint16_t *m, int64_t N, int64_t Kp, int bits, int r, int32_t zero, uint16_t *y) {
#ifdef QUANT_X86
    if (quant_amx_bf16()) return gemm_amx_bf16(x, rows, K, q, d, m, N, Kp, bits, r, zero, y);
#endif
    (void)x, (void)rows, (void)K, (void)q, (void)d, (void)m, (void)N, (void)Kp, (void)bits, (void)r, (void)zero,
        (void)y;
    return 0;
}

/* Which kernel takes dense bfloat16 weights in dense_bf16_pack's layout: 2 the AMX-BF16 tiles
 * (gemm_amx_bf16_dense), 1 VDPBF16PS (gemm_dp_bf16_dense: AVX512-BF16 without AMX), 0 none. */
int dense_bf16_kernel(void) {
#ifdef QUANT_X86
    static int kind = -1;
    if (kind < 0) kind = quant_amx_bf16() ? 2 : dp_bf16_usable() ? 1 : 0;
    return kind;
#else
    return 0;
#endif
}
/* The dense kernel dense_bf16_kernel names (gemm_amx_bf16_dense's contract); 0 where there is none. */
static int dense_bf16(const uint16_t *x, int64_t rows, int64_t K, const uint16_t *w, int64_t N, int64_t Kp,
                      const uint16_t *bias, uint16_t *y, float *yf, int glu) {
#ifdef QUANT_X86
    switch (dense_bf16_kernel()) {
    case 2: return gemm_amx_bf16_dense(x, rows, K, w, N, Kp, bias, y, yf, glu);
    case 1: return gemm_dp_bf16_dense(x, rows, K, w, N, Kp, bias, y, yf, glu);
    }
#endif
    (void)x, (void)rows, (void)K, (void)w, (void)N, (void)Kp, (void)bias, (void)y, (void)yf, (void)glu;
    return 0;
}

/* y [rows, N] bfloat16 = x [rows, K] bfloat16 . w^T (+ bias) for a dense bfloat16 weight in
 * dense_bf16_pack's tile layout, on the AMX-BF16 tiles (gemm_amx_bf16_dense) or VDPBF16PS
 * (gemm_dp_bf16_dense). Returns 0 where the CPU has neither or memory ran out (y not written). */
int dense_linear_bf16(const uint16_t *x, int64_t rows, int64_t K, const uint16_t *w, int64_t N, int64_t Kp,
                      const uint16_t *bias, uint16_t *y) {
    return dense_bf16(x, rows, K, w, N, Kp, bias, y, 0, 0);
}

/* dense_linear_bf16 with the outputs written as float32 (each the bfloat16 value dense_linear_bf16
 * gives, widened exactly): an LM head's logits, which sampling wants in float32, without a
 * second pass over them. */
int dense_linear_bf16_f32(const uint16_t *x, int64_t rows, int64_t K, const uint16_t *w, int64_t N, int64_t Kp,
                          const uint16_t *bias, float *y) {
    return dense_bf16(x, rows, K, w, N, Kp, bias, 0, y, 0);
}

/* y [rows, N] bfloat16 = silu(x . gate^T) * (x . up^T) for a SwiGLU's gate and up weights ([N, K]
 * each) packed by dense_bf16_pack_glu (their groups of 16 outputs in turn): the bits of
 * dense_linear_bf16 on [gate | up] followed by cpu_ops' silu_mul_bf16, in one pass, without the
 * [rows, 2 N] product going to memory and back. Returns 0 where dense_linear_bf16 would. */
int dense_linear_bf16_silu_mul(const uint16_t *x, int64_t rows, int64_t K, const uint16_t *w, int64_t N, int64_t Kp,
                               uint16_t *y) {
    return dense_bf16(x, rows, K, w, N, Kp, 0, y, 0, 1);
}

/* ------------------------------------------------------------ a stack of decoder layers in one call
 *
 * Every decoder layer of a Llama-family model whose four matrices are packed here and
 * whose other kernels are pagedllm's native CPU ones (float32 activations, one rank),
 * run in one call: the same kernels in the same order as the model's modules call them
 * one by one (so the same bits come out), without a trip through the interpreter
 * between them. The element-wise and attention kernels live in the per-ISA cpu_ops
 * library; the caller passes their addresses. */

typedef void (*RmsNormFn)(void *residual, const void *delta, const void *weight, float eps, int64_t rows,
                          int64_t n, void *out);
typedef void (*RotaryFn)(void *x, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim,
                         const int64_t *positions, const float *cos_table, const float *sin_table);
typedef void (*WriteKvFn)(const void *k, int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots,
                          int64_t rows, int64_t kv_heads, int64_t head_dim, void *k_cache, void *v_cache,
                          int64_t block_size, int32_t layout);
typedef void (*WriteKv8Fn)(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                           const int64_t *slots, int64_t rows, int64_t kv_heads, int64_t head_dim, void *k_cache,
                           void *v_cache, void *k_scale, void *v_scale, int64_t block_size, int32_t layout);
typedef void (*AttentionFn)(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            const void *k_scale, const void *v_scale, const int32_t *tables, int64_t table_stride,
                            const int32_t *tiles, int64_t num_tiles, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int32_t layout, float scale, int32_t split_heads,
                            const int32_t *head_ranges, void *out);
typedef void (*SiluMulFn)(const void *gate_up, int64_t rows, int64_t n, void *out);
typedef void (*Hadamard16Fn)(uint16_t *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                             float scale, int64_t narrow_heads, float *y, int64_t y_stride);
typedef void (*HadamardFn)(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                           float scale);

typedef struct {
    const uint8_t *q;
    const uint16_t *d, *m;
    const uint16_t *dt, *mt; /* their row-scale tables for the isa's per-row kernel (see gemm_rows), or NULL */
    const void *bias; /* [N] or NULL: float32, or bfloat16 beside w16 */
    int64_t N, K, Kp, bits, r, zero, tiled_min_rows, levels;
    const uint16_t *w16; /* a dense bfloat16 weight in dense_bf16_pack's layout (the codes above unused), or NULL */
    int64_t glu;         /* w16 is a SwiGLU's [gate | up] in dense_bf16_pack_glu's layout (gate_up only) */
    int64_t lanes;       /* the codes are in the lane layout (see the top of the file) */
} StackLinear;

typedef struct {
    const void *input_norm, *post_norm;
    StackLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache, *k_scale, *v_scale; /* scales: 8-bit caches only */
} StackLayer;

typedef struct {
    void *rms_norm, *rotary, *write_kv, *attention, *silu_mul; /* cpu_ops entry points of the activations' dtype */
    int64_t isa, num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, kv8;
    float eps, scale;
    const StackLayer *layers;
    void *hadamard; /* cpu_ops' hadamard_f32 */
    int64_t rotate; /* the cache holds Hadamard-rotated vectors (int8 KV, see kv_format.py) */
    int64_t elem;   /* bytes per activation: 4 (float32, packed codes) or 2 (bfloat16: dense w16 weights, or
                       packed codes on a CPU without AMX-BF16) */
    void *hadamard16; /* cpu_ops' hadamard_bf16 */
    int64_t kv_layout; /* the caches' layout, cpu_ops.c's KV_LAYOUT_TOKEN (0) or KV_LAYOUT_HEAD (1) */
    void *silu_mul_serial; /* silu_mul on the calling thread only (the fused SwiGLU's, per tile), or NULL */
} LayerStack;

/* cpu_ops.c's bf16_to_f32 and f32_to_bf16 (each library is built from its one source). */
static inline float stack_bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16) does (NaN kept quiet). */
static inline uint16_t stack_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Packed codes under bfloat16 activations (a CPU without AMX-BF16): as the modules do it,
 * x widened to float32 (exact), the float32 product rounded to bfloat16, then the bfloat16
 * bias added and rounded again. wide: rows x (K + N) floats of scratch. */
static int stack_linear_packed_bf16(const LayerStack *s, const StackLinear *l, const uint16_t *x, int64_t rows,
                                    uint16_t *y, float *wide) {
    float *xf = wide, *yf = wide + rows * l->K;
    const int64_t K = l->K, N = l->N;
    _Pragma("omp parallel for schedule(static) if(rows * K >= 16384)")
    for (int64_t i = 0; i < rows; i++)
        for (int64_t k = 0; k < K; k++) xf[i * K + k] = stack_bf16_to_f32(x[i * K + k]);
    if (!quant_linear((int)s->isa, l->tiled_min_rows, (int)l->levels, xf, rows, K, l->q, l->d, l->m, l->dt, l->mt, N, l->Kp,
                      (int)l->bits, (int)l->r, (int32_t)l->zero, (int)l->lanes, yf))
        return 0;
    const uint16_t *bias = l->bias;
    _Pragma("omp parallel for schedule(static) if(rows * N >= 16384)")
    for (int64_t i = 0; i < rows; i++) {
        for (int64_t n = 0; n < N; n++) y[i * N + n] = stack_f32_to_bf16(yf[i * N + n]);
        if (bias)
            for (int64_t n = 0; n < N; n++)
                y[i * N + n] = stack_f32_to_bf16(stack_bf16_to_f32(y[i * N + n]) + stack_bf16_to_f32(bias[n]));
    }
    return 1;
}

static int stack_linear(const LayerStack *s, const StackLinear *l, const void *x, int64_t rows, void *y, float *wide) {
    if (l->w16) return dense_linear_bf16(x, rows, l->K, l->w16, l->N, l->Kp, l->bias, y);
    if (s->elem == 2) return stack_linear_packed_bf16(s, l, x, rows, y, wide);
    if (!quant_linear((int)s->isa, l->tiled_min_rows, (int)l->levels, x, rows, l->K, l->q, l->d, l->m, l->dt, l->mt, l->N, l->Kp,
                      (int)l->bits, (int)l->r, (int32_t)l->zero, (int)l->lanes, y))
        return 0;
    if (l->bias) {
        float *yf = y;
        const float *bias = l->bias;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t n = 0; n < l->N; n++) yf[i * l->N + n] += bias[n];
    }
    return 1;
}

/* Per row, the float32 input and output of the widest packed matmul under bfloat16 activations. */
static int64_t stack_wide_floats(const LayerStack *s) {
    if (s->elem != 2 || s->num_layers == 0 || s->layers[0].qkv.w16) return 0;
    const int64_t H = s->num_heads, KH = s->num_kv_heads, D = s->head_dim, hidden = s->hidden;
    const int64_t K = hidden > H * D ? hidden : H * D, widest_in = K > s->intermediate ? K : s->intermediate;
    const int64_t qkv_width = (H + 2 * KH) * D, widest_out = qkv_width > 2 * s->intermediate ? qkv_width : 2 * s->intermediate;
    return widest_in + (widest_out > hidden ? widest_out : hidden);
}

/* residual [rows, hidden] is updated in place through every layer; delta [rows, hidden]
 * receives the last layer's MLP output, not yet added (as the modules leave it). Rows
 * from num_rows on are padding: their attention output is zero. scratch: the caller's
 * buffer of quant_stack_scratch_floats(s, rows) floats, kept from step to step (a buffer
 * allocated per call is, at prefill sizes, fresh memory the OS must zero and map page by
 * page each time), or NULL to allocate one here. Returns 0 when out of memory (residual
 * and the caches then partly updated: the caller cannot retry). */
int64_t quant_stack_scratch_floats(const LayerStack *s, int64_t rows) {
    const int64_t H = s->num_heads, KH = s->num_kv_heads, D = s->head_dim, hidden = s->hidden;
    const int64_t qkv_width = (H + 2 * KH) * D, inter = s->intermediate;
    const int64_t rotated16 = s->rotate && s->elem == 2 ? qkv_width : 0; /* float32 rows to rotate bfloat16 ones in */
    return rows * (hidden + qkv_width + H * D + hidden + 2 * inter + inter + rotated16 + stack_wide_floats(s));
}

int quant_run_layers(const LayerStack *s, int64_t rows, void *residual, void *delta, const int64_t *positions,
                     const float *cos_table, const float *sin_table, const int64_t *slots, const int32_t *tables,
                     int64_t table_stride, const int32_t *tiles, int64_t num_tiles, int32_t split_heads,
                     int64_t num_rows, float *given_scratch) {
    const int64_t H = s->num_heads, KH = s->num_kv_heads, D = s->head_dim, hidden = s->hidden, e = s->elem;
    const int64_t qkv_width = (H + 2 * KH) * D, inter = s->intermediate;
    float *scratch = given_scratch ? given_scratch : malloc((size_t)quant_stack_scratch_floats(s, rows) * sizeof(float));
    if (!scratch) return 0;
    char *x = (char *)scratch, *qkv = x + rows * hidden * e, *attn_out = qkv + rows * qkv_width * e;
    char *attn = attn_out + rows * H * D * e, *gate_up = attn + rows * hidden * e, *act = gate_up + rows * 2 * inter * e;
    float *rot = (float *)(act + rows * inter * e); /* rotated bfloat16 rows in float32 (quant_stack_scratch_floats) */
    float *wide = rot + (s->rotate && e == 2 ? rows * qkv_width : 0); /* packed matmuls' float32 sides under bfloat16 */
    RmsNormFn rms_norm = (RmsNormFn)s->rms_norm;
    int ok = 1;
    for (int64_t i = 0; i < s->num_layers && ok; i++) {
        const StackLayer *L = &s->layers[i];
        rms_norm(residual, i ? delta : NULL, L->input_norm, s->eps, rows, hidden, x);
        ok = stack_linear(s, &L->qkv, x, rows, qkv, wide);
        if (!ok) break;
        ((RotaryFn)s->rotary)(qkv, rows, qkv_width, H + KH, D, positions, cos_table, sin_table);
        const char *k = qkv + H * D * e, *v = qkv + (H + KH) * D * e;
        if (s->rotate && e == 4) /* q, k and v rotated as the modules do: H + 2 KH heads per row */
            ((HadamardFn)s->hadamard)((float *)qkv, rows, qkv_width, H + 2 * KH, D, 1.0f);
        if (s->rotate && e == 2) { /* rotated in float32; q back to bfloat16, k and v quantized from float32 */
            ((Hadamard16Fn)s->hadamard16)((uint16_t *)qkv, rows, qkv_width, H + 2 * KH, D, 1.0f, H, rot, qkv_width);
            k = (const char *)(rot + H * D), v = (const char *)(rot + (H + KH) * D);
        }
        if (s->kv8)
            ((WriteKv8Fn)s->write_kv)(k, qkv_width, v, qkv_width, slots, rows, KH, D, L->k_cache, L->v_cache,
                                      L->k_scale, L->v_scale, s->block_size, (int32_t)s->kv_layout);
        else
            ((WriteKvFn)s->write_kv)(k, qkv_width, v, qkv_width, slots, rows, KH, D, L->k_cache, L->v_cache,
                                     s->block_size, (int32_t)s->kv_layout);
        ((AttentionFn)s->attention)(qkv, qkv_width, L->k_cache, L->v_cache, L->k_scale, L->v_scale, tables,
                                    table_stride, tiles, num_tiles, H, KH, D, s->block_size, (int32_t)s->kv_layout,
                                    s->rotate ? s->scale / (float)D : s->scale, split_heads, NULL, attn_out);
        if (num_rows < rows) memset(attn_out + num_rows * H * D * e, 0, (size_t)((rows - num_rows) * H * D * e));
        if (s->rotate && e == 4) ((HadamardFn)s->hadamard)((float *)attn_out, rows, H * D, H, D, 1.0f / (float)D);
        if (s->rotate && e == 2) /* the output rotated back in float32, then bfloat16 */
            ((Hadamard16Fn)s->hadamard16)((uint16_t *)attn_out, rows, H * D, H, D, 1.0f / (float)D, H, NULL, 0);
        ok = stack_linear(s, &L->o, attn_out, rows, attn, wide);
        if (!ok) break;
        rms_norm(residual, attn, L->post_norm, s->eps, rows, hidden, x);
        if (L->gate_up.glu) { /* the product and silu_mul in one pass: the same bits */
            ok = dense_linear_bf16_silu_mul((const uint16_t *)x, rows, L->gate_up.K, L->gate_up.w16, inter, L->gate_up.Kp,
                                            (uint16_t *)act);
        } else {
            const StackLinear *l = &L->gate_up;
            /* float32 activations, a packed matrix on a tiled kernel: the product through silu_mul
               tile by tile (the same bits); otherwise the product, then silu_mul */
            const int fused = s->elem == 4 && !l->w16 && !l->bias && s->silu_mul_serial &&
                              (glu_fusion == 2 ||
                               (glu_fusion == 1 && rows * 2 * inter * (int64_t)sizeof(float) >= GLU_FUSION_MIN_BYTES)) &&
                              quant_linear_glu((int)s->isa, l->tiled_min_rows, (int)l->levels, (const float *)x, rows, l->K, l->q, l->d,
                                               l->m, inter, l->Kp, (int)l->bits, (int)l->r, (int32_t)l->zero,
                                               (int)l->lanes, (GluFn)s->silu_mul_serial, (float *)act) == 1;
            if (!fused) {
                ok = stack_linear(s, l, x, rows, gate_up, wide);
                if (ok) ((SiluMulFn)s->silu_mul)(gate_up, rows, inter, act);
            }
        }
        if (!ok) break;
        ok = stack_linear(s, &L->down, act, rows, delta, wide);
    }
    if (!given_scratch) free(scratch);
    return ok;
}

/* out [num, K] float32: weight rows rows[0..num) dequantized (the embedding lookup). */
void quant_dequantize_rows(const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t Kp, int64_t K, int bits,
                           int r, int32_t zero, int lanes, const int64_t *rows, int64_t num, float *out) {
    const int64_t row_bytes = bits == 4 ? Kp / 2 : Kp, scales_per_row = Kp / 32 / r;
    _Pragma("omp parallel for schedule(static) if(num * K >= 65536)")
    for (int64_t i = 0; i < num; i++) {
        const uint16_t *drow = d + rows[i] * scales_per_row, *mrow = m ? m + rows[i] * scales_per_row : 0;
        for (int64_t k = 0; k < K; k++) {
            float w = half_to_float(drow[k / 32 / r]) * (float)(code_at(q, rows[i], k, bits, row_bytes, lanes) - zero);
            if (mrow) w += half_to_float(mrow[k / 32 / r]);
            out[i * K + k] = w;
        }
    }
}
