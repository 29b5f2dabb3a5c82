/* Native CPU kernels of pagedllm: paged attention that reads K/V through the
 * block table in place, and the element-wise work of a decoder layer (the
 * "layer ops" at the end of this file).
 *
 * Built by cpu_ops.py with the system C compiler on first use and called
 * through ctypes; no PyTorch headers. Parallel loops use the OpenMP runtime
 * PyTorch has already loaded, so the two share one thread pool.
 *
 * The unit of work is a tile: up to a few consecutive query tokens of one
 * sequence (a decode token is a tile of one) against one KV head. Row i of a
 * tile attends to the first len0 + i tokens of its sequence, which is the
 * causal mask for prefill tokens and the whole context for a decode token.
 * All query heads that share the KV head are computed together, so each K/V
 * row is read once per tile.
 *
 * With AVX-512, keys are taken 16 tokens at a time, transposed in registers
 * into [head_dim][16], so every query row's 16 scores come out of one chain of
 * fused multiply-adds with no horizontal sums; softmax is online in float32.
 * Without AVX-512 a plain scalar loop computes the same thing (the attention
 * backend then uses it for decode-only steps, where it still beats PyTorch).
 *
 * Caches: [num_blocks, block_size, num_kv_heads, head_dim], float32 or
 * bfloat16 (query and output in the cache's dtype). Arithmetic is float32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The same limits are in cpu_ops.py, which sizes the tiles. */
#define MAX_HEAD_DIM 256
#define MAX_ROWS 64        /* query rows (tile tokens x heads per KV head) in a tile */
#define MAX_ROW_FLOATS 8192 /* rows x head_dim must fit: 64 x 128 or 32 x 256 */

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

/* One tile: which sequence, which query rows, how far row 0 sees. */
typedef struct {
    int32_t table_row; /* row of the block-table tensor */
    int32_t q_row;     /* first query row of the tile */
    int32_t len0;      /* row i attends to tokens [0, len0 + i) */
    int32_t rows;      /* query tokens in the tile */
} tile_t;

