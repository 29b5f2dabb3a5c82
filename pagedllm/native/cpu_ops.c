/* Native CPU kernels of pagedllm: paged attention that reads K/V through the
 * block table in place, and the element-wise work of a decoder layer (the
 * "layer ops" further down).
 *
 * Built by cpu_ops.py with the system C compiler on first use and called
 * through ctypes; no PyTorch headers. Parallel loops use the OpenMP runtime
 * PyTorch has already loaded, so the two share one thread pool.
 *
 * One source, one shared object per instruction set: cpu_ops.py compiles this
 * file once per ISA path (scalar, avx2 = AVX2 + FMA, avx512 = AVX-512 F/BW/VL/DQ,
 * avx512_bf16 = avx512 plus the bf16 dot-product and conversion instructions)
 * and loads the best one the CPU reports, or the one PAGEDLLM_CPU_ISA names.
 * The vector kernels are written once against a small set of vector
 * primitives (vf, a register of VW floats), defined below for AVX-512
 * (VW = 16) and AVX2 (VW = 8); CPUs with neither get the scalar kernels.
 *
 * The unit of attention work is a tile: up to a few consecutive query tokens
 * of one sequence (a decode token is a tile of one) against one KV head. Row
 * i of a tile attends to the first len0 + i tokens of its sequence, which is
 * the causal mask for prefill tokens and the whole context for a decode
 * token. All query heads that share the KV head are computed together, so
 * each K/V row is read once per tile.
 *
 * Keys are taken VW tokens at a time, transposed in registers into
 * [head_dim][VW], so every query row's VW scores come out of one chain of
 * fused multiply-adds with no horizontal sums; softmax is online in float32.
 *
 * Caches: [num_blocks, block_size, num_kv_heads, head_dim] (KV_LAYOUT_TOKEN; or
 * KV_LAYOUT_HEAD, below, where each head's part of a block is contiguous), float32 or
 * bfloat16 (query and output in the cache's dtype), or 8-bit codes (int8,
 * fp8 e4m3, fp8 e5m2) with one float16 scale per slot and KV head
 * [num_blocks, block_size, num_kv_heads] (query and output float32 or
 * bfloat16). Codes are dequantized inside the tile: a key's scale multiplies
 * its score (q . (c s) = (q . c) s) and a value's scale its softmax weight,
 * so the per-element work is only the code-to-float conversion. Quantizing
 * on write follows pagedllm/kv/kv_format.py exactly. Arithmetic is float32.
 */
#define _GNU_SOURCE 1 /* syscall() for the AMX permission request, declared only in GNU mode */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "work_share.h"

/* The same limits are in cpu_ops.py, which sizes the tiles. */
#define MAX_HEAD_DIM 256
#define MAX_ROWS 64        /* query rows (tile tokens x heads per KV head) in a tile */
#define MAX_ROW_FLOATS 8192 /* rows x head_dim must fit: 64 x 128 or 32 x 256 */
/* below this a parallel region costs more than it saves: a 64-row decode step's norms (36,864
   elements), rotary and Hadamard rotations split over 2 threads measured 2-4% faster on W64 than
   on the calling thread alone (the threshold was 65,536); row-wise ops, so the same bits */
#define PARALLEL_MIN_ELEMENTS 16384

/* Where a block's elements lie, for a block of B slots, KH KV heads of D dims. KV_LAYOUT_TOKEN:
   K and V both [B][KH][D] (a slot's heads side by side). KV_LAYOUT_HEAD: K [KH][D][B] (a
   head's keys of the block transposed, dims by tokens) and V [KH][B][D]. With the second the
   vector tiles read keys as they use them, VW tokens of one dim per load, with no transposes,
   and a head's values as one run: decode attention streamed from memory read 20-24 GB/s
   against 15-17 on AMD Zen 3, 2 threads (docs/profile.md, twelfth round). The scores are
   the same sums in the same order, so the two layouts give the same bits. The scales of
   8-bit caches stay [B][KH] in both. */
#define KV_LAYOUT_TOKEN 0
#define KV_LAYOUT_HEAD 1
/* offset of slot `slot`'s key (first dim) / value row of head h */
static inline int64_t key_at(int64_t slot, int64_t h, int64_t KH, int64_t D, int64_t B, int32_t layout) {
    return layout ? ((slot / B) * KH + h) * D * B + slot % B : (slot * KH + h) * D;
}
static inline int64_t value_at(int64_t slot, int64_t h, int64_t KH, int64_t D, int64_t B, int32_t layout) {
    return layout ? (((slot / B) * KH + h) * B + slot % B) * D : (slot * KH + h) * D;
}

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16) does. */
static inline bf16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_t)(bits >> 16);
}

static inline float f32_identity(float x) { return x; }
static inline uint32_t f32_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}
static inline float bits_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ------------------------------------------------------------------ 8-bit KV codes
 *
 * kv8_t holds one code of any 8-bit format. A scale is a float16 (its bits in a
 * uint16_t): F16C converts it where the build has it, the portable code below
 * otherwise (round to nearest even, as torch's .to(torch.float16)).
 */
typedef uint8_t kv8_t;

#ifdef __F16C__
#include <immintrin.h>
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f32_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13)); /* inf, NaN */
    if (exp == 0) { /* subnormal: mant * 2^-24, exact in float32 */
        const float m = (float)mant * 0x1p-24f;
        return sign ? -m : m;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}
static inline uint16_t f32_to_f16(float f) {
    uint32_t a = f32_bits(f);
    const uint16_t sign = (uint16_t)((a >> 16) & 0x8000u);
    a &= 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;                  /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u;                 /* 65520 and up round to inf */
    if (a < 0x38800000u) /* below 2^-14: a subnormal, steps of 2^-24 = the ulp of 0.5f */
        return sign | (uint16_t)(f32_bits(bits_f32(a) + 0.5f) - 0x3f000000u);
    a += 0xfffu + ((a >> 13) & 1u);
    return sign | (uint16_t)((a >> 13) - (112u << 10));
}
#endif

#define MIN_SCALE_F16 0x0400u /* 2^-14, the smallest positive normal float16 */

/* Codes from float32 values already clamped to [-QMAX, QMAX]: int8 rounds half
   to even (rintf in the default rounding mode), fp8 to nearest even as torch's
   .to(float8). fp8 subnormals are rounded by one float32 addition whose ulp is
   the format's subnormal step. */
static inline kv8_t encode_i8(float v) { return (kv8_t)(int8_t)rintf(v); }
static inline kv8_t encode_e4m3(float v) {
    const uint32_t bits = f32_bits(v), sign = (bits >> 24) & 0x80u, a = bits & 0x7fffffffu;
    const uint32_t code = a < 0x3c800000u /* 2^-6 */
        ? f32_bits(bits_f32(a) + 16384.0f) - 0x46800000u /* 2^14: ulp 2^-9 */
        : ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    return (kv8_t)(sign | code);
}
static inline kv8_t encode_e5m2(float v) {
    const uint32_t bits = f32_bits(v), sign = (bits >> 24) & 0x80u, a = bits & 0x7fffffffu;
    const uint32_t code = a < 0x38800000u /* 2^-14 */
        ? f32_bits(bits_f32(a) + 128.0f) - 0x43000000u /* 2^7: ulp 2^-16 */
        : ((a + 0xfffffu + ((a >> 21) & 1u)) >> 21) - (112u << 2);
    return (kv8_t)(sign | code);
}

/* Code to float, up to the format's UNIT: e5m2 is the high byte of a float16;
   e4m3 shifted into a float16 is its value times 2^-8 (subnormals included),
   so its scales are multiplied by E4M3_UNIT = 2^8 instead of every code. */
#define I8_UNIT 1.0f
#define E5M2_UNIT 1.0f
#define E4M3_UNIT 256.0f
static inline float decode_i8(kv8_t c) { return (float)(int8_t)c; }
static inline float decode_e5m2(kv8_t c) { return f16_to_f32((uint16_t)((uint16_t)c << 8)); }
static inline uint16_t e4m3_f16_bits(kv8_t c) { return (uint16_t)(((c & 0x80u) << 8) | ((c & 0x7fu) << 7)); }
static inline float decode_e4m3(kv8_t c) { return f16_to_f32(e4m3_f16_bits(c)); }
static inline float silu_f32(float x) { return x / (1.0f + expf(-x)); }
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* One tile: which sequence, which query rows, how far row 0 sees. */
typedef struct {
    int32_t table_row; /* row of the block-table tensor */
    int32_t q_row;     /* first query row of the tile */
    int32_t len0;      /* row i attends to tokens [0, len0 + i) */
    int32_t rows;      /* query tokens in the tile */
} tile_t;

/* ------------------------------------------------------------------ vector primitives
 *
 * vf: VW float lanes; vmask: a lane predicate. Loads and stores named *n take
 * the number of elements left (at least 1); lanes past it read as zero and
 * are not written. vstore*_bf16 round to nearest even.
 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define VW 16
#ifdef __AVX512BF16__
#define ISA_NAME "avx512_bf16"
#else
#define ISA_NAME "avx512"
#endif
typedef __m512 vf;
typedef __mmask16 vmask;

static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vload(const float *p) { return _mm512_load_ps(p); } /* 64-byte aligned */
static inline void vstore(float *p, vf v) { _mm512_store_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vabs(vf a) { return _mm512_abs_ps(a); }
/* 16 whole-number floats in [-128, 127] -> 16 int8 codes */
static inline void vstore_i8(kv8_t *p, vf v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vround_int(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf k) { return _mm512_scalef_ps(p, k); } /* p * 2^k */
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vmaxall(vf v) { return _mm512_reduce_max_ps(v); }
static inline vmask vfirst(int64_t n) {
    return n >= 16 ? (vmask)0xffff : n <= 0 ? (vmask)0 : (vmask)((1u << n) - 1u);
}
static inline vf vselect(vmask m, vf a, vf b) { return _mm512_mask_blend_ps(m, b, a); }
static inline vmask vcmpeq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline int vmask_bits(vmask m) { return (int)m; }

static inline vf vloadu_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstoreu_f32(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vloadn_f32(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(vfirst(n), p); }
static inline void vstoren_f32(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, vfirst(n), v); }
static inline vf vloadn_bf16(const bf16_t *p, int64_t n) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(vfirst(n), p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline vf vloadu_bf16(const bf16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
/* 16 dwords, each two bf16 (the first in the low half) -> the first and the second as floats */
static inline void split_bf16_pairs(vf pairs, vf out[2]) {
    const __m512i bits = _mm512_castps_si512(pairs);
    out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    out[1] = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xffff0000u)));
}
#ifdef __AVX512BF16__
/* the hardware conversion: round to nearest even, NaN kept quiet */
static inline __m256i bf16_bits(vf v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
static inline __m256i bf16_bits(vf v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}
#endif
static inline vf vround_bf16(vf v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}
static inline void vstoreu_bf16(bf16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, bf16_bits(v)); }
static inline void vstoren_bf16(bf16_t *p, vf v, int64_t n) { _mm256_mask_storeu_epi16(p, vfirst(n), bf16_bits(v)); }

/* 16 dwords, each four int8 codes -> the codes as floats, first code first */
static inline void split_i8_quads(vf quads, vf out[4]) {
    const __m512i bits = _mm512_castps_si512(quads);
    for (int b = 0; b < 4; ++b)
        out[b] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(bits, 24 - 8 * b), 24));
}
/* 16 codes -> 16 floats (up to the format's unit) */
static inline vf vloadu_i8(const kv8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vloadu_e5m2(const kv8_t *p) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
}
/* e4m3: sign-extend each byte to 16 bits and shift left by 7; bit 15 is then the
   sign, bits 7-13 the magnitude, and bit 14 (a copy of the sign) is cleared */
static inline vf vloadu_e4m3(const kv8_t *p) {
    const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16((short)0xbf80)));
}

