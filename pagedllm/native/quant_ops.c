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
 *
 * The activations are quantized per 32-block to int8 with a float scale
 * (as llama.cpp's Q8 activations are), so a block's dot product is one
 * integer sum: with AVX-512 VNNI, vpdpbusd multiplies 64 unsigned weight bytes
 * by 64 signed activation bytes per instruction. The per-lane terms (the
 * activation scale of each 4-weight lane, the zero-point correction and the
 * min term) are precomputed once per activation row, so the inner loop has no
 * horizontal sums; one reduction per output.
 *
 * The AVX-512 path is chosen at run time (__builtin_cpu_supports); the
 * portable C path computes the same integer sums in the same order of blocks.
 * Parallel loops use the OpenMP runtime PyTorch has already loaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
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

/* Activation rows, quantized: xq [rows, Kp] int8; per 4-element lane
 * (Kp / 4 of them): dx the block's scale, xs = dx * sum(xq of the lane),
 * xcorr = zero * sum(xq of the lane). Elements k >= K are zero. */
void quantize_activations(const float *x, int64_t rows, int64_t K, int64_t Kp, int32_t zero,
                          int8_t *xq, float *dx, float *xs, int32_t *xcorr) {
    _Pragma("omp parallel for schedule(static) if(rows >= 8)")
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * K;
        int8_t *qr = xq + r * Kp;
        for (int64_t b = 0; b < Kp; b += 32) {
            float amax = 0.0f;
            for (int64_t k = b; k < b + 32 && k < K; k++) amax = fmaxf(amax, fabsf(xr[k]));
            float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int64_t k = b; k < b + 32; k++) qr[k] = k < K ? (int8_t)lrintf(xr[k] * inv) : 0;
            for (int64_t lane = b / 4; lane < (b + 32) / 4; lane++) {
                int32_t sum = qr[4 * lane] + qr[4 * lane + 1] + qr[4 * lane + 2] + qr[4 * lane + 3];
                dx[r * (Kp / 4) + lane] = d;
                xs[r * (Kp / 4) + lane] = d * (float)sum;
                xcorr[r * (Kp / 4) + lane] = zero * sum;
            }
        }
    }
}

/* ------------------------------------------------------------ portable path */

static inline int weight_q(const uint8_t *row, int64_t k, int bits) {
    if (bits == 8) return row[k];
    uint8_t byte = row[(k / 64) * 32 + (k % 32)];
    return (k % 64) < 32 ? (byte & 0x0f) : (byte >> 4);
}

static float dot_portable(const uint8_t *qrow, const uint16_t *drow, const uint16_t *mrow, int64_t Kp,
                          int bits, int r, int32_t zero, const int8_t *xq, const float *dx, const float *xs) {
    float acc = 0.0f;
    for (int64_t b = 0; b < Kp / 32; b++) {
        int32_t dot = 0, xsum = 0;
        for (int64_t k = 32 * b; k < 32 * b + 32; k++) {
            dot += weight_q(qrow, k, bits) * xq[k];
            xsum += xq[k];
        }
        float dw = half_to_float(drow[b / r]);
        acc += dx[8 * b] * dw * (float)(dot - zero * xsum);
        if (mrow) acc += half_to_float(mrow[b / r]) * dx[8 * b] * (float)xsum;
    }
    (void)xs;
    return acc;
}

/* ------------------------------------------------------------ AVX-512 VNNI path */

#ifdef QUANT_X86
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