#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 vround_bf16(__m512 v) { /* round to bf16 and back (RNE) */
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline __m512 mload_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 mload_bf16(const bf16_t *p, __mmask16 m) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline void mstore_f32(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void mstore_bf16(bf16_t *p, __m512 v, __mmask16 m) {
    /* v already holds a bf16 value (rounded by vround_bf16): keep its high halves */
    __m256i halves = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
    _mm256_mask_storeu_epi16(p, m, halves);
}
static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1u);
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const bf16_t *p) { return mload_bf16(p, (__mmask16)0xffff); }
static inline void store16_f32(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16_bf16(bf16_t *p, __m512 v) { mstore_bf16(p, vround_bf16(v), (__mmask16)0xffff); }

/* exp(x) for x <= 0 (softmax arguments): 2^k * 2^f, f in [-1/2, 1/2], with a
   degree-6 polynomial for 2^f (relative error below 3e-7). */
static inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
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

/* r[j] (row j, 16 floats) becomes column j of the 16 x 16 matrix. */
static inline void transpose16(__m512 r[16]) {
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

/* acc[r] = acc[r] * corr[r] + sum_t P[r][t] V[t] for NR rows from row r0; NR and
   CH are compile-time constants at every call, so a[][] lives in registers and
   each V row is loaded once for all NR rows. */
#define DEFINE_ACCUMULATE_V(NAME, T, LOAD16)                                                      \
static inline __attribute__((always_inline)) void NAME(                                           \
    float *acc, const float *P, const float *corr, const T *vb, int64_t tok_stride, int64_t n,    \
    int64_t r0, const int NR, const int CH, const char *prefetch, int64_t prefetch_rows,          \
    int64_t stride_bytes, int64_t row_bytes) {                                                    \
    const int64_t D = 16 * CH;                                                                    \
    __m512 a[4][16];                                                                              \
    for (int j = 0; j < NR; ++j) {                                                                \
        const __m512 scale = _mm512_set1_ps(corr[r0 + j]);                                        \
        for (int c = 0; c < CH; ++c)                                                              \
            a[j][c] = _mm512_mul_ps(_mm512_load_ps(acc + (r0 + j) * D + 16 * c), scale);          \
    }                                                                                             \
    for (int64_t t = 0; t < n; ++t) {                                                             \
        const T *vrow = vb + t * tok_stride;                                                      \
        if (t < prefetch_rows)                                                                    \
            for (int64_t byte = 0; byte < row_bytes; byte += 64)                                  \
                _mm_prefetch(prefetch + t * stride_bytes + byte, _MM_HINT_T0);                    \
        __m512 p[4];                                                                              \
        for (int j = 0; j < NR; ++j) p[j] = _mm512_set1_ps(P[(r0 + j) * 16 + t]);                 \
        for (int c = 0; c < CH; ++c) {                                                            \
            const __m512 v = LOAD16(vrow + 16 * c);                                               \
            for (int j = 0; j < NR; ++j) a[j][c] = _mm512_fmadd_ps(p[j], v, a[j][c]);             \
        }                                                                                         \
    }                                                                                             \
    for (int j = 0; j < NR; ++j)                                                                  \
        for (int c = 0; c < CH; ++c) _mm512_store_ps(acc + (r0 + j) * D + 16 * c, a[j][c]);       \
}
DEFINE_ACCUMULATE_V(accumulate_v_f32, float, load16_f32)
DEFINE_ACCUMULATE_V(accumulate_v_bf16, bf16_t, load16_bf16)

/* The tile kernel. CH = head_dim / 16 is a compile-time constant in each
   instantiation, so the accumulators below live in registers. */
#define DEFINE_TILE(NAME, T, LOAD16, STORE16, ACCUMULATE_V)                                                     \
static inline __attribute__((always_inline)) void NAME(                                           \
    const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int32_t *table,       \
    const tile_t tile, int64_t h, int64_t num_heads, int64_t num_kv_heads, const int CH,          \
    int64_t block_size, float scale, int64_t next_head, T *out) {                                \
    const int64_t D = 16 * CH, G = num_heads / num_kv_heads, R = tile.rows * G;                   \
    const int64_t tok_stride = num_kv_heads * D, max_len = tile.len0 + tile.rows - 1;             \
    float Q[MAX_ROW_FLOATS] __attribute__((aligned(64)));   /* [R][D], pre-scaled */             \
    float acc[MAX_ROW_FLOATS] __attribute__((aligned(64))); /* [R][D] */                         \
    float KT[MAX_HEAD_DIM * 16] __attribute__((aligned(64))); /* [D][16] */                      \
    float P[MAX_ROWS * 16] __attribute__((aligned(64)));    /* [R][16] */                        \
    float run_max[MAX_ROWS], run_sum[MAX_ROWS], corr[MAX_ROWS];                                   \
    const __m512 vscale = _mm512_set1_ps(scale);                                                  \
    for (int64_t r = 0; r < R; ++r) {                                                             \
        const T *src = q + (tile.q_row + r / G) * q_stride + (h * G + r % G) * D;                 \
        for (int c = 0; c < CH; ++c) {                                                            \
            _mm512_store_ps(Q + r * D + 16 * c, _mm512_mul_ps(LOAD16(src + 16 * c), vscale));     \
            _mm512_store_ps(acc + r * D + 16 * c, _mm512_setzero_ps());                           \
        }                                                                                         \
        run_max[r] = -INFINITY;                                                                   \
        run_sum[r] = 0.0f;                                                                        \
    }                                                                                             \
    for (int64_t start = 0; start < max_len;) {                                                   \
        const int64_t block = table[start / block_size], offset = start % block_size;            \
        int64_t n = block_size - offset;                                                          \
        if (n > 16) n = 16;                                                                       \
        if (n > max_len - start) n = max_len - start;                                             \
        const T *kb = k_cache + ((block * block_size + offset) * num_kv_heads + h) * D;          \
        const T *vb = v_cache + ((block * block_size + offset) * num_kv_heads + h) * D;          \
        /* the next chunk's rows, prefetched a few lines at a time inside the loops below */     \
        int64_t ahead = 0;                                                                        \
        const char *nk = (const char *)kb, *nv = (const char *)vb;                                \
        if (start + n < max_len) {                                                                \
            const int64_t next = start + n, nblock = table[next / block_size];                    \
            ahead = max_len - next < 16 ? max_len - next : 16;                                    \
            const int64_t at = ((nblock * block_size + next % block_size) * num_kv_heads + h) * D; \
            nk = (const char *)(k_cache + at);                                                    \
            nv = (const char *)(v_cache + at);                                                    \
        } else if (next_head >= 0) { /* last chunk: the next KV head's first one */              \
            ahead = max_len < 16 ? max_len : 16;                                                  \
            if (ahead > block_size) ahead = block_size;                                           \
            const int64_t at = ((int64_t)table[0] * block_size * num_kv_heads + next_head) * D;   \
            nk = (const char *)(k_cache + at);                                                    \
            nv = (const char *)(v_cache + at);                                                    \
        }                                                                                         \
        const int64_t stride_bytes = tok_stride * (int64_t)sizeof(T), row_bytes = D * (int64_t)sizeof(T); \
        for (int c = 0; c < CH; ++c) { /* keys -> KT[d][token] */                                 \
            __m512 rows[16];                                                                      \
            for (int t = 0; t < 16; ++t)                                                          \
                rows[t] = t < n ? LOAD16(kb + t * tok_stride + 16 * c) : _mm512_setzero_ps();     \
            if (64 * c < row_bytes)                                                               \
                for (int64_t t = 0; t < ahead; ++t) _mm_prefetch(nk + t * stride_bytes + 64 * c, _MM_HINT_T0); \
            transpose16(rows);                                                                    \
            for (int j = 0; j < 16; ++j) _mm512_store_ps(KT + (16 * c + j) * 16, rows[j]);        \
        }                                                                                         \
        /* rows whose length ends before this chunk see none of it */                             \
        int64_t first = start - tile.len0 + 1;                                                    \
        if (first < 0) first = 0;                                                                 \
        const int64_t r_first = first * G;                                                        \
        for (int64_t r = r_first; r < R; r += 4) {                                                \
            const int nr = R - r < 4 ? (int)(R - r) : 4;                                          \
            __m512 even[4], odd[4];                                                               \
            for (int j = 0; j < 4; ++j) even[j] = odd[j] = _mm512_setzero_ps();                   \
            for (int64_t d = 0; d < D; d += 2) {                                                  \
                const __m512 k0 = _mm512_load_ps(KT + d * 16), k1 = _mm512_load_ps(KT + d * 16 + 16); \
                for (int j = 0; j < nr; ++j) {                                                    \
                    even[j] = _mm512_fmadd_ps(_mm512_set1_ps(Q[(r + j) * D + d]), k0, even[j]);   \
                    odd[j] = _mm512_fmadd_ps(_mm512_set1_ps(Q[(r + j) * D + d + 1]), k1, odd[j]); \
                }                                                                                 \
            }                                                                                     \
            for (int j = 0; j < nr; ++j) {                                                        \
                const int64_t row = r + j;                                                        \
                int64_t visible = tile.len0 + row / G - start;                                    \
                if (visible > n) visible = n;                                                     \
                const __mmask16 mask = (__mmask16)((1u << visible) - 1u);                         \
                const __m512 s = _mm512_add_ps(even[j], odd[j]);                                  \
                const float block_max = _mm512_mask_reduce_max_ps(mask, s);                       \
                const float new_max = block_max > run_max[row] ? block_max : run_max[row];        \
                corr[row] = expf(run_max[row] - new_max);                                         \
                const __m512 p = _mm512_maskz_mov_ps(mask, vexp(_mm512_sub_ps(s, _mm512_set1_ps(new_max)))); \
                run_sum[row] = run_sum[row] * corr[row] + _mm512_reduce_add_ps(p);                \
                run_max[row] = new_max;                                                           \
                _mm512_store_ps(P + row * 16, p);                                                 \
            }                                                                                     \
        }                                                                                         \
        /* acc = acc * corr + P @ V, up to four rows per pass (two for wide heads); the first \
           pass also prefetches the next chunk's values */                                        \
        const int per_pass = CH <= 4 ? 4 : 2;                                                     \
        for (int64_t r = r_first; r < R; r += per_pass) {                                         \
            const int64_t pf = r == r_first ? ahead : 0;                                          \
            switch (R - r < per_pass ? (int)(R - r) : per_pass) {                                 \
            case 4: ACCUMULATE_V(acc, P, corr, vb, tok_stride, n, r, 4, CH, nv, pf, stride_bytes, row_bytes); break; \
            case 3: ACCUMULATE_V(acc, P, corr, vb, tok_stride, n, r, 3, CH, nv, pf, stride_bytes, row_bytes); break; \
            case 2: ACCUMULATE_V(acc, P, corr, vb, tok_stride, n, r, 2, CH, nv, pf, stride_bytes, row_bytes); break; \
            default: ACCUMULATE_V(acc, P, corr, vb, tok_stride, n, r, 1, CH, nv, pf, stride_bytes, row_bytes); break; \
            }                                                                                     \
        }                                                                                         \
        start += n;                                                                               \
    }                                                                                             \
    for (int64_t r = 0; r < R; ++r) {                                                             \
        T *dst = out + ((tile.q_row + r / G) * num_heads + h * G + r % G) * D;                    \
        const __m512 inv = _mm512_set1_ps(1.0f / run_sum[r]);                                     \
        for (int c = 0; c < CH; ++c) STORE16(dst + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc + r * D + 16 * c), inv)); \
    }                                                                                             \
}

