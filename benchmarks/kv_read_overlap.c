/* Streamed K/V reads in the AMX attention kernel's order, with stand-in arithmetic: the other
 * side of kv_read_ceiling.c's address-order read (both called by kv_read_overlap.py; see
 * docs/benchmarks.md, "AVX2: 8-bit codes on vpmaddwd, and why decode attention does not
 * overlap its reads"). */
#include <immintrin.h>
#include <stdint.h>

/* The kernel's order: per group of G blocks, per head h, the head's 128 B of each token (K and V), `work`
   FMAs per line; prefetch (T1) mode 0: none; 1: the next group's same head lines (as the kernel);
   2: the whole next group (all heads, in address order) spread over head 0..2 of this group. */
float read_heads(const char *k_cache, const char *v_cache, const int32_t *tables, int64_t table_stride,
                 const int32_t *seq_lens, int64_t num_seqs, int64_t block_size, int64_t heads, int64_t head_bytes,
                 int64_t G, int64_t work, int64_t mode) {
    float total = 0.0f;
    const int64_t token_bytes = heads * head_bytes, block_bytes = block_size * token_bytes;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int32_t *table = tables + s * table_stride;
        const int64_t blocks = (seq_lens[s] + block_size - 1) / block_size;
        __m256 acc = _mm256_setzero_ps(), w = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(0.999f);
        for (int64_t g0 = 0; g0 < blocks; g0 += G) {
            for (int64_t h = 0; h < heads; ++h) {
                for (int64_t b = g0; b < g0 + G && b < blocks; ++b) {
                    const char *kb = k_cache + (int64_t)table[b] * block_bytes + h * head_bytes;
                    const char *vb = v_cache + (int64_t)table[b] * block_bytes + h * head_bytes;
                    const int64_t nb = b + G;
                    const char *nk = 0, *nv = 0;
                    if (nb < blocks) nk = k_cache + (int64_t)table[nb] * block_bytes, nv = v_cache + (int64_t)table[nb] * block_bytes;
                    for (int64_t t = 0; t < block_size; ++t) {
                        if (nk && mode == 1)
                            for (int64_t x = 0; x < head_bytes; x += 64) {
                                _mm_prefetch(nk + t * token_bytes + h * head_bytes + x, _MM_HINT_T1);
                                _mm_prefetch(nv + t * token_bytes + h * head_bytes + x, _MM_HINT_T1);
                            }
                        if (nk && mode == 2) { /* this head's third of the next block, in address order */
                            const int64_t lines = block_bytes / 64, per = (lines + heads * block_size - 1) / (heads * block_size);
                            for (int64_t l = (h * block_size + t) * per; l < (h * block_size + t + 1) * per && l < lines; ++l) {
                                _mm_prefetch(nk + l * 64, _MM_HINT_T1);
                                _mm_prefetch(nv + l * 64, _MM_HINT_T1);
                            }
                        }
                        for (int64_t x = 0; x < head_bytes; x += 64) {
                            acc = _mm256_add_ps(acc, _mm256_loadu_ps((const float *)(kb + t * token_bytes + x)));
                            acc = _mm256_add_ps(acc, _mm256_loadu_ps((const float *)(vb + t * token_bytes + x)));
                            for (int64_t i = 0; i < work; ++i) { w = _mm256_fmadd_ps(w, c, c); __asm__("" : "+x"(w)); }
                        }
                    }
                }
            }
        }
        acc = _mm256_add_ps(acc, w);
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (int i = 0; i < 8; ++i) total += lanes[i];
    }
    return total;
}