/* One output: row of weights . one quantized activation row. */
TARGET_VNNI static float dot_vnni(const uint8_t *qrow, const uint16_t *drow, const uint16_t *mrow, int64_t Kp,
                                  int bits, int r, int zero, const int8_t *xq, const float *dx,
                                  const float *xs, const int32_t *xcorr, const __m512i *scale_index) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m512 acc = _mm512_setzero_ps(), acc_min = _mm512_setzero_ps();
    const int64_t num_groups = Kp / 64;            /* 64 weights (two blocks) per step */
    const int64_t groups_per_chunk = 8;            /* 16 blocks per chunk of scales */
    const int64_t num_scales = Kp / 32 / r;
    for (int64_t c = 0; c * groups_per_chunk < num_groups; c++) {
        int64_t first_scale = c * 16 / r, left = num_scales - first_scale;
        int count = left < 16 / r ? (int)left : 16 / r;
        __mmask16 mask = (__mmask16)((1u << count) - 1u);
        __m512 dvec = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, drow + first_scale));
        __m512 mvec = mrow ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mrow + first_scale)) : dvec;
        int64_t end = (c + 1) * groups_per_chunk < num_groups ? (c + 1) * groups_per_chunk : num_groups;
        for (int64_t g = c * groups_per_chunk; g < end; g++) {
            __m512i w;
            if (bits == 4) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(qrow + g * 32));
                __m256i lo = _mm256_and_si256(packed, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
                w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            } else {
                w = _mm512_loadu_si512((const void *)(qrow + g * 64));
            }
            __m512i xv = _mm512_loadu_si512((const void *)(xq + g * 64));
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
            if (zero) dot = _mm512_sub_epi32(dot, _mm512_loadu_si512((const void *)(xcorr + g * 16)));
            __m512i index = scale_index[g - c * groups_per_chunk];
            __m512 dw = _mm512_mul_ps(_mm512_permutexvar_ps(index, dvec), _mm512_loadu_ps(dx + g * 16));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dw, acc);
            if (mrow) acc_min = _mm512_fmadd_ps(_mm512_permutexvar_ps(index, mvec), _mm512_loadu_ps(xs + g * 16), acc_min);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc, acc_min));
}

/* Four outputs: one row of weights . four quantized activation rows (strided by Kp and
 * Kp / 4 lanes); each weight group is unpacked once for the four. */
TARGET_VNNI static void dot4_vnni(const uint8_t *qrow, const uint16_t *drow, const uint16_t *mrow, int64_t Kp,
                                  int bits, int r, int zero, const int8_t *xq, const float *dx,
                                  const float *xs, const int32_t *xcorr, const __m512i *scale_index,
                                  float *out, int64_t out_stride) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const int64_t lanes = Kp / 4;
    __m512 acc[4], acc_min[4];
    for (int i = 0; i < 4; i++) acc[i] = acc_min[i] = _mm512_setzero_ps();
    const int64_t num_groups = Kp / 64, num_scales = Kp / 32 / r;
    for (int64_t c = 0; c * 8 < num_groups; c++) {
        int64_t first_scale = c * 16 / r, left = num_scales - first_scale;
        int count = left < 16 / r ? (int)left : 16 / r;
        __mmask16 mask = (__mmask16)((1u << count) - 1u);
        __m512 dvec = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, drow + first_scale));
        __m512 mvec = mrow ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mrow + first_scale)) : dvec;
        int64_t end = (c + 1) * 8 < num_groups ? (c + 1) * 8 : num_groups;
        for (int64_t g = c * 8; g < end; g++) {
            __m512i w;
            if (bits == 4) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(qrow + g * 32));
                __m256i lo = _mm256_and_si256(packed, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
                w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            } else {
                w = _mm512_loadu_si512((const void *)(qrow + g * 64));
            }
            __m512i index = scale_index[g - c * 8];
            __m512 dw = _mm512_permutexvar_ps(index, dvec);
            __m512 mw = _mm512_permutexvar_ps(index, mvec);
            for (int i = 0; i < 4; i++) {
                __m512i xv = _mm512_loadu_si512((const void *)(xq + i * Kp + g * 64));
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
                if (zero) dot = _mm512_sub_epi32(dot, _mm512_loadu_si512((const void *)(xcorr + i * lanes + g * 16)));
                __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(dx + i * lanes + g * 16));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
                if (mrow) acc_min[i] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(xs + i * lanes + g * 16), acc_min[i]);
            }
        }
    }
    for (int i = 0; i < 4; i++) out[i * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc_min[i]));
}