DEFINE_TILE(tile_f32, float, load16_f32, store16_f32, accumulate_v_f32)
DEFINE_TILE(tile_bf16, bf16_t, load16_bf16, store16_bf16, accumulate_v_bf16)

#define DISPATCH_CH(TILE_FN, CH_VALUE)                                                            \
    TILE_FN(q, q_stride, k_cache, v_cache, tables + (int64_t)tile.table_row * table_stride, tile, \
            h, num_heads, num_kv_heads, CH_VALUE, block_size, scale,                              \
            h + 1 < first_head + heads_per_item ? h + 1 : -1, out)

/* One work item is a tile and either one KV head (split_heads: more items, for
   small batches) or all of them in turn (each K/V block then streams whole). */
#define DEFINE_ENTRY(NAME, T, TILE_FN)                                                            \
void NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                      \
          const int32_t *tables, int64_t table_stride, const tile_t *tiles, int64_t num_tiles,    \
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,          \
          float scale, int32_t split_heads, T *out) {                                             \
    const int64_t heads_per_item = split_heads ? 1 : num_kv_heads;                                \
    const int64_t items = num_tiles * (num_kv_heads / heads_per_item);                            \
    _Pragma("omp parallel for schedule(dynamic, 1) if(items > 1)")                                \
    for (int64_t item = 0; item < items; ++item) {                                                \
        const tile_t tile = tiles[item * heads_per_item / num_kv_heads];                          \
        const int64_t first_head = item * heads_per_item % num_kv_heads;                          \
        for (int64_t h = first_head; h < first_head + heads_per_item; ++h) {                      \
            switch (head_dim / 16) {                                                              \
            case 4: DISPATCH_CH(TILE_FN, 4); break;                                               \
            case 8: DISPATCH_CH(TILE_FN, 8); break;                                               \
            default: DISPATCH_CH(TILE_FN, (int)(head_dim / 16)); break;                           \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}

int vector_width(void) { return 16; }

#else /* portable scalar path: the same arithmetic, one query row and one token at a time */

#define DEFINE_TILE_SCALAR(NAME, T, TO_F32, FROM_F32)                                             \
static void NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,               \
                 const int32_t *table, const tile_t tile, int64_t h, int64_t num_heads,           \
                 int64_t num_kv_heads, int64_t D, int64_t block_size, float scale, T *out) {      \
    const int64_t G = num_heads / num_kv_heads, tok_stride = num_kv_heads * D;                    \
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
            const T *k = k_cache + (slot * num_kv_heads + h) * D;                                 \
            const T *v = v_cache + (slot * num_kv_heads + h) * D;                                 \
            float s = 0.0f;                                                                       \
            for (int64_t d = 0; d < D; ++d) s += qs[d] * TO_F32(k[d]);                            \
            if (s > run_max) {                                                                    \
                const float c = expf(run_max - s);                                                \
                run_sum *= c;                                                                     \
                for (int64_t d = 0; d < D; ++d) acc[d] *= c;                                      \
                run_max = s;                                                                      \
            }                                                                                     \
            const float w = expf(s - run_max);                                                    \
            run_sum += w;                                                                         \
            for (int64_t d = 0; d < D; ++d) acc[d] += w * TO_F32(v[d]);                           \
        }                                                                                         \
        T *dst = out + (row * num_heads + head) * D;                                              \
        for (int64_t d = 0; d < D; ++d) dst[d] = FROM_F32(acc[d] / run_sum);                      \
    }                                                                                             \
    (void)tok_stride;                                                                             \
}