/* r[j] (row j, 16 floats) becomes column j of the 16 x 16 matrix. */
static inline void vtranspose(vf r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    /* now lane L of r[4i + j] holds column j + 4L of rows 4i .. 4i + 3 */
    for (int j = 0; j < 4; ++j) {
        u[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        u[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        u[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        u[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm512_shuffle_f32x4(u[j], u[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(u[j], u[8 + j], 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(u[4 + j], u[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(u[4 + j], u[12 + j], 0xdd);
    }
}

/* The Walsh-Hadamard butterflies of strides 8, 4, 2, 1 within one register: lane i gets
   x[i] + x[i ^ h] where bit h of i is clear, x[i ^ h] - x[i] where it is set (each the
   same single add or subtract as the scalar butterfly). */
static inline vf vhadamard_lanes(vf x) {
    static const int hs[4] = {8, 4, 2, 1};
    static const __mmask16 high[4] = {0xff00, 0xf0f0, 0xcccc, 0xaaaa};
    for (int s = 0; s < 4; ++s) {
        const __m512i swap = _mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(hs[s]));
        const vf partner = _mm512_permutexvar_ps(swap, x);
        x = _mm512_mask_sub_ps(_mm512_add_ps(x, partner), high[s], partner, x);
    }
    return x;
}

/* Rows of the value accumulator a pass keeps in registers (32 of them). */
#define PASS_ROWS(CH) ((CH) <= 4 ? 4 : 2)

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
#define ISA_NAME "avx2"
typedef __m256 vf;
typedef __m256 vmask; /* all-ones lanes are true */

static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vload(const float *p) { return _mm256_load_ps(p); } /* 32-byte aligned */
static inline void vstore(float *p, vf v) { _mm256_store_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
/* 8 whole-number floats in [-128, 127] -> 8 int8 codes */
static inline void vstore_i8(kv8_t *p, vf v) {
    const __m256i w = _mm256_cvtps_epi32(v);
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(h, h));
}
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vround_int(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf k) { /* p * 2^k for integral k in [-126, 128] (128 gives inf) */
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
static inline float vsum(vf v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}
static inline float vmaxall(vf v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}
static inline vmask vfirst(int64_t n) {
    const int32_t k = n >= 8 ? 8 : n <= 0 ? 0 : (int32_t)n;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
static inline vf vselect(vmask m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); }
static inline vmask vcmpeq(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
static inline int vmask_bits(vmask m) { return _mm256_movemask_ps(m); }

static inline vf vloadu_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstoreu_f32(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vloadn_f32(const float *p, int64_t n) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, _mm256_castps_si256(vfirst(n)));
}
static inline void vstoren_f32(float *p, vf v, int64_t n) {
    if (n >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, _mm256_castps_si256(vfirst(n)), v);
}
static inline vf vloadu_bf16(const bf16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
/* 8 dwords, each four int8 codes -> the codes as floats, first code first */
static inline void split_i8_quads(vf quads, vf out[4]) {
    const __m256i bits = _mm256_castps_si256(quads);
    for (int b = 0; b < 4; ++b)
        out[b] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(bits, 24 - 8 * b), 24));
}
/* 8 dwords, each two bf16 (the first in the low half) -> the first and the second as floats */
static inline void split_bf16_pairs(vf pairs, vf out[2]) {
    const __m256i bits = _mm256_castps_si256(pairs);
    out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    out[1] = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline vf vloadn_bf16(const bf16_t *p, int64_t n) {
    if (n >= 8) return vloadu_bf16(p);
    bf16_t part[8] = {0};
    memcpy(part, p, (size_t)n * sizeof(bf16_t));
    return vloadu_bf16(part);
}
static inline __m128i bf16_bits(vf v) { /* eight bf16 values, rounded to nearest even */
    __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    /* pack within 128-bit lanes, then bring the two lanes' halves together */
    const __m256i packed = _mm256_packus_epi32(bits, _mm256_setzero_si256());
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
static inline vf vround_bf16(vf v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits(v)), 16));
}
static inline void vstoreu_bf16(bf16_t *p, vf v) { _mm_storeu_si128((__m128i *)p, bf16_bits(v)); }
static inline void vstoren_bf16(bf16_t *p, vf v, int64_t n) {
    if (n >= 8) {
        vstoreu_bf16(p, v);
        return;
    }
    bf16_t part[8];
    vstoreu_bf16(part, v);
    memcpy(p, part, (size_t)n * sizeof(bf16_t));
}

/* 8 codes -> 8 floats (up to the format's unit) */
static inline vf vloadu_i8(const kv8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vloadu_e5m2(const kv8_t *p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
}
static inline vf vloadu_e4m3(const kv8_t *p) { /* as the AVX-512 version */
    const __m128i c = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(c, 7), _mm_set1_epi16((short)0xbf80)));
}

/* r[j] (row j, 8 floats) becomes column j of the 8 x 8 matrix. */
static inline void vtranspose(vf r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    /* u[j] holds column j of rows 0-3 (low lane) and column j + 4 (high lane); u[4 + j] rows 4-7 */
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
}

/* Rows of the value accumulator a pass keeps in registers (16 of them). */
#define PASS_ROWS(CH) ((CH) <= 2 ? 4 : (CH) <= 4 ? 2 : 1)

/* As the AVX-512 version, strides 4, 2, 1. */
static inline vf vhadamard_lanes(vf x) {
    static const int hs[3] = {4, 2, 1};
    for (int s = 0; s < 3; ++s) {
        const __m256i swap = _mm256_xor_si256(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(hs[s]));
        const vf partner = _mm256_permutevar8x32_ps(x, swap);
        const vf sum = _mm256_add_ps(x, partner), diff = _mm256_sub_ps(partner, x);
        x = s == 0 ? _mm256_blend_ps(sum, diff, 0xf0) : s == 1 ? _mm256_blend_ps(sum, diff, 0xcc)
                                                               : _mm256_blend_ps(sum, diff, 0xaa);
    }
    return x;
}

#else
#define VW 1
#define ISA_NAME "scalar"
#endif

#if VW > 1 /* ------------------------------------------------------------ vector kernels */

#define CH_MAX (MAX_HEAD_DIM / VW)

/* exp(x) for x <= 0 (softmax arguments): 2^k * e^f, f in [-ln2/2, ln2/2], with the Taylor
   polynomial of e^f to the given degree (a constant: the loop unrolls). */
static inline __attribute__((always_inline)) vf vexp_degree(vf x, const int degree) {
    static const float coef[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    x = vmax(x, vset1(-87.0f));
    const vf t = vmul(x, vset1(1.44269504088896341f));
    const vf k = vround_int(t);
    const vf f = vmul(vsub(t, k), vset1(0.693147180559945f));
    vf p = vset1(coef[6 - degree]);
    for (int i = 7 - degree; i < 7; ++i) p = vfmadd(p, f, vset1(coef[i]));
    return vscale2(p, k);
}

/* degree 6: relative error below 3e-7 */
static inline vf vexp(vf x) { return vexp_degree(x, 6); }

/* degree 4: within 6e-5 relative. For the tile kernels' softmax weights, which enter the
   value product rounded to bfloat16 (2e-3), so the shorter polynomial costs no accuracy
   that survives the rounding. */
static inline vf vexp4(vf x) { return vexp_degree(x, 4); }

static inline vf vexp_any(vf x) { /* exp for any x: overflow gives inf, underflow 0 */
    return vexp(vmin(x, vset1(88.7f)));
}

/* Keys go through the online softmax NSUB chunks (of up to VW tokens each, one
   block's) at a time: one max and one sum per row per NSUB * VW keys, and each
   query broadcast feeds NSUB fused multiply-adds. QK_ROWS query rows' scores
   stay in registers together (QK_ROWS * NSUB accumulators). Every tile, a
   decode token's too, takes NSUB = SUB (DISPATCH_CH below): the grouping sets
   where the softmax rescales, so one NSUB for all tiles keeps a row's bits the
   same in any tile. On AVX2, 3 rows (a KV head's 3 query heads in SmolLM2-like
   models in one pass): 12 accumulators, the 3 broadcasts and one key vector
   fill the 16 registers, so the keys are loaded one chunk at a time (score_rows);
   2 rows left the third row's pass with 4 dependent FMA chains (AMD Zen 3: in
   L2 25.5 -> 28.0 GB/s, streamed 23.7-24.8 -> 25.1-25.4). */
#define SUB 4
#if VW == 16
#define QK_ROWS 4
#else
#ifndef QK_ROWS /* benchmarks may set another */
#define QK_ROWS 3
#endif
#endif
#define P_STRIDE (SUB * VW) /* floats per row of P */
/* The next chunks' K/V rows are prefetched into L2, not L1: a group of chunks ahead
   is up to 32 KB per head for K and V, as much as L1 holds, so lines prefetched
   into L1 were evicted before use; into L2 the hardware brings them the last step
   (decode 64 x 340, fp32, AMD Zen 4: 13-14 -> 16-18 GB/s). */
#define PF_HINT _MM_HINT_T1

/* acc[r] = acc[r] * corr[r] + sum_t P[r][t] V[t] for NR rows from row r0, the
   tokens t of SUB chunks (ns[c] of them from vbs[c]; ns[c] = 0 past the last).
   NR and CH are compile-time constants at every call, so a[][] lives in
   registers and each V row is loaded once for all NR rows. The first
   prefetch_rows[c] rows of pf[c] (the next chunks' values) are prefetched. */
#define DEFINE_ACCUMULATE_V(NAME, T, LOADV)                                                       \
static inline __attribute__((always_inline)) void NAME(                                           \
    float *acc, const float *P, const float *corr, const T *const *vbs, const int64_t *ns,       \
    const int NSUB, int64_t tok_stride, int64_t r0, const int NR, const int CH,                   \
    const char *const *pf,                                                                        \
    const int64_t *prefetch_rows, int64_t stride_bytes, int64_t row_bytes) {                      \
    const int64_t D = VW * CH;                                                                    \
    vf a[4][CH_MAX];                                                                              \
    for (int j = 0; j < NR; ++j) {                                                                \
        const vf scale = vset1(corr[r0 + j]);                                                     \
        for (int c = 0; c < CH; ++c) a[j][c] = vmul(vload(acc + (r0 + j) * D + VW * c), scale);   \
    }                                                                                             \
    for (int sub = 0; sub < NSUB; ++sub) {                                                        \
        const T *vb = vbs[sub];                                                                   \
        for (int64_t t = 0; t < ns[sub]; ++t) {                                                   \
            const T *vrow = vb + t * tok_stride;                                                  \
            if (t < prefetch_rows[sub])                                                           \
                for (int64_t byte = 0; byte < row_bytes; byte += 64)                              \
                    _mm_prefetch(pf[sub] + t * stride_bytes + byte, PF_HINT);                 \
            vf p[4];                                                                              \
            for (int j = 0; j < NR; ++j) p[j] = vset1(P[(r0 + j) * P_STRIDE + sub * VW + t]);     \
            for (int c = 0; c < CH; ++c) {                                                        \
                const vf v = LOADV(vrow + VW * c);                                                \
                for (int j = 0; j < NR; ++j) a[j][c] = vfmadd(p[j], v, a[j][c]);                  \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (int j = 0; j < NR; ++j)                                                                  \
        for (int c = 0; c < CH; ++c) vstore(acc + (r0 + j) * D + VW * c, a[j][c]);                \
}
DEFINE_ACCUMULATE_V(accumulate_v_f32, float, vloadu_f32)
DEFINE_ACCUMULATE_V(accumulate_v_bf16, bf16_t, vloadu_bf16)
DEFINE_ACCUMULATE_V(accumulate_v_i8, kv8_t, vloadu_i8)
DEFINE_ACCUMULATE_V(accumulate_v_e4m3, kv8_t, vloadu_e4m3)
DEFINE_ACCUMULATE_V(accumulate_v_e5m2, kv8_t, vloadu_e5m2)

/* bfloat16 caches where the CPU has vdpbf16ps (the avx512_bf16 path): scores and value
   products on bfloat16 pairs, two multiply-adds per float32 lane and instruction. Scores: the
   query's raw bfloat16 pairs against the keys' pairs of dims (2j, 2j + 1), VW tokens per
   vector (the token layout's dword transposes, the head layout's two dim rows interleaved: the
   same vectors), float32 sums, the scale applied to the sum. Values: the softmax weights
   rounded to bfloat16 (as PyTorch's CPU flash attention does for bfloat16 inputs) in pairs of
   tokens, against the two tokens' value rows interleaved by dim (unpacklo / unpackhi of 16-bit
   words), so the accumulators hold each 32 dims in the order of those unpacks until the tile
   ends (unpermute_pairs). Every tile of a bfloat16 cache on this path takes it, prefill or
   decode, either layout: a row's bits stay the same in any tile. On AMD Zen 5 vdpbf16ps issues
   as often as an FMA, so the multiply-adds halve (docs/profile.md, eighteenth round). */
#if VW == 16 && defined(__AVX512BF16__)
#define DP_BF16 1
#else
#define DP_BF16 0
#endif
/* acc[r] = acc[r] * corr[r] + sum_t PB[r][t] V[t], as DEFINE_ACCUMULATE_V with the weights in
   bfloat16 (PB) and two tokens per vdpbf16ps; acc in the pair order (above). */
static inline __attribute__((always_inline)) void accumulate_v_bf16_dp(
    float *acc, const bf16_t *PB, const float *corr, const bf16_t *const *vbs, const int64_t *ns,
    const int NSUB, int64_t tok_stride, int64_t r0, const int NR, const int CH,
    const char *const *pf, const int64_t *prefetch_rows, int64_t stride_bytes, int64_t row_bytes) {
#if DP_BF16
    const int64_t D = VW * CH;
    vf a[4][CH_MAX];
    for (int j = 0; j < NR; ++j) {
        const vf scale = vset1(corr[r0 + j]);
        for (int c = 0; c < CH; ++c) a[j][c] = vmul(vload(acc + (r0 + j) * D + VW * c), scale);
    }
    for (int sub = 0; sub < NSUB; ++sub) {
        const bf16_t *vb = vbs[sub];
        for (int64_t t = 0; t < ns[sub]; t += 2) {
            const bf16_t *v0 = vb + t * tok_stride, *v1 = v0 + tok_stride;
            const int pair = t + 1 < ns[sub]; /* an odd chunk's last token pairs with zeros */
            for (int64_t u = t; u < t + 2 && u < prefetch_rows[sub]; ++u)
                for (int64_t byte = 0; byte < row_bytes; byte += 64)
                    _mm_prefetch(pf[sub] + u * stride_bytes + byte, PF_HINT);
            __m512i p[4];
            for (int j = 0; j < NR; ++j) {
                int32_t w;
                memcpy(&w, PB + (r0 + j) * P_STRIDE + sub * VW + t, sizeof w);
                p[j] = _mm512_set1_epi32(w);
            }
            for (int c2 = 0; c2 < CH / 2; ++c2) {
                const __m512i x = _mm512_loadu_si512((const void *)(v0 + 2 * VW * c2));
                const __m512i y = pair ? _mm512_loadu_si512((const void *)(v1 + 2 * VW * c2)) : _mm512_setzero_si512();
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
                for (int j = 0; j < NR; ++j) {
                    a[j][2 * c2] = _mm512_dpbf16_ps(a[j][2 * c2], lo, (__m512bh)p[j]);
                    a[j][2 * c2 + 1] = _mm512_dpbf16_ps(a[j][2 * c2 + 1], hi, (__m512bh)p[j]);
                }
            }
        }
    }
    for (int j = 0; j < NR; ++j)
        for (int c = 0; c < CH; ++c) vstore(acc + (r0 + j) * D + VW * c, a[j][c]);
#else
    (void)acc, (void)PB, (void)corr, (void)vbs, (void)ns, (void)NSUB, (void)tok_stride, (void)r0, (void)NR;
    (void)CH, (void)pf, (void)prefetch_rows, (void)stride_bytes, (void)row_bytes;
#endif
}
/* A row of accumulators in the pair order -> dims in order (each 32 dims: unpacklo's lanes hold
   dims 8L .. 8L + 3, unpackhi's 8L + 4 .. 8L + 7) */
static inline void unpermute_pairs(float *row, const int CH) {
#if DP_BF16
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int c2 = 0; c2 < CH / 2; ++c2) {
        const vf lo = vload(row + 2 * VW * c2), hi = vload(row + 2 * VW * c2 + VW);
        vstore(row + 2 * VW * c2, _mm512_permutex2var_ps(lo, first, hi));
        vstore(row + 2 * VW * c2 + VW, _mm512_permutex2var_ps(lo, second, hi));
    }
#else
    (void)row, (void)CH;
#endif
}
/* Two rows of VW bfloat16 keys (dims 2j and 2j + 1 of VW tokens) -> VW dwords, dim 2j in the
   low half: what the token layout's dword transposes give */
static inline vf interleave_bf16_rows(const bf16_t *even, const bf16_t *odd, int64_t n) {
#if DP_BF16
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(vfirst(n), even));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(vfirst(n), odd));
    return _mm512_castsi512_ps(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
#else
    (void)even, (void)odd, (void)n;
    return vzero();
#endif
}

/* Scores of NR query rows from row r against the SUB transposed key chunks
   KTs[sub] ([d][VW], rows kstr[sub] floats apart), then their online-softmax update: P[row] gets the weights
   (times V's scales when quant), corr[row] the factor acc[row] takes.
   visible0 = what row 0 of the tile sees from the chunks' first key on. */
static inline __attribute__((always_inline)) void score_rows(
    const float *Q, const float *const *KTs, const int64_t *kstr, const int CH, const int NSUB, int64_t r,
    const int NR, int64_t G,
    int64_t visible0, const int64_t *ns, const int64_t *offs, const int quant, const float *KS,
    const float *VS, float *run_max, float *run_sum, float *corr, float *P,
    const int dp, const uint32_t *QP, vf vscale, bf16_t *PB) {
    const int64_t D = VW * CH;
    vf s[4][SUB]; /* NR <= QK_ROWS <= 4 */
    for (int j = 0; j < NR; ++j)
        for (int sub = 0; sub < NSUB; ++sub) s[j][sub] = vzero();
#if DP_BF16
    if (dp) { /* the raw query pairs (QP, [rows][D / 2]) against KTs' pairs ([D / 2][VW] dwords) */
        for (int64_t i = 0; i < D / 2; ++i) {
            __m512bh q[4];
            for (int j = 0; j < NR; ++j) q[j] = (__m512bh)_mm512_set1_epi32((int)QP[(r + j) * (D / 2) + i]);
            for (int sub = 0; sub < NSUB; ++sub) {
                const __m512bh k = (__m512bh)_mm512_castps_si512(vload(KTs[sub] + i * VW));
                for (int j = 0; j < NR; ++j) s[j][sub] = _mm512_dpbf16_ps(s[j][sub], k, q[j]);
            }
        }
        for (int j = 0; j < NR; ++j)
            for (int sub = 0; sub < NSUB; ++sub) s[j][sub] = vmul(s[j][sub], vscale);
    } else
#else
    (void)dp, (void)QP, (void)vscale, (void)PB;
#endif
    for (int64_t d = 0; d < D; ++d) {
        vf q[4];
        for (int j = 0; j < NR; ++j) q[j] = vset1(Q[(r + j) * D + d]);
        for (int sub = 0; sub < NSUB; ++sub) {
            const vf k = vload(KTs[sub] + d * kstr[sub]);
            for (int j = 0; j < NR; ++j) s[j][sub] = vfmadd(q[j], k, s[j][sub]);
        }
    }
    for (int j = 0; j < NR; ++j) {
        const int64_t row = r + j, visible = visible0 + row / G;
        vmask mask[SUB];
        vf top = vset1(-INFINITY);
        for (int sub = 0; sub < NSUB; ++sub) {
            int64_t seen = visible - offs[sub];
            if (seen > ns[sub]) seen = ns[sub];
            mask[sub] = vfirst(seen);
            if (quant) s[j][sub] = vmul(s[j][sub], vload(KS + sub * VW));
            top = vmax(top, vselect(mask[sub], s[j][sub], vset1(-INFINITY)));
        }
        const float block_max = vmaxall(top);
        const float new_max = block_max > run_max[row] ? block_max : run_max[row];
        corr[row] = expf(run_max[row] - new_max);
        const vf shift = vset1(new_max);
        vf sum = vzero();
        for (int sub = 0; sub < NSUB; ++sub) {
            const vf p = vselect(mask[sub], vexp(vsub(s[j][sub], shift)), vzero());
            sum = vadd(sum, p);
#if DP_BF16
            if (dp) {
                _mm256_store_si256((__m256i *)(PB + row * P_STRIDE + sub * VW), bf16_bits(p));
                continue;
            }
#endif
            vstore(P + row * P_STRIDE + sub * VW, quant ? vmul(p, vload(VS + sub * VW)) : p);
        }
        run_sum[row] = run_sum[row] * corr[row] + vsum(sum);
        run_max[row] = new_max;
    }
}

/* The chunk of keys from position pos of a block table: at most VW tokens, all
   in one block, none at or past max_len. Returns its length; *slot gets its
   first slot. */
static inline int64_t key_chunk(const int32_t *table, int64_t pos, int64_t max_len, int64_t block_size,
                                int64_t *slot) {
    const int64_t offset = pos % block_size;
    *slot = (int64_t)table[pos / block_size] * block_size + offset;
    int64_t n = block_size - offset;
    if (n > VW) n = VW;
    if (n > max_len - pos) n = max_len - pos;
    return n;
}

/* One value pass of the tile below: FN over the pass's rows from r (a constant count each),
   weights W (float32 P, or the pair kernels' bfloat16 PB), value rows VB. */
#define V_PASS(FN, W, VB)                                                                         \
    switch (R - r < per_pass ? (int)(R - r) : per_pass) {                                         \
    case 4: FN(acch, W, corr, VB, ns, NSUB, v_tok, r, 4, CH, nv, pf, v_stride_bytes, row_bytes); break; \
    case 3: FN(acch, W, corr, VB, ns, NSUB, v_tok, r, 3, CH, nv, pf, v_stride_bytes, row_bytes); break; \
    case 2: FN(acch, W, corr, VB, ns, NSUB, v_tok, r, 2, CH, nv, pf, v_stride_bytes, row_bytes); break; \
    default: FN(acch, W, corr, VB, ns, NSUB, v_tok, r, 1, CH, nv, pf, v_stride_bytes, row_bytes); break; \
    }

/* PAIRS (a constant): how many key codes one dword of the cache holds where the key
   transpose moves them raw and converts after (2: bf16, 4: int8; 1: converted on load). */

/* The tile kernel. CH = head_dim / VW is a compile-time constant in each
   instantiation, so the accumulators below live in registers. TQ: the query's
   and output's element type; TC: the cache's. QUANT (a constant: the float
   caches' instantiations compile without it) applies the per-slot scales,
   times the format's UNIT, to each chunk's scores and softmax weights. */
#define DEFINE_TILE(NAME, TQ, LOADQ, STOREQ, T, LOADV, ACCUMULATE_V, QUANT, UNIT, PAIRS, DP)      \
static inline __attribute__((always_inline)) void NAME(                                           \
    const TQ *q, int64_t q_stride, const T *k_cache, const T *v_cache, const uint16_t *k_scale,   \
    const uint16_t *v_scale, const int32_t *table,                                                \
    const tile_t tile, int64_t h0, int64_t nh, int64_t num_heads, int64_t num_kv_heads,           \
    const int CH, const int NSUB, int64_t block_size, int32_t layout, float scale, int64_t next_head, \
    const int32_t *next_table, int64_t next_len, int64_t key_start, int64_t key_end, float *partial, \
    TQ *out) {                                                                                    \
    const int64_t D = VW * CH, G = num_heads / num_kv_heads, R = tile.rows * G;                   \
    const int64_t max_len = tile.len0 + tile.rows - 1, row_bytes = D * (int64_t)sizeof(T);        \
    /* element strides (see KV_LAYOUT_HEAD): a key's tokens and dims, a value's tokens */         \
    const int64_t k_tok = layout ? 1 : num_kv_heads * D, k_dim = layout ? block_size : 1;         \
    const int64_t v_tok = layout ? D : num_kv_heads * D;                                          \
    const int64_t k_stride_bytes = k_tok * (int64_t)sizeof(T), v_stride_bytes = v_tok * (int64_t)sizeof(T); \
    float Q[MAX_ROW_FLOATS] __attribute__((aligned(64)));   /* [nh][R][D], pre-scaled */         \
    float acc[MAX_ROW_FLOATS] __attribute__((aligned(64))); /* [nh][R][D] */                     \
    float KT[SUB * MAX_HEAD_DIM * VW] __attribute__((aligned(64))); /* [SUB][D][VW] */           \
    float P[MAX_ROWS * P_STRIDE] __attribute__((aligned(64)));    /* [R][SUB * VW] */            \
    float run_max[MAX_ROWS], run_sum[MAX_ROWS], corr[MAX_ROWS]; /* [nh][R], [nh][R], [R] */      \
    float KS[SUB * VW] __attribute__((aligned(64))), VS[SUB * VW] __attribute__((aligned(64)));  \
    /* DP: the pair kernels (DP_BF16 above) for bfloat16 queries and caches, head_dim a multiple  \
       of 2 VW: the raw query pairs [nh][R][D / 2] and the weights in bfloat16 [R][SUB * VW] */   \
    const int dp = (DP) && CH % 2 == 0;                                                           \
    uint32_t QP[(DP) ? MAX_ROW_FLOATS / 2 : 1] __attribute__((aligned(64)));                      \
    bf16_t PB[(DP) ? MAX_ROWS * P_STRIDE : 1] __attribute__((aligned(64)));                       \
    const vf vscale = vset1(scale);                                                               \
    for (int64_t r = 0; r < nh * R; ++r) { /* row r: head h0 + r / R, its row r % R */           \
        const TQ *src = q + (tile.q_row + r % R / G) * q_stride + ((h0 + r / R) * G + r % G) * D; \
        for (int c = 0; c < CH; ++c) {                                                            \
            if (!dp) vstore(Q + r * D + VW * c, vmul(LOADQ(src + VW * c), vscale));               \
            vstore(acc + r * D + VW * c, vzero());                                                \
        }                                                                                         \
        if (dp) memcpy(QP + r * (D / 2), src, (size_t)D * sizeof(TQ)); /* the pair kernels' query */ \
        run_max[r] = -INFINITY;                                                                   \
        run_sum[r] = 0.0f;                                                                        \
    }                                                                                             \
    for (int64_t start = key_start; start < key_end;) {                                           \
        /* up to SUB chunks of at most VW tokens, each within one block and the key range */      \
        const T *kbs[SUB], *vbs[SUB];                                                             \
        int64_t ns[SUB], offs[SUB], slots[SUB];                                                   \
        int64_t pos = start;                                                                      \
        for (int sub = 0; sub < NSUB; ++sub) {                                                     \
            int64_t slot = 0;                                                                     \
            const int64_t n = pos < key_end ? key_chunk(table, pos, key_end, block_size, &slot) : 0;\
            ns[sub] = n;                                                                          \
            offs[sub] = pos - start;                                                              \
            slots[sub] = slot;                                                                    \
            pos += n;                                                                             \
        }                                                                                         \
        /* the next chunks (or, after the last, the next KV head's first ones when this tile     \
           has one head, or the first chunks of next_table's next_len tokens, the tile this      \
           thread takes next): their slots here, each head's rows prefetched with that head */   \
        int64_t ahead[SUB], next_slots[SUB], next_h = -1;                                         \
        {                                                                                         \
            int64_t next = pos;                                                                   \
            for (int sub = 0; sub < NSUB; ++sub) {                                                 \
                ahead[sub] = 0;                                                                   \
                next_slots[sub] = slots[0];                                                       \
            }                                                                                     \
            for (int sub = 0; sub < NSUB && next < max_len; ++sub) {                               \
                ahead[sub] = key_chunk(table, next, max_len, block_size, &next_slots[sub]);       \
                next += ahead[sub];                                                               \
            }                                                                                     \
            if (pos >= max_len && next_head >= 0) {                                               \
                ahead[0] = max_len < VW ? max_len : VW;                                           \
                if (ahead[0] > block_size) ahead[0] = block_size;                                 \
                next_slots[0] = (int64_t)table[0] * block_size;                                   \
                next_h = next_head;                                                               \
            } else if (pos >= max_len && next_table) {                                            \
                next = 0;                                                                         \
                for (int sub = 0; sub < NSUB && next < next_len; ++sub) {                          \
                    ahead[sub] = key_chunk(next_table, next, next_len, block_size, &next_slots[sub]); \
                    next += ahead[sub];                                                           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        /* heads in turn within the chunks: a block's rows of every head are read together */    \
        for (int64_t hh = 0; hh < nh; ++hh) {                                                     \
        const int64_t h = h0 + hh;                                                                \
        float *const Qh = Q + hh * R * D, *const acch = acc + hh * R * D;                         \
        const uint32_t *const QPh = QP + (dp ? hh * R * (D / 2) : 0);                              \
        float *const maxh = run_max + hh * R, *const sumh = run_sum + hh * R;                     \
        for (int sub = 0; sub < NSUB; ++sub) {                                                     \
            kbs[sub] = k_cache + key_at(slots[sub], h, num_kv_heads, D, block_size, layout);      \
            vbs[sub] = v_cache + value_at(slots[sub], h, num_kv_heads, D, block_size, layout);    \
        }                                                                                         \
        if (QUANT) /* these chunks' scales; lanes past a chunk's end (masked below) are 0 */      \
            for (int sub = 0; sub < NSUB; ++sub)                                                   \
                for (int t = 0; t < VW; ++t) {                                                    \
                    const int64_t at = (slots[sub] + t) * num_kv_heads + h;                       \
                    KS[sub * VW + t] = t < ns[sub] ? f16_to_f32(k_scale[at]) * (UNIT) : 0.0f;     \
                    VS[sub * VW + t] = t < ns[sub] ? f16_to_f32(v_scale[at]) * (UNIT) : 0.0f;     \
                }                                                                                 \
        const char *nk[SUB], *nv[SUB];                                                            \
        for (int sub = 0; sub < NSUB; ++sub) {                                                     \
            const int64_t hn = next_h >= 0 ? next_h : h;                                          \
            nk[sub] = (const char *)(k_cache + key_at(next_slots[sub], hn, num_kv_heads, D, block_size, layout)); \
            nv[sub] = (const char *)(v_cache + value_at(next_slots[sub], hn, num_kv_heads, D, block_size, layout)); \
        }                                                                                         \
        const float *kts[SUB];                                                                    \
        int64_t kstr[SUB];                                                                        \
        for (int sub = 0; sub < NSUB; ++sub) { /* keys -> KT[sub][d][token] */                     \
            float *kt = KT + sub * D * VW;                                                        \
            kts[sub] = kt;                                                                        \
            kstr[sub] = VW;                                                                       \
            if (layout && ns[sub] > 0) {                                                          \
                /* the cache holds a block's keys of a head as [d][token]: float32 keys are read \
                   in place wherever a vector from the chunk's first slot stays within the block \
                   row (a short chunk's lanes past its end then hold other slots, whatever they  \
                   are: score_rows masks those lanes out of the maximum and the weights, and    \
                   each lane's score is its own dot product, so the chunk's own lanes are the    \
                   same bits); others are converted (a short chunk's missing tokens as 0, as the \
                   transposes below give them). Not prefetched: on AMD Zen 3 these reads ran as  \
                   fast without, and on Zen 5 slower with. */                                     \
                const T *kb = kbs[sub];                                                           \
                if (dp) {                                                                         \
                    for (int64_t i = 0; i < D / 2; ++i)                                           \
                        vstore(kt + i * VW, interleave_bf16_rows((const bf16_t *)kb + 2 * i * k_dim, \
                                                                 (const bf16_t *)kb + (2 * i + 1) * k_dim, ns[sub])); \
                } else if (sizeof(T) == sizeof(float) && slots[sub] % block_size + VW <= block_size) { \
                    kts[sub] = (const float *)kb;                                                 \
                    kstr[sub] = k_dim;                                                            \
                } else if (ns[sub] == VW) {                                                       \
                    for (int64_t d = 0; d < D; ++d) vstore(kt + d * VW, LOADV(kb + d * k_dim));   \
                } else {                                                                          \
                    for (int64_t d = 0; d < D; ++d) {                                             \
                        T part[VW];                                                               \
                        memset(part, 0, sizeof part);                                             \
                        for (int64_t t = 0; t < ns[sub]; ++t) part[t] = kb[d * k_dim + t];        \
                        vstore(kt + d * VW, LOADV(part));                                         \
                    }                                                                             \
                }                                                                                 \
                continue;                                                                         \
            }                                                                                     \
            if (ns[sub] == 0) {                                                                   \
                memset(kt, 0, (size_t)(D * VW) * sizeof(float));                                  \
                continue;                                                                         \
            }                                                                                     \
            if ((PAIRS) > 1 && CH % (PAIRS) == 0) {                                               \
                /* PAIRS * VW dims of the keys per transpose, moved raw as dwords (VW of PAIRS   \
                   codes each), then each dword split into its codes as floats (exact): the same  \
                   KT as below in 1 / PAIRS of the transposes */                                  \
                for (int cg = 0; cg < CH / (PAIRS); ++cg) {                                       \
                    vf rows[VW];                                                                  \
                    for (int t = 0; t < VW; ++t)                                                  \
                        rows[t] = t < ns[sub] ? vloadu_f32((const float *)(kbs[sub] + t * k_tok + (PAIRS) * VW * cg)) \
                                              : vzero();                                          \
                    if (64 * cg < row_bytes)                                                      \
                        for (int64_t t = 0; t < ahead[sub]; ++t)                                  \
                            _mm_prefetch(nk[sub] + t * k_stride_bytes + 64 * cg, PF_HINT);      \
                    vtranspose(rows);                                                             \
                    if (dp) { /* the raw pairs: dims (2 (VW cg + j), + 1) of the chunk's tokens */ \
                        for (int j = 0; j < VW; ++j) vstore(kt + (VW * cg + j) * VW, rows[j]);    \
                        continue;                                                                 \
                    }                                                                             \
                    for (int j = 0; j < VW; ++j) {                                                \
                        vf codes[4];                                                              \
                        if ((PAIRS) == 2) split_bf16_pairs(rows[j], codes);                       \
                        else split_i8_quads(rows[j], codes);                                      \
                        for (int b = 0; b < (PAIRS); ++b)                                         \
                            vstore(kt + ((PAIRS) * (VW * cg + j) + b) * VW, codes[b]);            \
                    }                                                                             \
                }                                                                                 \
                continue;                                                                         \
            }                                                                                     \
            for (int c = 0; c < CH; ++c) {                                                        \
                vf rows[VW];                                                                      \
                for (int t = 0; t < VW; ++t)                                                      \
                    rows[t] = t < ns[sub] ? LOADV(kbs[sub] + t * k_tok + VW * c) : vzero();  \
                if (64 * c < row_bytes)                                                           \
                    for (int64_t t = 0; t < ahead[sub]; ++t)                                      \
                        _mm_prefetch(nk[sub] + t * k_stride_bytes + 64 * c, PF_HINT);           \
                vtranspose(rows);                                                                 \
                for (int j = 0; j < VW; ++j) vstore(kt + (VW * c + j) * VW, rows[j]);             \
            }                                                                                     \
        }                                                                                         \
        /* rows whose length ends before these chunks see none of them */                         \
        int64_t first = start - tile.len0 + 1;                                                    \
        if (first < 0) first = 0;                                                                 \
        const int64_t r_first = first * G, visible0 = tile.len0 - start;                          \
        for (int64_t r = r_first; r < R; r += QK_ROWS) {                                          \
            switch (R - r < QK_ROWS ? (int)(R - r) : QK_ROWS) {                                   \
            case 4: score_rows(Qh, kts, kstr, CH, NSUB, r, 4, G, visible0, ns, offs, QUANT, KS, VS, maxh, sumh, corr, P, dp, QPh, vscale, PB); break; \
            case 3: score_rows(Qh, kts, kstr, CH, NSUB, r, 3, G, visible0, ns, offs, QUANT, KS, VS, maxh, sumh, corr, P, dp, QPh, vscale, PB); break; \
            case 2: score_rows(Qh, kts, kstr, CH, NSUB, r, 2, G, visible0, ns, offs, QUANT, KS, VS, maxh, sumh, corr, P, dp, QPh, vscale, PB); break; \
            default: score_rows(Qh, kts, kstr, CH, NSUB, r, 1, G, visible0, ns, offs, QUANT, KS, VS, maxh, sumh, corr, P, dp, QPh, vscale, PB); break; \
            }                                                                                     \
        }                                                                                         \
        /* acc = acc * corr + P @ V, PASS_ROWS(CH) rows per pass; the first pass also            \
           prefetches the next chunks' values */                                                  \
        const int per_pass = PASS_ROWS(CH);                                                       \
        const int64_t no_prefetch[SUB] = {0};                                                     \
        for (int64_t r = r_first; r < R; r += per_pass) {                                         \
            const int64_t *pf = r == r_first ? ahead : no_prefetch;                               \
            if (dp)                                                                               \
                V_PASS(accumulate_v_bf16_dp, PB, (const bf16_t *const *)vbs)                      \
            else                                                                                  \
                V_PASS(ACCUMULATE_V, P, vbs)                                                      \
        }                                                                                         \
        }                                                                                         \
        start = pos;                                                                              \
    }                                                                                             \
    if (dp)                                                                                       \
        for (int64_t r = 0; r < nh * R; ++r) unpermute_pairs(acc + r * D, CH);                    \
    if (partial) { /* the key range's state, unnormalized: acc [rows][D], then max and sum [rows] */ \
        const int64_t n_rows = nh * R;                                                            \
        for (int64_t r = 0; r < n_rows; ++r) {                                                    \
            for (int c = 0; c < CH; ++c) vstore(partial + r * D + VW * c, vload(acc + r * D + VW * c)); \
            partial[n_rows * D + r] = run_max[r];                                                 \
            partial[n_rows * D + n_rows + r] = run_sum[r];                                        \
        }                                                                                         \
        return;                                                                                   \
    }                                                                                             \
    for (int64_t r = 0; r < nh * R; ++r) {                                                        \
        TQ *dst = out + ((tile.q_row + r % R / G) * num_heads + (h0 + r / R) * G + r % G) * D;    \
        const vf inv = vset1(1.0f / run_sum[r]);                                                  \
        for (int c = 0; c < CH; ++c) STOREQ(dst + VW * c, vmul(vload(acc + r * D + VW * c), inv)); \
    }                                                                                             \
}

DEFINE_TILE(tile_f32, float, vloadu_f32, vstoreu_f32, float, vloadu_f32, accumulate_v_f32, 0, 1.0f, 1, 0)
DEFINE_TILE(tile_bf16, bf16_t, vloadu_bf16, vstoreu_bf16, bf16_t, vloadu_bf16, accumulate_v_bf16, 0, 1.0f, 2, DP_BF16)
DEFINE_TILE(tile_f32_i8, float, vloadu_f32, vstoreu_f32, kv8_t, vloadu_i8, accumulate_v_i8, 1, I8_UNIT, 4, 0)
DEFINE_TILE(tile_bf16_i8, bf16_t, vloadu_bf16, vstoreu_bf16, kv8_t, vloadu_i8, accumulate_v_i8, 1, I8_UNIT, 4, 0)
DEFINE_TILE(tile_f32_e4m3, float, vloadu_f32, vstoreu_f32, kv8_t, vloadu_e4m3, accumulate_v_e4m3, 1, E4M3_UNIT, 1, 0)
DEFINE_TILE(tile_bf16_e4m3, bf16_t, vloadu_bf16, vstoreu_bf16, kv8_t, vloadu_e4m3, accumulate_v_e4m3, 1, E4M3_UNIT, 1, 0)
DEFINE_TILE(tile_f32_e5m2, float, vloadu_f32, vstoreu_f32, kv8_t, vloadu_e5m2, accumulate_v_e5m2, 1, E5M2_UNIT, 1, 0)
DEFINE_TILE(tile_bf16_e5m2, bf16_t, vloadu_bf16, vstoreu_bf16, kv8_t, vloadu_e5m2, accumulate_v_e5m2, 1, E5M2_UNIT, 1, 0)

#if VW == 16 && defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && __GNUC__ >= 11
/* ---- bfloat16 caches on AMX-BF16 tiles (Sapphire Rapids and later)
 *
 * The same tiles, chunks and online softmax as tile_bf16, with the two products on the
 * tile unit instead of the vector one:
 *   scores: S^T [16 keys][N rows] = K [16 keys][32 dims] x Q^T [16 dim pairs][N rows x 2],
 *           TDPBF16PS per 32 dims, the key rows loaded straight from the cache (no transpose);
 *   values: O [N rows][16 dims] = P [N rows][32 keys] x V' [16 key pairs][16 dims x 2],
 *           where V' holds two keys' values of a dim side by side (an unpack per key pair).
 * Queries enter unscaled (their bfloat16 values) and the scores are scaled in float32;
 * softmax weights enter the value product rounded to bfloat16, and their sum is taken
 * over those rounded weights. Products are exact and sums float32 (the unit's own order),
 * so a row's result does not depend on the other rows of its tile: the same bits in any
 * tile and schedule, as on the vector path (which gives other bits, within bfloat16's
 * rounding of it). A pass takes up to 16 rows; a tile with more takes several per chunk
 * group. The unpacks keep a fixed permutation of the head's dims (AMX_DIM below), undone
 * when the rows are written. */
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>
#include <stdlib.h>
#define TARGET_AMX_ATTN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16,amx-int8")))
#define AMX_ATTN 1
#define AMX_MAX_HEAD_DIM 128
#define AMX_GROUP (SUB * 16) /* keys per softmax update */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_attn_cfg_t;

/* Tiles: 0 keys [16][64 B]; 1 Q^T [16][4NQ B]; 2 S^T [16][4NQ B]; 3, 4 P halves [N][64 B];
   5 V' [16][64 B]; 6, 7 O [N][64 B] (two slices). NQ, the score tile's columns: N for
   bfloat16 queries, two per query row (its two int8 parts) over int8 codes. */
TARGET_AMX_ATTN static void amx_attn_configure(int n, int nq) {
    amx_attn_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = 16, c.colsb[0] = 64;
    c.rows[1] = 16, c.colsb[1] = (uint16_t)(4 * nq);
    c.rows[2] = 16, c.colsb[2] = (uint16_t)(4 * nq);
    c.rows[3] = (uint8_t)n, c.colsb[3] = 64;
    c.rows[4] = (uint8_t)n, c.colsb[4] = 64;
    c.rows[5] = 16, c.colsb[5] = 64;
    c.rows[6] = (uint8_t)n, c.colsb[6] = 64;
    c.rows[7] = (uint8_t)n, c.colsb[7] = 64;
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(&c);
}

/* Dim of column c of value slice s (16 dims each): _mm512_unpack{lo,hi}_epi16 of two
   rows' 32-dim register z = s / 2 put, per 128-bit lane l, dims 8l .. 8l + 3 (lo) or
   8l + 4 .. 8l + 7 (hi) in dwords 4l .. 4l + 3. */
#define AMX_DIM(s, c) (32 * ((s) >> 1) + 8 * ((c) >> 2) + 4 * ((s) & 1) + ((c) & 3))

/* Prefetch, into L2, rows [*at, to) of the next AMX_GROUP keys (row r: chunk r / 16, its
   token r % 16) of one head, K and V, and move *at to `to`. A decode pass calls it at
   points spread over all of its work (the value repack, each chunk's scores, each
   row's softmax, each value slice), so the next keys' reads run beside this group's
   arithmetic: issued all at once, the misses take every line fill buffer and this
   group's own loads from L2 queue behind them. */
static inline __attribute__((always_inline)) void amx_prefetch_next(const char *const *nk, const char *const *nv,
                                                                   const int64_t *ahead, int64_t *at, int64_t to,
                                                                   int64_t stride_bytes, int64_t row_bytes) {
    if (to > AMX_GROUP) to = AMX_GROUP;
    for (int64_t r = *at; r < to; ++r) {
        const int sub = (int)(r >> 4);
        const int64_t t = r & 15;
        if (t >= ahead[sub]) continue;
        for (int64_t b = 0; b < row_bytes; b += 64) {
            _mm_prefetch(nk[sub] + t * stride_bytes + b, PF_HINT);
            _mm_prefetch(nv[sub] + t * stride_bytes + b, PF_HINT);
        }
    }
    if (to > *at) *at = to;
}
/* How many of the next group's rows are prefetched by the end of each phase of a pass. */
#ifndef AMX_PF_REPACK
#define AMX_PF_REPACK 32
#endif
#ifndef AMX_PF_SCORES
#define AMX_PF_SCORES 48
#endif
#ifndef AMX_PF_SOFTMAX
#define AMX_PF_SOFTMAX 56
#endif

/* 32 int8 codes as 32 bfloat16 values (exact: |code| <= 128 needs 8 significant bits) */
TARGET_AMX_ATTN static inline __attribute__((always_inline)) __m512i i8x32_to_bf16(const kv8_t *p) {
    return (__m512i)_mm512_cvtne2ps_pbh(vloadu_i8(p + 16), vloadu_i8(p));
}

/* The tile kernel for bfloat16 caches (I8 = 0) and int8 ones (I8 = 1, codes with a float16
   scale per slot and KV head).
   int8 scores run on the int8 unit (TDPBSSD) with the key codes loaded straight from the
   cache: a query row enters as two int8 vectors, q = s (q1 + q2 / 254) with s = absmax / 127,
   q1 = round(q / s) and q2 = round(254 (q / s - q1)), an error of at most s / 508 per dim
   (under half a bfloat16 ulp for every dim of at least absmax / 126). The two exact integer
   sums per key are combined in float32 and scaled by s / 254, the softmax scale and the
   key's scale. Up to 4 rows (a decode token's) the keys are the tile's A operand, straight
   from the cache, and the rows' parts the B operand (S^T, 2N columns); with more rows each
   chunk's codes are transposed once (as dwords: four codes of a key stay together) into the
   B operand and the rows' parts are A (S), so no pass transposes scores. A row's
   quantization depends on that row alone, integer sums on no order, and both ways combine
   the sums with the same float operations: a row's scores are the same in any tile. int8 values enter the tiles as
   bfloat16 (exact); a value's scale multiplies its softmax weight before that is rounded
   to bfloat16, so P V sums scale * weight * code. The softmax's sum is then taken over the
   float32 weights. */
TARGET_AMX_ATTN static inline __attribute__((always_inline)) void tile_amx(
    const bf16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, const uint16_t *k_scale,
    const uint16_t *v_scale, const int32_t *table, const tile_t tile, int64_t h0, int64_t nh, int64_t num_heads,
    int64_t num_kv_heads, const int CH, int64_t block_size, float scale, int64_t next_head,
    const int32_t *next_table, int64_t next_len, bf16_t *out, const int I8) {
    const int64_t D = 16 * CH, G = num_heads / num_kv_heads, R = tile.rows * G, es = I8 ? 1 : 2;
    const int64_t tok_stride = num_kv_heads * D, max_len = tile.len0 + tile.rows - 1;
    const int64_t stride_bytes = tok_stride * es, row_bytes = D * es, DC = D / 32, NS = D / 16;
#define KV_AT(base, index) ((const char *)(base) + (index) * es)
    const int N = R < 16 ? (int)R : 16;
    const int64_t passes = (R + 15) / 16;
    /* int8: scores as S^T (up to 4 rows, two columns each) or as S; 64-dim chunks */
    const int ST_I8 = I8 && N <= 4, S_I8 = I8 && N > 4, NQ = ST_I8 ? 2 * N : N;
    const int64_t DC8 = (D + 63) / 64, D8 = 64 * DC8;
    /* Q^T per (head, pass, 32-dim chunk): [16 dim pairs][N] dwords; rows past R are zero.
       heads x passes x N <= 2 x heads x R <= 2 x MAX_ROWS */
    uint32_t QT[2 * MAX_ROWS * (AMX_MAX_HEAD_DIM / 2)] __attribute__((aligned(64)));
    /* int8, per (head, pass), in the same array: up to 4 rows Q^T per 64-dim chunk as
       [16 dim quads][2N] dwords (a row's q1 in column j, its q2 in N + j); past that the rows'
       q1 then q2 as [N][D8] bytes each. qrow: s / 254 x the softmax scale per row. */
    float qrow[MAX_ROWS];
    int32_t ST8[SUB][16 * 16] __attribute__((aligned(64)));       /* S^T: [16 keys][2N] */
    int32_t S8[2][SUB][16 * 16] __attribute__((aligned(64)));     /* S: q1 and q2 sums, [N][16 keys] */
    uint32_t KT8[SUB][(AMX_MAX_HEAD_DIM / 64) * 16 * 16] __attribute__((aligned(64))); /* codes as [dim quad][16 keys] */
    float acc[MAX_ROW_FLOATS] __attribute__((aligned(64))); /* [nh][R][D], dims in AMX_DIM order */
    float run_max[MAX_ROWS], run_sum[MAX_ROWS], rsum[16];
    float corr[16] __attribute__((aligned(64))), dmax[16] __attribute__((aligned(64)));
    float ST[SUB][16 * 16] __attribute__((aligned(64)));       /* S^T per chunk, 64-byte rows */
    bf16_t P[16 * AMX_GROUP] __attribute__((aligned(64)));     /* [N][64 keys] */
    uint32_t VP[2 * (AMX_MAX_HEAD_DIM / 16) * 16 * 16] __attribute__((aligned(64))); /* [half][slice][pair][16] */
    bf16_t KS[SUB][16 * AMX_MAX_HEAD_DIM] __attribute__((aligned(64))); /* partial chunks' keys, zero-padded */
    int8_t KS8[SUB][16 * AMX_MAX_HEAD_DIM] __attribute__((aligned(64)));  /* the same of int8 codes, rows of D8 */
    float ksv[SUB][16] __attribute__((aligned(64))), vsv[SUB][16] __attribute__((aligned(64))); /* int8 scales */
    float O[2 * 16 * 16] __attribute__((aligned(64)));
    const int64_t qt_unit = I8 ? N * D8 / 2 : 16 * N * DC; /* dwords per (head, pass) */
    if (I8)
        for (int64_t hh = 0; hh < nh; ++hh)
            for (int64_t p = 0; p < passes; ++p)
                    for (int j = 0; j < N; ++j) {
                        const int64_t r = 16 * p + j;
                        int8_t q1[AMX_MAX_HEAD_DIM] __attribute__((aligned(64))), q2[AMX_MAX_HEAD_DIM] __attribute__((aligned(64)));
                        memset(q1, 0, sizeof q1);
                        memset(q2, 0, sizeof q2);
                        if (r < R) {
                            const bf16_t *src = q + (tile.q_row + r / G) * q_stride + ((h0 + hh) * G + r % G) * D;
                            vf top = vzero();
                            for (int64_t d = 0; d < D; d += 16) top = vmax(top, vabs(vloadu_bf16(src + d)));
                            const float amax = vmaxall(top);
                            const vf inv = vset1(amax > 0.0f ? 127.0f / amax : 0.0f);
                            for (int64_t d = 0; d < D; d += 16) {
                                const vf x = vmul(vloadu_bf16(src + d), inv);
                                const __m512i a = _mm512_cvtps_epi32(x);
                                const __m512i b = _mm512_cvtps_epi32(vmul(vsub(x, _mm512_cvtepi32_ps(a)), vset1(254.0f)));
                                _mm_store_si128((__m128i *)(q1 + d), _mm512_cvtsepi32_epi8(a));
                                _mm_store_si128((__m128i *)(q2 + d), _mm512_cvtsepi32_epi8(b));
                            }
                            qrow[hh * R + r] = amax / (127.0f * 254.0f) * scale;
                        }
                        uint32_t *qt = QT + (hh * passes + p) * qt_unit;
                        if (S_I8) {
                            memcpy((int8_t *)qt + j * D8, q1, (size_t)D8);
                            memcpy((int8_t *)qt + (N + j) * D8, q2, (size_t)D8);
                            continue;
                        }
                        for (int64_t k = 0; k < D8 / 4; ++k) { /* k: quad k of chunk k / 16 */
                            uint32_t w1, w2;
                            memcpy(&w1, q1 + 4 * k, 4);
                            memcpy(&w2, q2 + 4 * k, 4);
                            qt[k * NQ + j] = w1, qt[k * NQ + N + j] = w2;
                        }
                    }
    for (int64_t hh = 0; hh < nh && !I8; ++hh)
        for (int64_t p = 0; p < passes; ++p)
            for (int64_t dc = 0; dc < DC; ++dc) {
                uint32_t *qt = QT + (hh * passes + p) * qt_unit + dc * 16 * N;
                for (int j = 0; j < N; ++j) {
                    const int64_t r = 16 * p + j;
                    const uint32_t *src = r < R ? (const uint32_t *)(q + (tile.q_row + r / G) * q_stride +
                                                                     ((h0 + hh) * G + r % G) * D + 32 * dc) : 0;
                    for (int k = 0; k < 16; ++k) qt[k * N + j] = src ? src[k] : 0u;
                }
            }
    for (int64_t r = 0; r < nh * R; ++r) {
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
        for (int64_t d = 0; d < D; d += 16) vstore(acc + r * D + d, vzero());
    }
    const vf vscale = vset1(scale);
    const __m512i gather_n = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(16));
    amx_attn_configure(N, NQ);
    for (int64_t start = 0; start < max_len;) {
        int64_t ns[SUB], offs[SUB], slots[SUB], pos = start;
        for (int sub = 0; sub < SUB; ++sub) {
            int64_t slot = 0;
            const int64_t n = pos < max_len ? key_chunk(table, pos, max_len, block_size, &slot) : 0;
            ns[sub] = n, offs[sub] = pos - start, slots[sub] = slot;
            pos += n;
        }
        /* the next chunks, as tile_bf16 finds them */
        int64_t ahead[SUB], next_slots[SUB], next_h = -1;
        {
            int64_t next = pos;
            for (int sub = 0; sub < SUB; ++sub) ahead[sub] = 0, next_slots[sub] = slots[0];
            for (int sub = 0; sub < SUB && next < max_len; ++sub) {
                ahead[sub] = key_chunk(table, next, max_len, block_size, &next_slots[sub]);
                next += ahead[sub];
            }
            if (pos >= max_len && next_head >= 0) {
                ahead[0] = max_len < 16 ? max_len : 16;
                if (ahead[0] > block_size) ahead[0] = block_size;
                next_slots[0] = (int64_t)table[0] * block_size;
                next_h = next_head;
            } else if (pos >= max_len && next_table) {
                next = 0;
                for (int sub = 0; sub < SUB && next < next_len; ++sub) {
                    ahead[sub] = key_chunk(next_table, next, next_len, block_size, &next_slots[sub]);
                    next += ahead[sub];
                }
            }
        }
        int64_t first = start - tile.len0 + 1;
        if (first < 0) first = 0;
        const int64_t r_first = first * G, visible0 = tile.len0 - start;
        for (int64_t hh = 0; hh < nh; ++hh) {
            const int64_t h = h0 + hh;
            float *const acch = acc + hh * R * D, *const maxh = run_max + hh * R, *const sumh = run_sum + hh * R;
            /* this head's rows of the next chunks, prefetched into L2 over the work below */
            const char *nk[SUB], *nv[SUB];
            int64_t pf_at = 0;
            for (int sub = 0; sub < SUB; ++sub) {
                const int64_t at = (next_slots[sub] * num_kv_heads + (next_h >= 0 ? next_h : h)) * D;
                nk[sub] = KV_AT(k_cache, at), nv[sub] = KV_AT(v_cache, at);
            }
            if (I8) { /* these chunks' scales (0 past a chunk's end); the next chunks' scale lines, once */
                if (num_kv_heads <= 4) {
                    /* a chunk's scales are 16 x KH contiguous halves: two masked loads, and
                       every KH-th picked by one permute */
                    const __m512i pick = _mm512_add_epi16(
                        _mm512_mullo_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18,
                                                            17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi16((short)num_kv_heads)),
                        _mm512_set1_epi16((short)h));
                    for (int sub = 0; sub < SUB; ++sub) {
                        const int64_t n = ns[sub] * num_kv_heads;
                        const __mmask32 m0 = n >= 32 ? 0xffffffffu : (__mmask32)((1ull << n) - 1);
                        const __mmask32 m1 = n <= 32 ? 0u : n >= 64 ? 0xffffffffu : (__mmask32)((1ull << (n - 32)) - 1);
                        const uint16_t *ks = k_scale + slots[sub] * num_kv_heads, *vs = v_scale + slots[sub] * num_kv_heads;
                        const __m512i k16 = _mm512_permutex2var_epi16(_mm512_maskz_loadu_epi16(m0, ks), pick,
                                                                      _mm512_maskz_loadu_epi16(m1, ks + 32));
                        const __m512i v16 = _mm512_permutex2var_epi16(_mm512_maskz_loadu_epi16(m0, vs), pick,
                                                                      _mm512_maskz_loadu_epi16(m1, vs + 32));
                        const vmask live = vfirst(ns[sub]);
                        vstore(ksv[sub], _mm512_maskz_cvtph_ps(live, _mm512_castsi512_si256(k16)));
                        vstore(vsv[sub], _mm512_maskz_cvtph_ps(live, _mm512_castsi512_si256(v16)));
                    }
                } else {
                    for (int sub = 0; sub < SUB; ++sub)
                        for (int t = 0; t < 16; ++t) {
                            const int64_t at = (slots[sub] + t) * num_kv_heads + h;
                            ksv[sub][t] = t < ns[sub] ? f16_to_f32(k_scale[at]) : 0.0f;
                            vsv[sub][t] = t < ns[sub] ? f16_to_f32(v_scale[at]) : 0.0f;
                        }
                }
                if (hh == 0)
                    for (int sub = 0; sub < SUB; ++sub)
                        if (ahead[sub] > 0) {
                            const char *ks = (const char *)(k_scale + next_slots[sub] * num_kv_heads);
                            const char *vs = (const char *)(v_scale + next_slots[sub] * num_kv_heads);
                            const int64_t bytes = ahead[sub] * num_kv_heads * 2;
                            for (int64_t b = 0; b < bytes + 63; b += 64) {
                                _mm_prefetch(ks + b, PF_HINT);
                                _mm_prefetch(vs + b, PF_HINT);
                            }
                        }
            }
            /* keys: straight from the cache when a chunk is whole (int8: and its rows are whole
               64-byte chunks), else a zero-padded copy */
            const void *kp[SUB];
            int64_t kstride[SUB];
            for (int sub = 0; sub < SUB; ++sub) {
                const char *kb = KV_AT(k_cache, (slots[sub] * num_kv_heads + h) * D);
                if (ns[sub] == 16 && (!I8 || D == D8)) {
                    kp[sub] = kb, kstride[sub] = stride_bytes;
                    continue;
                }
                if (I8) {
                    kp[sub] = KS8[sub], kstride[sub] = D8;
                    for (int64_t t = 0; t < 16; ++t)
                        for (int64_t d = 0; d < D8; d += 32) {
                            const __mmask32 m = t < ns[sub] && d < D ? 0xffffffffu : 0u; /* D: a multiple of 32 */
                            _mm256_store_si256((__m256i *)(KS8[sub] + t * D8 + d),
                                               _mm256_maskz_loadu_epi8(m, kb + t * stride_bytes + d));
                        }
                    continue;
                }
                kp[sub] = KS[sub], kstride[sub] = 2 * D;
                for (int64_t t = 0; t < 16; ++t)
                    for (int64_t d = 0; d < D; d += 32) {
                        const char *row = kb + t * stride_bytes;
                        __m512i x = _mm512_setzero_si512();
                        if (t < ns[sub])
                            x = I8 ? i8x32_to_bf16((const kv8_t *)row + d) : _mm512_loadu_si512((const void *)(row + 2 * d));
                        _mm512_store_si512((void *)(KS[sub] + t * D + d), x);
                    }
            }
            if (S_I8) /* each chunk's codes as the B operand: rows of 16 keys' dwords */
                for (int sub = 0; sub < SUB; ++sub) {
                    if (ns[sub] == 0) continue;
                    for (int64_t dc = 0; dc < DC8; ++dc) {
                        vf rows[16];
                        for (int t = 0; t < 16; ++t)
                            rows[t] = _mm512_castsi512_ps(_mm512_loadu_si512((const void *)((const char *)kp[sub] + t * kstride[sub] + 64 * dc)));
                        vtranspose(rows);
                        for (int k = 0; k < 16; ++k) _mm512_store_ps((float *)(KT8[sub] + (dc * 16 + k) * 16), rows[k]);
                    }
                }
            /* values as key pairs: VP[half][slice][pair] = 16 dwords (two keys' bf16 per dim) */
            for (int64_t g = 0; g < AMX_GROUP; g += 2) {
                const int sub = (int)(g >> 4), t = (int)(g & 15);
                const char *vb = KV_AT(v_cache, (slots[sub] * num_kv_heads + h) * D) + t * stride_bytes;
                const int64_t half = g >> 5, pair = (g & 31) >> 1;
                amx_prefetch_next(nk, nv, ahead, &pf_at, (g + 2) * AMX_PF_REPACK / AMX_GROUP, stride_bytes, row_bytes);
                for (int64_t z = 0; z < DC; ++z) {
                    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
                    if (t < ns[sub])
                        a = I8 ? i8x32_to_bf16((const kv8_t *)vb + 32 * z) : _mm512_loadu_si512((const void *)(vb + 64 * z));
                    if (t + 1 < ns[sub])
                        b = I8 ? i8x32_to_bf16((const kv8_t *)(vb + stride_bytes) + 32 * z)
                               : _mm512_loadu_si512((const void *)(vb + stride_bytes + 64 * z));
                    uint32_t *dst = VP + ((half * NS + 2 * z) * 16 + pair) * 16;
                    _mm512_store_si512((void *)dst, _mm512_unpacklo_epi16(a, b));
                    _mm512_store_si512((void *)(dst + 16 * 16), _mm512_unpackhi_epi16(a, b));
                }
            }
            for (int64_t p = 0; p < passes; ++p) {
                const int64_t r0 = 16 * p;
                if (r0 + N <= r_first) continue; /* no row of this pass sees these chunks */
                const uint32_t *qt = QT + (hh * passes + p) * qt_unit;
                for (int sub = 0; sub < SUB; ++sub) {
                    if (ns[sub] == 0) continue;
                    if (S_I8) { /* S = Q K^T: tiles 3, 4 (q1, q2 rows), 5 (K^T), 6, 7 (their sums) */
                        _tile_zero(6);
                        _tile_zero(7);
                        for (int64_t dc = 0; dc < DC8; ++dc) {
                            _tile_loadd(3, (const int8_t *)qt + 64 * dc, D8);
                            _tile_loadd(4, (const int8_t *)qt + N * D8 + 64 * dc, D8);
                            _tile_loadd(5, KT8[sub] + dc * 256, 64);
                            _tile_dpbssd(6, 3, 5);
                            _tile_dpbssd(7, 4, 5);
                        }
                        _tile_stored(6, S8[0][sub], 64);
                        _tile_stored(7, S8[1][sub], 64);
                    } else { /* S^T = K Q^T: tiles 0 (keys, 64-byte chunks), 1 (Q^T, NQ columns), 2 */
                        _tile_zero(2);
                        for (int64_t dc = 0; dc < (I8 ? DC8 : DC); ++dc) {
                            _tile_loadd(0, (const char *)kp[sub] + 64 * dc, kstride[sub]);
                            _tile_loadd(1, qt + dc * 16 * NQ, 4 * NQ);
                            if (I8) _tile_dpbssd(2, 0, 1);
                            else _tile_dpbf16ps(2, 0, 1);
                        }
                        _tile_stored(2, I8 ? (void *)ST8[sub] : (void *)ST[sub], 64);
                    }
                    amx_prefetch_next(nk, nv, ahead, &pf_at, AMX_PF_REPACK + (sub + 1) * (AMX_PF_SCORES - AMX_PF_REPACK) / SUB,
                                      stride_bytes, row_bytes);
                }
                /* scores of row r0 + j: column j of each S^T */
                vf cols[SUB][16];
                if (N > 4 && !I8)
                    for (int sub = 0; sub < SUB; ++sub) {
                        if (ns[sub] == 0) continue;
                        for (int t = 0; t < 16; ++t) cols[sub][t] = vload(ST[sub] + 16 * t);
                        vtranspose(cols[sub]);
                    }
                for (int j = 0; j < N; ++j) {
                    const int64_t row = r0 + j;
                    bf16_t *prow = P + j * AMX_GROUP;
                    if (row >= R || row < r_first) { /* sees none of these keys */
                        dmax[j] = 0.0f; /* corr 1 */
                        for (int g = 0; g < AMX_GROUP; g += 32) _mm512_store_si512((void *)(prow + g), _mm512_setzero_si512());
                        continue;
                    }
                    const int64_t visible = visible0 + row / G;
                    vf s[SUB];
                    vmask mask[SUB];
                    vf top = vset1(-INFINITY);
                    for (int sub = 0; sub < SUB; ++sub) {
                        int64_t seen = visible - offs[sub];
                        if (seen > ns[sub]) seen = ns[sub];
                        mask[sub] = vfirst(seen);
                        if (ns[sub] == 0) {
                            s[sub] = vzero();
                            continue;
                        }
                        if (I8) { /* q1 and q2 sums: columns j and N + j of S^T, or rows j of S */
                            const __m512i c1 = ST_I8 ? _mm512_i32gather_epi32(gather_n, ST8[sub] + j, 4)
                                                     : _mm512_load_si512((const void *)(S8[0][sub] + 16 * j));
                            const __m512i c2 = ST_I8 ? _mm512_i32gather_epi32(gather_n, ST8[sub] + N + j, 4)
                                                     : _mm512_load_si512((const void *)(S8[1][sub] + 16 * j));
                            s[sub] = vmul(vfmadd(_mm512_cvtepi32_ps(c1), vset1(254.0f), _mm512_cvtepi32_ps(c2)),
                                          vset1(qrow[hh * R + row]));
                            s[sub] = vmul(s[sub], vload(ksv[sub]));
                        } else {
                            s[sub] = vmul(N > 4 ? cols[sub][j] : _mm512_i32gather_ps(gather_n, ST[sub] + j, 4), vscale);
                        }
                        top = vmax(top, vselect(mask[sub], s[sub], vset1(-INFINITY)));
                    }
                    const float block_max = vmaxall(top);
                    const float new_max = block_max > maxh[row] ? block_max : maxh[row];
                    dmax[j] = maxh[row] - new_max; /* -inf on a row's first keys */
                    const vf shift = vset1(new_max);
                    vf sum = vzero();
                    for (int sub = 0; sub < SUB; ++sub) {
                        const vf w = vselect(mask[sub], vexp4(vsub(s[sub], shift)), vzero());
                        const __m256i wb = (__m256i)_mm512_cvtneps_pbh(I8 ? vmul(w, vload(vsv[sub])) : w);
                        sum = vadd(sum, I8 ? w : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(wb), 16)));
                        _mm256_store_si256((__m256i *)(prow + 16 * sub), wb);
                    }
                    amx_prefetch_next(nk, nv, ahead, &pf_at, AMX_PF_SCORES + (j + 1) * (AMX_PF_SOFTMAX - AMX_PF_SCORES) / N,
                                      stride_bytes, row_bytes);
                    rsum[j] = vsum(sum);
                    maxh[row] = new_max;
                }
                /* the rows' corrections in one exp (-inf: 0 to within float's range, and it
                   only ever scales zeros) */
                vstore(corr, vexp4(_mm512_maskz_load_ps(vfirst(N), dmax)));
                for (int j = 0; j < N; ++j) {
                    const int64_t row = r0 + j;
                    if (row < R && row >= r_first) sumh[row] = sumh[row] * corr[j] + rsum[j];
                }
                /* acc = acc * corr + P V, two 16-dim slices at a time (tiles 6 and 7: tiles are
                   not renamed, so one accumulator would put every slice in one chain) */
                _tile_loadd(3, P, 2 * AMX_GROUP);
                _tile_loadd(4, P + 32, 2 * AMX_GROUP);
                const int two = ns[2] > 0; /* keys 32 .. 63 hold any */
                for (int64_t sl = 0; sl < NS; sl += 2) {
                    _tile_zero(6);
                    _tile_zero(7);
                    _tile_loadd(5, VP + sl * 256, 64);
                    _tile_dpbf16ps(6, 3, 5);
                    _tile_loadd(5, VP + (sl + 1) * 256, 64);
                    _tile_dpbf16ps(7, 3, 5);
                    if (two) {
                        _tile_loadd(5, VP + (NS + sl) * 256, 64);
                        _tile_dpbf16ps(6, 4, 5);
                        _tile_loadd(5, VP + (NS + sl + 1) * 256, 64);
                        _tile_dpbf16ps(7, 4, 5);
                    }
                    amx_prefetch_next(nk, nv, ahead, &pf_at, AMX_PF_SOFTMAX + (sl + 2) * (AMX_GROUP - AMX_PF_SOFTMAX) / NS,
                                      stride_bytes, row_bytes);
                    _tile_stored(6, O, 64);
                    _tile_stored(7, O + 256, 64);
                    for (int j = 0; j < N; ++j) {
                        const int64_t row = r0 + j;
                        if (row >= R || row < r_first) continue;
                        float *a = acch + row * D + 16 * sl;
                        const vf c = vset1(corr[j]);
                        vstore(a, vfmadd(vload(a), c, vload(O + 16 * j)));
                        vstore(a + 16, vfmadd(vload(a + 16), c, vload(O + 256 + 16 * j)));
                    }
                }
            }
            amx_prefetch_next(nk, nv, ahead, &pf_at, AMX_GROUP, stride_bytes, row_bytes); /* rows no phase reached */
        }
        start = pos;
    }
    _tile_release();
    for (int64_t r = 0; r < nh * R; ++r) {
        bf16_t *dst = out + ((tile.q_row + r % R / G) * num_heads + (h0 + r / R) * G + r % G) * D;
        const float inv = 1.0f / run_sum[r];
        float row[AMX_MAX_HEAD_DIM] __attribute__((aligned(64)));
        for (int64_t sl = 0; sl < NS; ++sl)
            for (int c = 0; c < 16; ++c) row[AMX_DIM(sl, c)] = acc[r * D + 16 * sl + c];
        for (int64_t d = 0; d < D; d += 16) vstoreu_bf16(dst + d, vmul(vload(row + d), vset1(inv)));
    }
}
#undef KV_AT

/* The entry points' tile functions, one per cache type (NSUB is the vector kernels') */
#define DEFINE_TILE_AMX(NAME, T, I8)                                                              \
TARGET_AMX_ATTN static void NAME(                                                                 \
    const bf16_t *q, int64_t q_stride, const T *k_cache, const T *v_cache, const uint16_t *k_scale, \
    const uint16_t *v_scale, const int32_t *table, const tile_t tile, int64_t h0, int64_t nh,     \
    int64_t num_heads, int64_t num_kv_heads, const int CH, const int NSUB, int64_t block_size,     \
    int32_t layout, float scale, int64_t next_head, const int32_t *next_table, int64_t next_len,  \
    int64_t key_start, int64_t key_end, float *partial, bf16_t *out) {                            \
    (void)NSUB, (void)key_start, (void)key_end, (void)partial; /* whole tiles only (SEGMENTS_tile_*) */ \
    (void)layout; /* KV_LAYOUT_TOKEN only (the dispatch) */                                       \
    tile_amx(q, q_stride, k_cache, v_cache, k_scale, v_scale, table, tile, h0, nh, num_heads,     \
             num_kv_heads, CH, block_size, scale, next_head, next_table, next_len, out, I8);      \
}
DEFINE_TILE_AMX(tile_bf16_amx, bf16_t, 0)
DEFINE_TILE_AMX(tile_bf16_i8_amx, kv8_t, 1)

/* AMX-BF16 attention usable here: the CPU has the tile unit and its bf16 part, and the
   kernel lets this process use tile data (arch_prctl ARCH_REQ_XCOMP_PERM, once). */
static int amx_attention_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}
static int amx_attention_on = -1; /* -1: not probed yet */
/* The int8 part of the tile unit (the int8 cache's scores), beside the bfloat16 one */
static int amx_int8_unit(void) {
    static int on = -1;
    if (on < 0) {
        unsigned a, b, c, d;
        on = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
    }
    return on;
}
#endif

#define DISPATCH_NSUB(TILE_FN, CH_VALUE, NSUB_VALUE)                                               \
    TILE_FN(q, q_stride, k_cache, v_cache, k_scale, v_scale,                                      \
            tables + (int64_t)tile.table_row * table_stride, tile,                                \
            h, nh, num_heads, num_kv_heads, CH_VALUE, NSUB_VALUE, block_size, layout, scale,      \
            nh == 1 && h + 1 < end_head ? h + 1 : -1, next_table, next_len, seg_k0, seg_k1, seg_out, out)
/* Every tile takes SUB chunks per softmax update, a decode token's too: a row's float
   operations are then the same whatever tile it is in (a decode step, a prefill chunk, a
   recompute after preemption), so the schedule never changes its bits. */
#define DISPATCH_CH(TILE_FN, CH_VALUE) DISPATCH_NSUB(TILE_FN, CH_VALUE, SUB)

/* One work item is a tile and either one KV head (split_heads: more items, for
   small batches) or all of them. A tile whose rows of every head fit the row
   buffers (a decode token's do) takes its heads together, chunk by chunk, so
   each block's K/V rows of all heads are read at once and the reads are
   contiguous; a bigger one (a prefill tile) takes them one after another.
   Either way each row sees the same chunks in the same order: the same bits.
   A call of decode tokens only, heads together, gives each thread a run of
   consecutive tiles holding an even share of the keys (a tile goes to the
   thread whose share holds its middle key), so each thread knows its next
   tile and prefetches that tile's first chunks while it finishes the current
   one (a sequence's first blocks were otherwise read cold); other calls take
   tiles as threads come free. k_scale / v_scale: NULL for float caches.
   head_ranges: NULL, or [num_tiles][2]: tile i computes local KV heads
   [lo, hi) only (tensor parallelism splits a KV head's rows between ranks),
   its other heads' rows left unwritten; in a decode-only call a tile weighs
   its keys times its heads. A row's operations do not depend on the heads
   computed beside it, so the range never changes its bits. */
#define DECODE_TILE_KEYS(t) ((int64_t)(t).len0 + (t).rows + 16) /* its keys, and a block's worth for its fixed cost */
#define DECODE_ITEM_WEIGHT(i)                                                                     \
    (DECODE_TILE_KEYS(tiles[i]) * (head_ranges ? head_ranges[2 * (i) + 1] - head_ranges[2 * (i)] : num_kv_heads))
/* Key segments. A row that sees more than SEG_KEYS keys takes them in segments of SEG_KEYS
   (the last shorter), each with its own online softmax from a fresh state, and the segments'
   states are then merged left to right (merge_segment). A row's operations depend only on how
   many keys it sees, never on the tile or the thread, so the schedule still never changes its
   bits; rows that see SEG_KEYS keys or fewer compute exactly as without segments. What this
   buys: a decode call of few sequences (a single stream) spreads each KV head's segments over
   the threads (segment items, below) instead of one head per thread. */
#ifndef SEG_KEYS
#define SEG_KEYS 256
#endif
/* A segment's state of n rows, as a tile kernel writes it (`partial`): acc [n][D], then the
   running max [n] and sum [n]. merge_segment: state a <- a merged with b, row by row, both
   rescaled to the larger max; a row of b that saw no keys (sum 0) leaves a's as it is. Not
   inlined: the same instructions wherever segments are merged. */
__attribute__((noinline)) static void merge_segment(float *a, const float *b, int64_t n, int64_t D) {
    float *ma = a + n * D, *la = ma + n;
    const float *mb = b + n * D, *lb = mb + n;
    for (int64_t r = 0; r < n; ++r) {
        if (lb[r] == 0.0f) continue;
        const float m = ma[r] > mb[r] ? ma[r] : mb[r];
        const float ca = expf(ma[r] - m), cb = expf(mb[r] - m);
        la[r] = la[r] * ca + lb[r] * cb;
        ma[r] = m;
        const vf va = vset1(ca), vb = vset1(cb);
        float *ar = a + r * D;
        const float *br = b + r * D;
        for (int64_t d = 0; d < D; d += VW) vstore(ar + d, vfmadd(vload(br + d), vb, vmul(vload(ar + d), va)));
    }
}
static inline void store_q_float(float *p, vf v) { vstoreu_f32(p, v); }
static inline void store_q_bf16_t(bf16_t *p, vf v) { vstoreu_bf16(p, v); }
/* Rows [0, n_rows) of a merged state (merge_segment's layout; a tile's rows of heads h0 ..: row r is head h0 + r / R,
   its row r % R) normalized into out, as the tile kernels write theirs. */
#define STORE_MERGED(TQ, st, n_rows, R, G, D, tile, h0)                                           \
    for (int64_t r_ = 0; r_ < (n_rows); ++r_) {                                                   \
        TQ *dst_ = out + (((tile).q_row + r_ % (R) / (G)) * num_heads + ((h0) + r_ / (R)) * (G) + r_ % (G)) * (D); \
        const vf inv_ = vset1(1.0f / (st)[(n_rows) * (D) + (n_rows) + r_]);                       \
        for (int64_t d_ = 0; d_ < (D); d_ += VW) store_q_##TQ(dst_ + d_, vmul(vload((st) + r_ * (D) + d_), inv_)); \
    }
/* Floats of a state of n rows (acc, max, sum), rounded up to whole 64-byte lines */
#define SEG_STATE_FLOATS(n, D) ((((n) * ((D) + 2)) + 15) / 16 * 16)
#define SEG_STATE_MAX ((MAX_ROW_FLOATS + 2 * MAX_ROWS + 15) / 16 * 16)
#define DISPATCH_HEAD_DIM(TILE_FN)                                                                \
    switch (head_dim) {                                                                           \
    case 64: DISPATCH_CH(TILE_FN, 64 / VW); break;                                                \
    case 128: DISPATCH_CH(TILE_FN, 128 / VW); break;                                              \
    default: DISPATCH_CH(TILE_FN, (int)(head_dim / VW)); break;                                   \
    }
/* Whether a tile function takes key ranges (the AMX ones take whole tiles: no segments) */
#define SEGMENTS_tile_f32 1
#define SEGMENTS_tile_bf16 1
#define SEGMENTS_tile_f32_i8 1
#define SEGMENTS_tile_bf16_i8 1
#define SEGMENTS_tile_f32_e4m3 1
#define SEGMENTS_tile_bf16_e4m3 1
#define SEGMENTS_tile_f32_e5m2 1
#define SEGMENTS_tile_bf16_e5m2 1
#define SEGMENTS_tile_bf16_amx 0
#define SEGMENTS_tile_bf16_i8_amx 0
#define ENTRY_ITEM(NAME, TILE_FN)                                                                 \
    do {                                                                                          \
        const int64_t tile_index = item * heads_per_item / num_kv_heads;                          \
        const tile_t tile = tiles[tile_index];                                                    \
        int64_t first_head = item * heads_per_item % num_kv_heads, end_head = first_head + heads_per_item; \
        if (head_ranges) { /* only the tile's heads */                                            \
            if (first_head < head_ranges[2 * tile_index]) first_head = head_ranges[2 * tile_index]; \
            if (end_head > head_ranges[2 * tile_index + 1]) end_head = head_ranges[2 * tile_index + 1]; \
        }                                                                                         \
        const int64_t heads = end_head > first_head ? end_head - first_head : 0;                  \
        const int64_t rows = tile.rows * num_heads / num_kv_heads * heads;                        \
        const int64_t nh = rows <= MAX_ROWS && rows * head_dim <= MAX_ROW_FLOATS ? heads : 1;     \
        const int64_t max_len = (int64_t)tile.len0 + tile.rows - 1;                               \
        for (int64_t h = first_head; h < end_head; h += nh) {                                     \
            if (!SEGMENTS_##TILE_FN || max_len <= SEG_KEYS) {                                     \
                const int64_t seg_k0 = 0, seg_k1 = max_len;                                       \
                float *const seg_out = 0;                                                         \
                DISPATCH_HEAD_DIM(TILE_FN)                                                        \
                continue;                                                                         \
            }                                                                                     \
            NAME##_segmented(q, q_stride, k_cache, v_cache, k_scale, v_scale, tables, table_stride, tile, \
                             h, nh, end_head, num_heads, num_kv_heads, head_dim, block_size, layout, scale, \
                             next_table, next_len, out);                                          \
        }                                                                                         \
    } while (0)
/* One item's tile and heads (h .. h + nh) segment after segment, each merged into the first's
   state, then written (ENTRY_ITEM, for a tile whose rows see more than SEG_KEYS keys). Apart from
   the entry, so the entry's own tile code keeps its registers and frame. */
#define DEFINE_SEGMENTED(NAME, TQ, T, TILE_FN)                                                    \
__attribute__((noinline)) static void NAME##_segmented(const TQ *q, int64_t q_stride, const T *k_cache, \
          const T *v_cache, const uint16_t *k_scale, const uint16_t *v_scale, const int32_t *tables, \
          int64_t table_stride, const tile_t tile, int64_t h, int64_t nh, int64_t end_head,      \
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int32_t layout, \
          float scale, const int32_t *next_table, int64_t next_len, TQ *out) {                    \
    const int64_t max_len = (int64_t)tile.len0 + tile.rows - 1;                                   \
    const int64_t G = num_heads / num_kv_heads, R = tile.rows * G, n_rows = nh * R;        \
    float merged[SEG_STATE_MAX] __attribute__((aligned(64)));                             \
    float cur[SEG_STATE_MAX] __attribute__((aligned(64)));                                \
    for (int64_t seg_k0 = 0; seg_k0 < max_len; seg_k0 += SEG_KEYS) {                      \
        const int64_t seg_k1 = seg_k0 + SEG_KEYS < max_len ? seg_k0 + SEG_KEYS : max_len; \
        float *const seg_out = seg_k0 ? cur : merged;                                     \
        DISPATCH_HEAD_DIM(TILE_FN)                                                        \
        if (seg_k0) merge_segment(merged, cur, n_rows, head_dim);                          \
    }                                                                                     \
    STORE_MERGED(TQ, merged, n_rows, R, G, head_dim, tile, h)                             \
}
/* A decode call of few tiles (split_heads) where some tile sees more than SEG_KEYS keys: each
   (tile, KV head, key segment) a work item, its state kept apart, then each (tile, head)'s
   segments merged in order, as ENTRY_ITEM merges them on one thread: the same bits. Returns 0
   (nothing written) when it does not apply or memory runs out. */
#define DEFINE_SEGMENT_ITEMS(NAME, TQ, T, TILE_FN)                                                \
static int NAME##_segment_items(const TQ *q, int64_t q_stride, const T *k_cache, const T *v_cache, \
          const uint16_t *k_scale, const uint16_t *v_scale,                                       \
          const int32_t *tables, int64_t table_stride, const tile_t *tiles, int64_t num_tiles,    \
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,          \
          int32_t layout, float scale, const int32_t *head_ranges, TQ *out) {                     \
    const int64_t G = num_heads / num_kv_heads, D = head_dim;                                     \
    if (!SEGMENTS_##TILE_FN || G > MAX_ROWS || G * D > MAX_ROW_FLOATS) return 0;                  \
    int64_t num_items = 0, num_pairs = 0, longest = 0;                                            \
    for (int64_t t = 0; t < num_tiles; ++t) {                                                     \
        if (tiles[t].rows != 1) return 0;                                                         \
        const int64_t lo = head_ranges ? head_ranges[2 * t] : 0, hi = head_ranges ? head_ranges[2 * t + 1] : num_kv_heads; \
        const int64_t len = tiles[t].len0, segs = (len + SEG_KEYS - 1) / SEG_KEYS;                \
        if (hi > lo) num_items += (hi - lo) * segs, num_pairs += hi - lo;                         \
        if (len > longest) longest = len;                                                         \
    }                                                                                             \
    if (longest <= SEG_KEYS) return 0;                                                            \
    const int64_t per_item = SEG_STATE_FLOATS(G, D);                                              \
    int64_t *index = malloc((size_t)(3 * num_items + num_pairs + 1) * sizeof(int64_t));          \
    float *state = aligned_alloc(64, (size_t)(num_items * per_item) * sizeof(float));            \
    if (!index || !state) {                                                                       \
        free(index), free(state);                                                                 \
        return 0;                                                                                 \
    }                                                                                             \
    int64_t *pair_first = index + 3 * num_items, at = 0, pair = 0;                                \
    for (int64_t t = 0; t < num_tiles; ++t) { /* (tile, head, segment) in order */                \
        const int64_t lo = head_ranges ? head_ranges[2 * t] : 0, hi = head_ranges ? head_ranges[2 * t + 1] : num_kv_heads; \
        for (int64_t h = lo; h < hi; ++h) {                                                       \
            pair_first[pair++] = at;                                                              \
            for (int64_t k0 = 0; k0 < tiles[t].len0; k0 += SEG_KEYS, ++at)                        \
                index[3 * at] = t, index[3 * at + 1] = h, index[3 * at + 2] = k0;                 \
        }                                                                                         \
    }                                                                                             \
    pair_first[num_pairs] = num_items;                                                            \
    _Pragma("omp parallel")                                                                       \
    {                                                                                             \
        _Pragma("omp for schedule(dynamic, 1)")                                                   \
        for (int64_t item = 0; item < num_items; ++item) {                                        \
            const tile_t tile = tiles[index[3 * item]];                                           \
            const int64_t h = index[3 * item + 1], nh = 1, end_head = h + 1, seg_k0 = index[3 * item + 2]; \
            const int64_t seg_k1 = seg_k0 + SEG_KEYS < tile.len0 ? seg_k0 + SEG_KEYS : tile.len0; \
            float *const seg_out = state + item * per_item;                                       \
            const int32_t *const next_table = 0;                                                  \
            const int64_t next_len = 0;                                                           \
            DISPATCH_HEAD_DIM(TILE_FN)                                                            \
        }                                                                                         \
        _Pragma("omp for schedule(static)")                                                       \
        for (int64_t p = 0; p < num_pairs; ++p) {                                                 \
            float *merged = state + pair_first[p] * per_item;                                     \
            for (int64_t item = pair_first[p] + 1; item < pair_first[p + 1]; ++item)              \
                merge_segment(merged, state + item * per_item, G, D);                             \
            const tile_t tile = tiles[index[3 * pair_first[p]]];                                  \
            const int64_t h = index[3 * pair_first[p] + 1];                                       \
            STORE_MERGED(TQ, merged, G, G, G, D, tile, h)                                         \
        }                                                                                         \
    }                                                                                             \
    free(index), free(state);                                                                     \
    return 1;                                                                                     \
}
#define DEFINE_ENTRY(NAME, TQ, T, TILE_FN)                                                        \
DEFINE_SEGMENTED(NAME, TQ, T, TILE_FN)                                                            \
DEFINE_SEGMENT_ITEMS(NAME, TQ, T, TILE_FN)                                                        \
void NAME(const TQ *q, int64_t q_stride, const T *k_cache, const T *v_cache,                      \
          const uint16_t *k_scale, const uint16_t *v_scale,                                       \
          const int32_t *tables, int64_t table_stride, const tile_t *tiles, int64_t num_tiles,    \
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,          \
          int32_t layout, float scale, int32_t split_heads, const int32_t *head_ranges, TQ *out) { \
    if (split_heads && NAME##_segment_items(q, q_stride, k_cache, v_cache, k_scale, v_scale, tables, table_stride, \
                                            tiles, num_tiles, num_heads, num_kv_heads, head_dim, block_size, \
                                            layout, scale, head_ranges, out))                     \
        return;                                                                                   \
    const int64_t heads_per_item = split_heads ? 1 : num_kv_heads;                                \
    const int64_t items = num_tiles * (num_kv_heads / heads_per_item);                            \
    int decode_only = !split_heads && num_heads * head_dim <= MAX_ROW_FLOATS && num_heads <= MAX_ROWS; \
    for (int64_t i = 0; i < num_tiles && decode_only; ++i) decode_only = tiles[i].rows == 1;      \
    if (decode_only) {                                                                            \
        int64_t total = 0;                                                                        \
        for (int64_t i = 0; i < items; ++i) total += DECODE_ITEM_WEIGHT(i);                       \
        if (total == 0) return; /* no tile has a head to compute */                               \
        /* each thread a run of consecutive items with an even share of the keys (an item goes    \
           to the share its middle key falls in), then the others' last items (work_share.h) */   \
        const int64_t shares = work_share_threads(items);                                         \
        int64_t bounds[WORK_SHARE_MAX + 1], share_keys = 0, at = 0;                               \
        bounds[0] = 0;                                                                            \
        for (int64_t i = 0; i < items; ++i) {                                                     \
            const int64_t w = DECODE_ITEM_WEIGHT(i), owner = (2 * share_keys + w) * shares / (2 * total); \
            while (at < owner) bounds[++at] = i;                                                  \
            share_keys += w;                                                                      \
        }                                                                                         \
        while (at < shares) bounds[++at] = items;                                                 \
        WorkShare ws;                                                                             \
        work_share_init_bounds(&ws, bounds, shares, 1);                                           \
        _Pragma("omp parallel if(items > 1)")                                                     \
        {                                                                                         \
            const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();             \
            WorkItem it;                                                                          \
            while (work_share_next(&ws, me, threads, &it)) {                                      \
                const int64_t item = it.unit;                                                     \
                const int32_t *next_table = 0;                                                    \
                int64_t next_len = 0;                                                             \
                if (it.own && item + 1 < it.share_hi) {                                           \
                    const tile_t next_tile = tiles[item + 1];                                     \
                    next_table = tables + (int64_t)next_tile.table_row * table_stride;            \
                    next_len = next_tile.len0 + next_tile.rows - 1;                               \
                }                                                                                 \
                ENTRY_ITEM(NAME, TILE_FN);                                                        \
            }                                                                                     \
        }                                                                                         \
        return;                                                                                   \
    }                                                                                             \
    _Pragma("omp parallel for schedule(dynamic, 1) if(items > 1)")                                \
    for (int64_t item = 0; item < items; ++item) {                                                \
        const int32_t *const next_table = 0;                                                      \
        const int64_t next_len = 0;                                                               \
        ENTRY_ITEM(NAME, TILE_FN);                                                                \
    }                                                                                             \
}

/* ---- layer ops: rounding follows the PyTorch operators they replace (see below) */

/* residual += delta (when delta is given); out = rmsnorm(residual) * weight. Rows of n. */
#define DEFINE_RMS_NORM(NAME, T, LOADN, STOREN, ROUND)                                            \
void NAME(T *residual, const T *delta, const T *weight, float eps, int64_t rows, int64_t n,       \
          T *out) {                                                                               \
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")            \
    for (int64_t r = 0; r < rows; ++r) {                                                          \
        T *x = residual + r * n;                                                                  \
        vf squares = vzero();                                                                     \
        for (int64_t i = 0; i < n; i += VW) {                                                     \
            vf v = LOADN(x + i, n - i);                                                           \
            if (delta) {                                                                          \
                v = ROUND(vadd(v, LOADN(delta + r * n + i, n - i)));                              \
                STOREN(x + i, v, n - i);                                                          \
            }                                                                                     \
            squares = vfmadd(v, v, squares);                                                      \
        }                                                                                         \
        const vf inv = vset1(1.0f / sqrtf(vsum(squares) / (float)n + eps));                       \
        for (int64_t i = 0; i < n; i += VW) {                                                     \
            const vf normed = ROUND(vmul(LOADN(x + i, n - i), inv));                              \
            STOREN(out + r * n + i, vmul(LOADN(weight + i, n - i), normed), n - i);               \
        }                                                                                         \
    }                                                                                             \
}

/* out[r, :] = silu(gate_up[r, :n]) * gate_up[r, n:2n] */
#define DEFINE_SILU_MUL(NAME, T, LOADN, STOREN, ROUND)                                            \
static inline void NAME##_row(const T *gate, const T *up, int64_t n, T *out) {                    \
    for (int64_t i = 0; i < n; i += VW) {                                                         \
        const vf g = LOADN(gate + i, n - i);                                                      \
        const vf e = vexp_any(vsub(vzero(), g));                                                  \
        const vf s = ROUND(vdiv(g, vadd(vset1(1.0f), e)));                                        \
        STOREN(out + i, vmul(s, LOADN(up + i, n - i)), n - i);                                    \
    }                                                                                             \
}                                                                                                 \
void NAME(const T *gate_up, int64_t rows, int64_t n, T *out) {                                   \
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")            \
    for (int64_t r = 0; r < rows; ++r) NAME##_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, n, out + r * n); \
}                                                                                                 \
/* the same rows on the calling thread alone (no parallel region, not even an empty one): for    \
   callers inside a parallel region (quant_ops' fused SwiGLU, per tile) */                        \
void NAME##_serial(const T *gate_up, int64_t rows, int64_t n, T *out) {                          \
    for (int64_t r = 0; r < rows; ++r) NAME##_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, n, out + r * n); \
}

/* Rotary embedding in place, "rotate half" convention (see the scalar version). */
#define DEFINE_ROTARY(NAME, T, LOADN, STOREN)                                                     \
void NAME(T *x, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim,           \
          const int64_t *positions, const float *cos_table, const float *sin_table) {            \
    const int64_t half = head_dim / 2;                                                            \
    _Pragma("omp parallel for schedule(static) if(rows * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)") \
    for (int64_t t = 0; t < rows; ++t) {                                                          \
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;   \
        for (int64_t h = 0; h < num_heads; ++h) {                                                 \
            T *x1 = x + t * row_stride + h * head_dim, *x2 = x1 + half;                           \
            for (int64_t i = 0; i < half; i += VW) {                                              \
                const vf a = LOADN(x1 + i, half - i), b = LOADN(x2 + i, half - i);                \
                const vf cv = vloadn_f32(c + i, half - i), sv = vloadn_f32(s + i, half - i);      \
                STOREN(x1 + i, vsub(vmul(a, cv), vmul(b, sv)), half - i);                         \
                STOREN(x2 + i, vadd(vmul(b, cv), vmul(a, sv)), half - i);                         \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}

static inline vf vkeep_f32(vf v) { return v; }
DEFINE_RMS_NORM(rms_norm_f32, float, vloadn_f32, vstoren_f32, vkeep_f32)
DEFINE_RMS_NORM(rms_norm_bf16, bf16_t, vloadn_bf16, vstoren_bf16, vround_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, vloadn_f32, vstoren_f32, vkeep_f32)
DEFINE_SILU_MUL(silu_mul_bf16, bf16_t, vloadn_bf16, vstoren_bf16, vround_bf16)
DEFINE_ROTARY(rotary_f32, float, vloadn_f32, vstoren_f32)
DEFINE_ROTARY(rotary_bf16, bf16_t, vloadn_bf16, vstoren_bf16)

/* Per row of float32 logits [rows, n]: the first index of the maximum and
   log(sum(exp(x))), for greedy picks and the chosen token's logprob; and, where
   top_logprob is not NULL, that logprob of the maximum (max - lse). */
void row_argmax_logsumexp(const float *x, int64_t rows, int64_t n, int64_t *argmax, float *lse,
                          float *top_logprob) {
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        const vf minus_inf = vset1(-INFINITY);
        vf best = minus_inf;
        for (int64_t i = 0; i < n; i += VW)
            best = vmax(best, vselect(vfirst(n - i), vloadn_f32(row + i, n - i), minus_inf));
        const float top = vmaxall(best);
        const vf vtop = vset1(top);
        int64_t first = 0;
        for (int64_t i = 0; i < n; i += VW) { /* the first lane equal to the maximum */
            const int bits = vmask_bits(vcmpeq(vloadn_f32(row + i, n - i), vtop)) & vmask_bits(vfirst(n - i));
            if (bits) {
                first = i + __builtin_ctz((unsigned)bits);
                break;
            }
        }
        vf sum = vzero();
        for (int64_t i = 0; i < n; i += VW)
            sum = vadd(sum, vselect(vfirst(n - i), vexp(vsub(vloadn_f32(row + i, n - i), vtop)), vzero()));
        argmax[r] = first;
        lse[r] = top + logf(vsum(sum));
        if (top_logprob) top_logprob[r] = top - lse[r]; /* in float32, as torch subtracts */
    }
}

#else /* ------------------------------------------------------------ scalar kernels:
         the same arithmetic, one query row and one token at a time */

/* fp8 codes through a table (filled when the library loads): the portable
   float16 conversion per element would cost more than the arithmetic */
static float e4m3_table[256], e5m2_table[256];
__attribute__((constructor)) static void fill_fp8_tables(void) {
    for (int c = 0; c < 256; ++c) {
        e4m3_table[c] = decode_e4m3((kv8_t)c);
        e5m2_table[c] = decode_e5m2((kv8_t)c);
    }
}
static inline float lookup_e4m3(kv8_t c) { return e4m3_table[c]; }
static inline float lookup_e5m2(kv8_t c) { return e5m2_table[c]; }

#define DEFINE_TILE_SCALAR(NAME, TQ, TO_F32, FROM_F32, T, DECODE, QUANT, UNIT)                   \
static void NAME(const TQ *q, int64_t q_stride, const T *k_cache, const T *v_cache,              \
                 const uint16_t *k_scale, const uint16_t *v_scale,                                \
                 const int32_t *table, const tile_t tile, int64_t h, int64_t num_heads,           \
                 int64_t num_kv_heads, int64_t D, int64_t block_size, int32_t layout, float scale, \
                 TQ *out) {                                                                       \
    const int64_t G = num_heads / num_kv_heads, k_dim = layout ? block_size : 1;                  \
    float qs[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];                                                    \
    for (int64_t r = 0; r < tile.rows * G; ++r) {                                                 \
        const int64_t row = tile.q_row + r / G, head = h * G + r % G, len = tile.len0 + r / G;    \
        for (int64_t d = 0; d < D; ++d) {                                                         \
            qs[d] = TO_F32(q[row * q_stride + head * D + d]) * scale;                             \
            acc[d] = 0.0f;                                                                        \
        }                                                                                         \
        float run_max = -INFINITY, run_sum = 0.0f;                                                \
        for (int64_t p = 0; p < len; ++p) {                                                       \
            const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;    \
            const T *k = k_cache + key_at(slot, h, num_kv_heads, D, block_size, layout);          \
            const T *v = v_cache + value_at(slot, h, num_kv_heads, D, block_size, layout);        \
            float s = 0.0f;                                                                       \
            for (int64_t d = 0; d < D; ++d) s += qs[d] * DECODE(k[d * k_dim]);                    \
            if (QUANT) s *= f16_to_f32(k_scale[slot * num_kv_heads + h]) * (UNIT);                \
            if (s > run_max) {                                                                    \
                const float c = expf(run_max - s);                                                \
                run_sum *= c;                                                                     \
                for (int64_t d = 0; d < D; ++d) acc[d] *= c;                                      \
                run_max = s;                                                                      \
            }                                                                                     \
            const float w = expf(s - run_max);                                                    \
            run_sum += w;                                                                         \
            const float wv = QUANT ? w * f16_to_f32(v_scale[slot * num_kv_heads + h]) * (UNIT) : w; \
            for (int64_t d = 0; d < D; ++d) acc[d] += wv * DECODE(v[d]);                          \
        }                                                                                         \
        TQ *dst = out + (row * num_heads + head) * D;                                             \
        for (int64_t d = 0; d < D; ++d) dst[d] = FROM_F32(acc[d] / run_sum);                      \
    }                                                                                             \
}

DEFINE_TILE_SCALAR(tile_f32, float, f32_identity, f32_identity, float, f32_identity, 0, 1.0f)
DEFINE_TILE_SCALAR(tile_bf16, bf16_t, bf16_to_f32, f32_to_bf16, bf16_t, bf16_to_f32, 0, 1.0f)
DEFINE_TILE_SCALAR(tile_f32_i8, float, f32_identity, f32_identity, kv8_t, decode_i8, 1, I8_UNIT)
DEFINE_TILE_SCALAR(tile_bf16_i8, bf16_t, bf16_to_f32, f32_to_bf16, kv8_t, decode_i8, 1, I8_UNIT)
DEFINE_TILE_SCALAR(tile_f32_e4m3, float, f32_identity, f32_identity, kv8_t, lookup_e4m3, 1, E4M3_UNIT)
DEFINE_TILE_SCALAR(tile_bf16_e4m3, bf16_t, bf16_to_f32, f32_to_bf16, kv8_t, lookup_e4m3, 1, E4M3_UNIT)
DEFINE_TILE_SCALAR(tile_f32_e5m2, float, f32_identity, f32_identity, kv8_t, lookup_e5m2, 1, E5M2_UNIT)
DEFINE_TILE_SCALAR(tile_bf16_e5m2, bf16_t, bf16_to_f32, f32_to_bf16, kv8_t, lookup_e5m2, 1, E5M2_UNIT)

#define DEFINE_ENTRY(NAME, TQ, T, TILE_FN)                                                        \
void NAME(const TQ *q, int64_t q_stride, const T *k_cache, const T *v_cache,                     \
          const uint16_t *k_scale, const uint16_t *v_scale,                                       \
          const int32_t *tables, int64_t table_stride, const tile_t *tiles, int64_t num_tiles,    \
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,          \
          int32_t layout, float scale, int32_t split_heads, const int32_t *head_ranges, TQ *out) { \
    const int64_t items = num_tiles * num_kv_heads;                                               \
    (void)split_heads;                                                                            \
    _Pragma("omp parallel for schedule(dynamic, 1) if(items > 1)")                                \
    for (int64_t item = 0; item < items; ++item) {                                                \
        const int64_t t = item / num_kv_heads, h = item % num_kv_heads;                           \
        if (head_ranges && (h < head_ranges[2 * t] || h >= head_ranges[2 * t + 1])) continue;    \
        const tile_t tile = tiles[t];                                                             \
        TILE_FN(q, q_stride, k_cache, v_cache, k_scale, v_scale,                                  \
                tables + (int64_t)tile.table_row * table_stride,                                  \
                tile, h, num_heads, num_kv_heads, head_dim, block_size, layout, scale, out);      \
    }                                                                                             \
}


#define DEFINE_RMS_NORM(NAME, T, TO_F32, FROM_F32, ROUND)                                         \
void NAME(T *residual, const T *delta, const T *weight, float eps, int64_t rows, int64_t n,     \
          T *out) {                                                                               \
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")            \
    for (int64_t r = 0; r < rows; ++r) {                                                          \
        T *x = residual + r * n;                                                                  \
        float squares = 0.0f;                                                                     \
        for (int64_t i = 0; i < n; ++i) {                                                         \
            float v = TO_F32(x[i]);                                                               \
            if (delta) {                                                                          \
                v = ROUND(v + TO_F32(delta[r * n + i]));                                          \
                x[i] = FROM_F32(v);                                                               \
            }                                                                                     \
            squares += v * v;                                                                     \
        }                                                                                         \
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);                                 \
        for (int64_t i = 0; i < n; ++i)                                                           \
            out[r * n + i] = FROM_F32(TO_F32(weight[i]) * ROUND(TO_F32(x[i]) * inv));             \
    }                                                                                             \
}

#define DEFINE_SILU_MUL(NAME, T, TO_F32, FROM_F32, ROUND)                                         \
static inline void NAME##_row(const T *gate, const T *up, int64_t n, T *out) {                    \
    for (int64_t i = 0; i < n; ++i) {                                                             \
        const float s = ROUND(silu_f32(TO_F32(gate[i])));                                         \
        out[i] = FROM_F32(s * TO_F32(up[i]));                                                     \
    }                                                                                             \
}                                                                                                 \
void NAME(const T *gate_up, int64_t rows, int64_t n, T *out) {                                   \
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")            \
    for (int64_t r = 0; r < rows; ++r) NAME##_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, n, out + r * n); \
}                                                                                                 \
void NAME##_serial(const T *gate_up, int64_t rows, int64_t n, T *out) {                          \
    for (int64_t r = 0; r < rows; ++r) NAME##_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, n, out + r * n); \
}


void row_argmax_logsumexp(const float *x, int64_t rows, int64_t n, int64_t *argmax, float *lse,
                          float *top_logprob) {
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        int64_t first = 0;
        for (int64_t i = 1; i < n; ++i)
            if (row[i] > row[first]) first = i;
        const float top = row[first];
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) sum += expf(row[i] - top);
        argmax[r] = first;
        lse[r] = top + logf(sum);
        if (top_logprob) top_logprob[r] = top - lse[r];
    }
}

DEFINE_RMS_NORM(rms_norm_f32, float, f32_identity, f32_identity, f32_identity)
DEFINE_RMS_NORM(rms_norm_bf16, bf16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, f32_identity, f32_identity, f32_identity)
DEFINE_SILU_MUL(silu_mul_bf16, bf16_t, bf16_to_f32, f32_to_bf16, round_bf16)


/* Rotary embedding in place, "rotate half" convention: each head's halves
   (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin), the angle taken from
   row positions[t] of the float32 tables cos/sin [max_position, head_dim / 2].
   x: rows of num_heads * head_dim at row_stride elements apart. */
#define DEFINE_ROTARY(NAME, T, TO_F32, FROM_F32)                                                  \
void NAME(T *x, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim,           \
          const int64_t *positions, const float *cos_table, const float *sin_table) {            \
    const int64_t half = head_dim / 2;                                                            \
    _Pragma("omp parallel for schedule(static) if(rows * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)") \
    for (int64_t t = 0; t < rows; ++t) {                                                          \
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;   \
        for (int64_t h = 0; h < num_heads; ++h) {                                                 \
            T *x1 = x + t * row_stride + h * head_dim, *x2 = x1 + half;                           \
            for (int64_t i = 0; i < half; ++i) {                                                  \
                const float a = TO_F32(x1[i]), b = TO_F32(x2[i]);                                 \
                x1[i] = FROM_F32(a * c[i] - b * s[i]);                                            \
                x2[i] = FROM_F32(b * c[i] + a * s[i]);                                            \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_ROTARY(rotary_f32, float, f32_identity, f32_identity)
DEFINE_ROTARY(rotary_bf16, bf16_t, bf16_to_f32, f32_to_bf16)

#endif

DEFINE_ENTRY(paged_attention_f32, float, float, tile_f32)
#ifdef AMX_ATTN
DEFINE_ENTRY(paged_attention_bf16_vector, bf16_t, bf16_t, tile_bf16)
DEFINE_ENTRY(paged_attention_bf16_amx, bf16_t, bf16_t, tile_bf16_amx)
DEFINE_ENTRY(paged_attention_bf16_i8_vector, bf16_t, kv8_t, tile_bf16_i8)
DEFINE_ENTRY(paged_attention_bf16_i8_amx, bf16_t, kv8_t, tile_bf16_i8_amx)
/* Whether bfloat16 and int8 caches take the AMX tiles (bfloat16 queries): where the CPU has them, unless
   PAGEDLLM_ATTENTION_AMX=0 (set_attention_amx switches at run time, for tests and benches). */
int attention_amx(void) {
    if (amx_attention_on < 0) {
        const char *env = getenv("PAGEDLLM_ATTENTION_AMX");
        amx_attention_on = env && strcmp(env, "0") == 0 ? 0 : amx_attention_probe();
    }
    return amx_attention_on;
}
int set_attention_amx(int on) {
    amx_attention_on = on && amx_attention_probe();
    return amx_attention_on;
}
/* bfloat16 queries over a cache of T: the tiles where they run, else the vector kernels */
#define DEFINE_AMX_DISPATCH(NAME, T, UNIT)                                                        \
void NAME(const bf16_t *q, int64_t q_stride, const T *k_cache, const T *v_cache,                  \
          const uint16_t *k_scale, const uint16_t *v_scale, const int32_t *tables,                \
          int64_t table_stride, const tile_t *tiles, int64_t num_tiles, int64_t num_heads,        \
          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int32_t layout, float scale, \
          int32_t split_heads, const int32_t *head_ranges, bf16_t *out) {                         \
    const int amx = head_dim % 32 == 0 && head_dim <= AMX_MAX_HEAD_DIM && layout == KV_LAYOUT_TOKEN \
                    && attention_amx() && (UNIT);                                                 \
    (amx ? NAME##_amx : NAME##_vector)(q, q_stride, k_cache, v_cache, k_scale, v_scale, tables,  \
                                       table_stride, tiles, num_tiles, num_heads, num_kv_heads,   \
                                       head_dim, block_size, layout, scale, split_heads,          \
                                       head_ranges, out);                                         \
}
DEFINE_AMX_DISPATCH(paged_attention_bf16, bf16_t, 1)
DEFINE_AMX_DISPATCH(paged_attention_bf16_i8, kv8_t, amx_int8_unit())
#else
DEFINE_ENTRY(paged_attention_bf16, bf16_t, bf16_t, tile_bf16)
DEFINE_ENTRY(paged_attention_bf16_i8, bf16_t, kv8_t, tile_bf16_i8)
int attention_amx(void) { return 0; }
int set_attention_amx(int on) { (void)on; return 0; }
#endif
DEFINE_ENTRY(paged_attention_f32_i8, float, kv8_t, tile_f32_i8)
DEFINE_ENTRY(paged_attention_f32_e4m3, float, kv8_t, tile_f32_e4m3)
DEFINE_ENTRY(paged_attention_bf16_e4m3, bf16_t, kv8_t, tile_bf16_e4m3)
DEFINE_ENTRY(paged_attention_f32_e5m2, float, kv8_t, tile_f32_e5m2)
DEFINE_ENTRY(paged_attention_bf16_e5m2, bf16_t, kv8_t, tile_bf16_e5m2)

/* Token t's K and V rows (kv_heads x head_dim elements each, at k_stride / v_stride
   elements apart) go to cache slot slots[t] (blocks of block_size slots in `layout`); slot
   -1 is padding and skipped. */
#define DEFINE_WRITE_KV(NAME, T)                                                                  \
void NAME(const T *k, int64_t k_stride, const T *v, int64_t v_stride, const int64_t *slots,      \
          int64_t rows, int64_t kv_heads, int64_t head_dim, T *k_cache, T *v_cache,               \
          int64_t block_size, int32_t layout) {                                                   \
    const int64_t width = kv_heads * head_dim;                                                    \
    for (int64_t t = 0; t < rows; ++t) {                                                          \
        if (slots[t] < 0) continue;                                                               \
        if (layout == KV_LAYOUT_TOKEN) {                                                          \
            memcpy(k_cache + slots[t] * width, k + t * k_stride, (size_t)width * sizeof(T));      \
            memcpy(v_cache + slots[t] * width, v + t * v_stride, (size_t)width * sizeof(T));      \
            continue;                                                                             \
        }                                                                                         \
        for (int64_t h = 0; h < kv_heads; ++h) {                                                  \
            T *kd = k_cache + key_at(slots[t], h, kv_heads, head_dim, block_size, layout);        \
            const T *ks = k + t * k_stride + h * head_dim;                                        \
            for (int64_t d = 0; d < head_dim; ++d) kd[d * block_size] = ks[d];                    \
            memcpy(v_cache + value_at(slots[t], h, kv_heads, head_dim, block_size, layout),       \
                   v + t * v_stride + h * head_dim, (size_t)head_dim * sizeof(T));                \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_WRITE_KV(write_kv_f32, float)
DEFINE_WRITE_KV(write_kv_bf16, bf16_t)

/* Token t's K and V (kv_heads x head_dim, rows at k_stride / v_stride elements
   apart) quantized into cache slot slots[t]: per head, scale = float16(absmax /
   QMAX) raised to 2^-14, code = ENCODE(clamp(x / scale)); as kv_format.quantize_kv. */
static inline void quantize_head_f32(const float *x, int64_t D, float qmax, kv8_t (*encode)(float),
                                     kv8_t *codes, uint16_t *scale) {
#if VW == 16 || VW == 8
    if (encode == encode_i8 && D % VW == 0) { /* the same arithmetic in registers (rint: nearest even) */
        vf top = vzero();
        for (int64_t d = 0; d < D; d += VW) top = vmax(top, vabs(vloadu_f32(x + d)));
        uint16_t s16 = f32_to_f16(vmaxall(top) / qmax);
        if (s16 < MIN_SCALE_F16) s16 = MIN_SCALE_F16;
        const vf s = vset1(f16_to_f32(s16)), hi = vset1(qmax), lo = vset1(-qmax);
        for (int64_t d = 0; d < D; d += VW)
            vstore_i8(codes + d, vround_int(vmin(vmax(vdiv(vloadu_f32(x + d), s), lo), hi)));
        *scale = s16;
        return;
    }
#endif
    float absmax = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
        const float a = fabsf(x[d]);
        absmax = a > absmax ? a : absmax;
    }
    uint16_t s16 = f32_to_f16(absmax / qmax);
    if (s16 < MIN_SCALE_F16) s16 = MIN_SCALE_F16;
    const float s = f16_to_f32(s16);
    for (int64_t d = 0; d < D; ++d) codes[d] = encode(fminf(fmaxf(x[d] / s, -qmax), qmax));
    *scale = s16;
}

#define DEFINE_WRITE_KV_Q(NAME, T, TO_F32, ENCODE, QMAX)                                          \
void NAME(const T *k, int64_t k_stride, const T *v, int64_t v_stride, const int64_t *slots,      \
          int64_t rows, int64_t kv_heads, int64_t head_dim, kv8_t *k_cache, kv8_t *v_cache,       \
          uint16_t *k_scale, uint16_t *v_scale, int64_t block_size, int32_t layout) {             \
    _Pragma("omp parallel for schedule(static) if(rows * kv_heads * head_dim >= PARALLEL_MIN_ELEMENTS)") \
    for (int64_t t = 0; t < rows; ++t) {                                                          \
        if (slots[t] < 0) continue;                                                               \
        float x[MAX_HEAD_DIM];                                                                    \
        kv8_t codes[MAX_HEAD_DIM];                                                                \
        for (int64_t h = 0; h < kv_heads; ++h) {                                                  \
            const int64_t at = slots[t] * kv_heads + h;                                           \
            kv8_t *kd = k_cache + key_at(slots[t], h, kv_heads, head_dim, block_size, layout);    \
            for (int64_t d = 0; d < head_dim; ++d) x[d] = TO_F32(k[t * k_stride + h * head_dim + d]); \
            quantize_head_f32(x, head_dim, QMAX, ENCODE, layout ? codes : kd, k_scale + at);      \
            if (layout)                                                                           \
                for (int64_t d = 0; d < head_dim; ++d) kd[d * block_size] = codes[d];             \
            for (int64_t d = 0; d < head_dim; ++d) x[d] = TO_F32(v[t * v_stride + h * head_dim + d]); \
            quantize_head_f32(x, head_dim, QMAX, ENCODE,                                          \
                              v_cache + value_at(slots[t], h, kv_heads, head_dim, block_size, layout), \
                              v_scale + at);                                                      \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_WRITE_KV_Q(write_kv_f32_i8, float, f32_identity, encode_i8, 127.0f)
DEFINE_WRITE_KV_Q(write_kv_bf16_i8, bf16_t, bf16_to_f32, encode_i8, 127.0f)
DEFINE_WRITE_KV_Q(write_kv_f32_e4m3, float, f32_identity, encode_e4m3, 448.0f)
DEFINE_WRITE_KV_Q(write_kv_bf16_e4m3, bf16_t, bf16_to_f32, encode_e4m3, 448.0f)
DEFINE_WRITE_KV_Q(write_kv_f32_e5m2, float, f32_identity, encode_e5m2, 57344.0f)
DEFINE_WRITE_KV_Q(write_kv_bf16_e5m2, bf16_t, bf16_to_f32, encode_e5m2, 57344.0f)

/* In place: each head_dim-long vector (heads vectors per row, rows row_stride floats apart)
   becomes its Walsh-Hadamard transform (the Sylvester matrix of +-1 entries, not normalised:
   applying it twice multiplies by head_dim), times scale. head_dim is a power of two. The
   butterflies run from the widest stride to 1, one rounding per add, so the result is bit for
   bit that of kv_format.hadamard's PyTorch version. int8 KV caches store their vectors so
   rotated (kv_format.py): the rotation spreads a head's few large channels over all of them. */
static inline void hadamard_head(float *v, int64_t head_dim, float scale) {
#if VW > 1
    if (head_dim >= VW) { /* strides of a register or more across registers, then the rest within */
        for (int64_t half = head_dim / 2; half >= VW; half /= 2)
            for (int64_t base = 0; base < head_dim; base += 2 * half)
                for (int64_t j = base; j < base + half; j += VW) {
                    const vf a = vloadu_f32(v + j), b = vloadu_f32(v + j + half);
                    vstoreu_f32(v + j, vadd(a, b));
                    vstoreu_f32(v + j + half, vsub(a, b));
                }
        const vf vs = vset1(scale);
        for (int64_t j = 0; j < head_dim; j += VW) {
            const vf y = vhadamard_lanes(vloadu_f32(v + j));
            vstoreu_f32(v + j, scale != 1.0f ? vmul(y, vs) : y);
        }
        return;
    }
#endif
    for (int64_t half = head_dim / 2; half >= 1; half /= 2)
        for (int64_t base = 0; base < head_dim; base += 2 * half)
            for (int64_t j = base; j < base + half; ++j) {
                const float a = v[j], b = v[j + half];
                v[j] = a + b;
                v[j + half] = a - b;
            }
    if (scale != 1.0f)
        for (int64_t d = 0; d < head_dim; ++d) v[d] *= scale;
}

void hadamard_f32(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, float scale) {
    _Pragma("omp parallel for schedule(static) if(rows * heads * head_dim >= 262144)")
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) hadamard_head(x + r * row_stride + h * head_dim, head_dim, scale);
}

/* hadamard_f32 for bfloat16 rows, as the modules do it (kv_format.rotate): each head of x
   [rows][row_stride] widened to float32, transformed, times scale; then the first
   narrow_heads heads written back to x rounded to bfloat16 (torch's .to), and, when y is
   given, every head to y [rows][y_stride] in float32. One pass over the rows. */
void hadamard_bf16(bf16_t *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, float scale,
                   int64_t narrow_heads, float *y, int64_t y_stride) {
    _Pragma("omp parallel for schedule(static) if(rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)")
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
            bf16_t *v16 = x + r * row_stride + h * head_dim;
            float buf[MAX_HEAD_DIM], *v = y ? y + r * y_stride + h * head_dim : buf;
            int64_t d0 = 0;
#if VW > 1
            for (; d0 + VW <= head_dim; d0 += VW) vstoreu_f32(v + d0, vloadu_bf16(v16 + d0));
#endif
            for (int64_t d = d0; d < head_dim; ++d) v[d] = bf16_to_f32(v16[d]);
            hadamard_head(v, head_dim, scale);
            if (h >= narrow_heads) continue;
            d0 = 0;
#if VW > 1
            for (; d0 + VW <= head_dim; d0 += VW) vstoreu_bf16(v16 + d0, vloadu_f32(v + d0));
#endif
            for (int64_t d = d0; d < head_dim; ++d) v16[d] = f32_to_bf16(v[d]);
        }
}

/* The disk tier's block moves (pagedllm.kv.tiers). A raw block is one block's slice of each
   of nt tensors, back to back: row[k] bytes of tensor k, whose block b starts at
   tensors[k] + b * row[k]. A raw block holds every slice in the token-major order
   ([B][KH][D], KV_LAYOUT_TOKEN), whatever the pool's layout, so a tier's files do not depend
   on it: kinds[k] says how tensor k lays out its block (0: as the raw block; 1: a
   KV_LAYOUT_HEAD key, [KH][D][B]; 2: a KV_LAYOUT_HEAD value, [KH][B][D]; shape[] = B, KH,
   D). scatter_blocks stores raw block raws[i] into block ids[i] of every tensor;
   gather_blocks copies them out. Plain copies, so any dtype; blocks split between the
   threads when there are enough bytes to share. */
/* D elements of type T: the block's, B apart from `strided`, to or from the raw ones at `packed` */
#define MOVE_STRIDED(T, strided, packed, D, B, into_block)                                         \
    do {                                                                                          \
        T *s_ = (T *)(void *)(strided), *p_ = (T *)(void *)(packed);                              \
        if (into_block)                                                                           \
            for (int64_t d_ = 0; d_ < (D); ++d_) s_[d_ * (B)] = p_[d_];                           \
        else                                                                                      \
            for (int64_t d_ = 0; d_ < (D); ++d_) p_[d_] = s_[d_ * (B)];                           \
    } while (0)
static inline void move_slice(uint8_t *block, uint8_t *raw, int64_t bytes, int32_t kind, const int64_t *shape,
                              int into_block) {
    if (kind == 0) {
        if (into_block) memcpy(block, raw, (size_t)bytes);
        else memcpy(raw, block, (size_t)bytes);
        return;
    }
    const int64_t B = shape[0], KH = shape[1], D = shape[2], e = bytes / (B * KH * D);
    for (int64_t t = 0; t < B; ++t)
        for (int64_t h = 0; h < KH; ++h) {
            uint8_t *r = raw + (t * KH + h) * D * e;
            if (kind == 2) {
                uint8_t *v = block + value_at(t, h, KH, D, B, KV_LAYOUT_HEAD) * e;
                if (into_block) memcpy(v, r, (size_t)(D * e));
                else memcpy(r, v, (size_t)(D * e));
                continue;
            }
            uint8_t *k = block + key_at(t, h, KH, D, B, KV_LAYOUT_HEAD) * e; /* dim d at k + d * B * e */
            switch (e) { /* typed copies the compiler can unroll (a key's dims are B elements apart) */
            case 4: MOVE_STRIDED(uint32_t, k, r, D, B, into_block); break;
            case 2: MOVE_STRIDED(uint16_t, k, r, D, B, into_block); break;
            case 1: MOVE_STRIDED(uint8_t, k, r, D, B, into_block); break;
            default:
                for (int64_t d = 0; d < D; ++d) {
                    if (into_block) memcpy(k + d * B * e, r + d * e, (size_t)e);
                    else memcpy(r + d * e, k + d * B * e, (size_t)e);
                }
            }
        }
}

void scatter_blocks(int64_t n, const int64_t *ids, uint8_t *const *raws, int64_t nt, uint8_t *const *tensors,
                    const int64_t *row, const int32_t *kinds, const int64_t *shape, int64_t parallel) {
    _Pragma("omp parallel for schedule(static) if(parallel)")
    for (int64_t i = 0; i < n; ++i) {
        uint8_t *src = raws[i];
        for (int64_t k = 0; k < nt; ++k) {
            move_slice(tensors[k] + ids[i] * row[k], src, row[k], kinds[k], shape, 1);
            src += row[k];
        }
    }
}

void gather_blocks(int64_t n, const int64_t *ids, uint8_t *const *raws, int64_t nt, uint8_t *const *tensors,
                   const int64_t *row, const int32_t *kinds, const int64_t *shape, int64_t parallel) {
    _Pragma("omp parallel for schedule(static) if(parallel)")
    for (int64_t i = 0; i < n; ++i) {
        uint8_t *dst = raws[i];
        for (int64_t k = 0; k < nt; ++k) {
            move_slice(tensors[k] + ids[i] * row[k], dst, row[k], kinds[k], shape, 0);
            dst += row[k];
        }
    }
}

/* Which build this is, for cpu_ops.py: floats per vector register, and the ISA path's name. */
int vector_width(void) { return VW; }
const char *isa_name(void) { return ISA_NAME; }