TARGET_VNNI static void gemm_vnni(const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t N, int64_t Kp,
                                  int bits, int r, int zero, const int8_t *xq, const float *dx, const float *xs,
                                  const int32_t *xcorr, int64_t rows, float *y) {
    /* scale_index[j]: lanes 0-7 take the scale of block 2j of the chunk, lanes 8-15 of block 2j + 1 */
    __m512i scale_index[8];
    for (int j = 0; j < 8; j++) {
        int32_t lanes[16];
        for (int l = 0; l < 16; l++) lanes[l] = (2 * j + l / 8) / r;
        scale_index[j] = _mm512_loadu_si512((const void *)lanes);
    }
    const int64_t row_bytes = bits == 4 ? Kp / 2 : Kp, scales_per_row = Kp / 32 / r, lanes = Kp / 4;
    const int64_t tile = 16; /* output rows per work item: their weights stay in L1 across activation rows */
    const int64_t num_tiles = (N + tile - 1) / tile;
    _Pragma("omp parallel for schedule(static) if(num_tiles > 1 && N * Kp * rows >= 65536)")
    for (int64_t t = 0; t < num_tiles; t++) {
        int64_t n_end = (t + 1) * tile < N ? (t + 1) * tile : N;
        int64_t i = 0;
        for (; i + 4 <= rows; i += 4) {
            for (int64_t n = t * tile; n < n_end; n++) {
                dot4_vnni(q + n * row_bytes, d + n * scales_per_row, m ? m + n * scales_per_row : 0, Kp, bits, r,
                          zero, xq + i * Kp, dx + i * lanes, xs + i * lanes, xcorr + i * lanes, scale_index,
                          y + i * N + n, N);
            }
        }
        for (; i < rows; i++) {
            for (int64_t n = t * tile; n < n_end; n++) {
                y[i * N + n] = dot_vnni(q + n * row_bytes, d + n * scales_per_row, m ? m + n * scales_per_row : 0,
                                        Kp, bits, r, zero, xq + i * Kp, dx + i * lanes, xs + i * lanes,
                                        xcorr + i * lanes, scale_index);
            }
        }
    }
}
#endif

/* 2: AVX-512 VNNI, 0: portable C. */
int quant_isa(void) {
#ifdef QUANT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return 2;
#endif
    return 0;
}

/* y [rows, N] float32 = quantized activations [rows, Kp] . weights [N, Kp]^T.
 * isa: 2 (AVX-512 VNNI, only where quant_isa() says so) or 0 (portable). */
void quant_gemm(int isa, const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t N, int64_t Kp, int bits,
                int r, int32_t zero, const int8_t *xq, const float *dx, const float *xs, const int32_t *xcorr,
                int64_t rows, float *y) {
#ifdef QUANT_X86
    if (isa == 2) {
        gemm_vnni(q, d, m, N, Kp, bits, r, zero, xq, dx, xs, xcorr, rows, y);
        return;
    }
#endif
    const int64_t row_bytes = bits == 4 ? Kp / 2 : Kp, scales_per_row = Kp / 32 / r;
    _Pragma("omp parallel for schedule(static) if(N * Kp * rows >= 65536)")
    for (int64_t n = 0; n < N; n++) {
        for (int64_t i = 0; i < rows; i++) {
            y[i * N + n] = dot_portable(q + n * row_bytes, d + n * scales_per_row, m ? m + n * scales_per_row : 0,
                                        Kp, bits, r, zero, xq + i * Kp, dx + i * (Kp / 4), xs + i * (Kp / 4));
        }
    }
}

/* quantize_activations then quant_gemm, scratch from the heap: one call per matmul. */
void quant_linear(int isa, const float *x, int64_t rows, int64_t K, const uint8_t *q, const uint16_t *d,
                  const uint16_t *m, int64_t N, int64_t Kp, int bits, int r, int32_t zero, float *y) {
    int64_t lanes = Kp / 4;
    char *scratch = malloc((size_t)(rows * Kp + rows * lanes * 12));
    int8_t *xq = (int8_t *)scratch;
    float *dx = (float *)(scratch + rows * Kp), *xs = dx + rows * lanes;
    int32_t *xcorr = (int32_t *)(xs + rows * lanes);
    quantize_activations(x, rows, K, Kp, zero, xq, dx, xs, xcorr);
    quant_gemm(isa, q, d, m, N, Kp, bits, r, zero, xq, dx, xs, xcorr, rows, y);
    free(scratch);
}

/* out [num, K] float32: weight rows rows[0..num) dequantized (the embedding lookup). */
void quant_dequantize_rows(const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t Kp, int64_t K, int bits,
                           int r, int32_t zero, const int64_t *rows, int64_t num, float *out) {
    const int64_t row_bytes = bits == 4 ? Kp / 2 : Kp, scales_per_row = Kp / 32 / r;
    _Pragma("omp parallel for schedule(static) if(num * K >= 65536)")
    for (int64_t i = 0; i < num; i++) {
        const uint8_t *qrow = q + rows[i] * row_bytes;
        const uint16_t *drow = d + rows[i] * scales_per_row, *mrow = m ? m + rows[i] * scales_per_row : 0;
        for (int64_t k = 0; k < K; k++) {
            float w = half_to_float(drow[k / 32 / r]) * (float)(weight_q(qrow, k, bits) - zero);
            if (mrow) w += half_to_float(mrow[k / 32 / r]);
            out[i * K + k] = w;
        }
    }
}