DEFINE_TILE_SCALAR(tile_f32, float, f32_identity, f32_identity)
DEFINE_TILE_SCALAR(tile_bf16, bf16_t, bf16_to_f32, f32_to_bf16)

#define DEFINE_ENTRY(NAME, T, TILE_FN)                                                            \
void NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                      \
          const int32_t *tables, int64_t table_stride, const tile_t *tiles, int64_t num_tiles,    \
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,          \
          float scale, int32_t split_heads, T *out) {                                             \
    const int64_t items = num_tiles * num_kv_heads;                                               \
    (void)split_heads;                                                                            \
    _Pragma("omp parallel for schedule(dynamic, 1) if(items > 1)")                                \
    for (int64_t item = 0; item < items; ++item) {                                                \
        const tile_t tile = tiles[item / num_kv_heads];                                           \
        TILE_FN(q, q_stride, k_cache, v_cache, tables + (int64_t)tile.table_row * table_stride,   \
                tile, item % num_kv_heads, num_heads, num_kv_heads, head_dim, block_size, scale,  \
                out);                                                                             \
    }                                                                                             \
}

int vector_width(void) { return 1; }

#endif

DEFINE_ENTRY(paged_attention_f32, float, tile_f32)
DEFINE_ENTRY(paged_attention_bf16, bf16_t, tile_bf16)

/* ------------------------------------------------------------------ layer ops
 *
 * Element-wise work around the matmuls of a decoder layer, one pass each
 * instead of several PyTorch operators. Rounding follows what the PyTorch
 * operators they replace do: bfloat16 results are rounded once per operator
 * the model would have run (the residual add, the normalised value, the
 * product with the weight; SiLU, then the product with `up`).
 */

#define PARALLEL_MIN_ELEMENTS 65536 /* below this a parallel region costs more than it saves */

static inline float silu_f32(float x) { return x / (1.0f + expf(-x)); }
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#ifdef __AVX512F__
static inline __m512 vexp_any(__m512 x) { /* exp for any x: overflow gives inf, underflow 0 */
    return vexp(_mm512_min_ps(x, _mm512_set1_ps(88.7f)));
}

/* residual += delta (when delta is given); out = rmsnorm(residual) * weight. Rows of n. */
#define DEFINE_RMS_NORM(NAME, T, MLOAD, MSTORE, ROUND)                                            \
void NAME(T *residual, const T *delta, const T *weight, float eps, int64_t rows, int64_t n,     \
          T *out) {                                                                               \
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")            \
    for (int64_t r = 0; r < rows; ++r) {                                                          \
        T *x = residual + r * n;                                                                  \
        __m512 squares = _mm512_setzero_ps();                                                     \
        for (int64_t i = 0; i < n; i += 16) {                                                     \
            const __mmask16 m = tail_mask(n - i);                                                 \
            __m512 v = MLOAD(x + i, m);                                                           \
            if (delta) {                                                                          \
                v = ROUND(_mm512_add_ps(v, MLOAD(delta + r * n + i, m)));                         \
                MSTORE(x + i, v, m);                                                              \
            }                                                                                     \
            squares = _mm512_fmadd_ps(v, v, squares);                                             \
        }                                                                                         \
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + eps)); \
        for (int64_t i = 0; i < n; i += 16) {                                                     \
            const __mmask16 m = tail_mask(n - i);                                                 \
            const __m512 normed = ROUND(_mm512_mul_ps(MLOAD(x + i, m), inv));                     \
            MSTORE(out + r * n + i, ROUND(_mm512_mul_ps(MLOAD(weight + i, m), normed)), m);      \
        }                                                                                         \
    }                                                                                             \
}

/* out[r, :] = silu(gate_up[r, :n]) * gate_up[r, n:2n] */
#define DEFINE_SILU_MUL(NAME, T, MLOAD, MSTORE, ROUND)                                            \
void NAME(const T *gate_up, int64_t rows, int64_t n, T *out) {                                   \
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")            \
    for (int64_t r = 0; r < rows; ++r) {                                                          \
        const T *gate = gate_up + r * 2 * n, *up = gate + n;                                      \
        for (int64_t i = 0; i < n; i += 16) {                                                     \
            const __mmask16 m = tail_mask(n - i);                                                 \
            const __m512 g = MLOAD(gate + i, m);                                                  \
            const __m512 e = vexp_any(_mm512_sub_ps(_mm512_setzero_ps(), g));                     \
            const __m512 s = ROUND(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));     \
            MSTORE(out + r * n + i, ROUND(_mm512_mul_ps(s, MLOAD(up + i, m))), m);               \
        }                                                                                         \
    }                                                                                             \
}

static inline __m512 vkeep_f32(__m512 v) { return v; }
DEFINE_RMS_NORM(rms_norm_f32, float, mload_f32, mstore_f32, vkeep_f32)
DEFINE_RMS_NORM(rms_norm_bf16, bf16_t, mload_bf16, mstore_bf16, vround_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, mload_f32, mstore_f32, vkeep_f32)
DEFINE_SILU_MUL(silu_mul_bf16, bf16_t, mload_bf16, mstore_bf16, vround_bf16)


/* Per row of float32 logits [rows, n]: the first index of the maximum and
   log(sum(exp(x))), for greedy picks and the chosen token's logprob. */
void row_argmax_logsumexp(const float *x, int64_t rows, int64_t n, int64_t *argmax, float *lse) {
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i best_at = _mm512_set1_epi32(0), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - i), row + i);
            const __mmask16 better = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* strict: first index wins */
            best = _mm512_mask_mov_ps(best, better, v);
            best_at = _mm512_mask_mov_epi32(best_at, better, at);
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
        }
        const float top = _mm512_reduce_max_ps(best);
        const __mmask16 is_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
        const int32_t first = _mm512_mask_reduce_min_epi32(is_top, best_at);
        __m512 sum = _mm512_setzero_ps();
        const __m512 shift = _mm512_set1_ps(top);
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = tail_mask(n - i);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), shift))));
        }
        argmax[r] = first;
        lse[r] = top + logf(_mm512_reduce_add_ps(sum));
    }
}
#else

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
void NAME(const T *gate_up, int64_t rows, int64_t n, T *out) {                                   \
    _Pragma("omp parallel for schedule(static) if(rows * n >= PARALLEL_MIN_ELEMENTS)")            \
    for (int64_t r = 0; r < rows; ++r)                                                            \
        for (int64_t i = 0; i < n; ++i) {                                                         \
            const float s = ROUND(silu_f32(TO_F32(gate_up[r * 2 * n + i])));                      \
            out[r * n + i] = FROM_F32(s * TO_F32(gate_up[r * 2 * n + n + i]));                     \
        }                                                                                         \
}


void row_argmax_logsumexp(const float *x, int64_t rows, int64_t n, int64_t *argmax, float *lse) {
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
    }
}

DEFINE_RMS_NORM(rms_norm_f32, float, f32_identity, f32_identity, f32_identity)
DEFINE_RMS_NORM(rms_norm_bf16, bf16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, f32_identity, f32_identity, f32_identity)
DEFINE_SILU_MUL(silu_mul_bf16, bf16_t, bf16_to_f32, f32_to_bf16, round_bf16)

#endif

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

/* Token t's K and V rows (width elements each, at k_stride / v_stride elements
   apart) go to cache slot slots[t]; slot -1 is padding and skipped. */
#define DEFINE_WRITE_KV(NAME, T)                                                                  \
void NAME(const T *k, int64_t k_stride, const T *v, int64_t v_stride, const int64_t *slots,      \
          int64_t rows, int64_t width, T *k_cache, T *v_cache) {                                  \
    for (int64_t t = 0; t < rows; ++t) {                                                          \
        if (slots[t] < 0) continue;                                                               \
        memcpy(k_cache + slots[t] * width, k + t * k_stride, (size_t)width * sizeof(T));          \
        memcpy(v_cache + slots[t] * width, v + t * v_stride, (size_t)width * sizeof(T));          \
    }                                                                                             \
}

DEFINE_ROTARY(rotary_f32, float, f32_identity, f32_identity)
DEFINE_ROTARY(rotary_bf16, bf16_t, bf16_to_f32, f32_to_bf16)
DEFINE_WRITE_KV(write_kv_f32, float)
DEFINE_WRITE_KV(write_kv_bf16, bf16_t)
