/* How fast this machine reads the K/V bytes of a decode step in the order the
 * paged-attention kernel reads them, with no arithmetic beyond a sum: the
 * ceiling for the decode kernel on this access pattern (scattered blocks of
 * block_size token rows, K and V side by side, the next blocks prefetched into
 * L2 a group ahead, as cpu_ops.c does). Built and called by attention_kernel.py.
 * `work`: that many dependent FMAs per 64-byte line read, a stand-in for the kernel's
 * arithmetic (kv_read_overlap.py: do the reads overlap it?); 0 for the ceiling.
 */
#include <immintrin.h>
#include <stdint.h>

float read_kv_blocks(const char *k_cache, const char *v_cache, const int32_t *tables, int64_t table_stride,
                     const int32_t *seq_lens, int64_t num_seqs, int64_t block_size, int64_t token_bytes,
                     int64_t group_blocks, int64_t work) {
    float total = 0.0f;
    const int64_t block_bytes = block_size * token_bytes;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : total)
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int32_t *table = tables + s * table_stride;
        const int64_t blocks = (seq_lens[s] + block_size - 1) / block_size;
        __m256 acc = _mm256_setzero_ps(), w = _mm256_set1_ps(1.0f);
        const __m256 c = _mm256_set1_ps(0.999f);
        for (int64_t b = 0; b < blocks; ++b) {
            int64_t used = seq_lens[s] - b * block_size;
            if (used > block_size) used = block_size;
            const int64_t bytes = used * token_bytes;
            const char *kb = k_cache + (int64_t)table[b] * block_bytes, *vb = v_cache + (int64_t)table[b] * block_bytes;
            const char *nk = 0, *nv = 0;
            if (b + group_blocks < blocks) {
                nk = k_cache + (int64_t)table[b + group_blocks] * block_bytes;
                nv = v_cache + (int64_t)table[b + group_blocks] * block_bytes;
            }
            for (int64_t x = 0; x + 32 <= bytes; x += 64) {
                if (nk) {
                    _mm_prefetch(nk + x, _MM_HINT_T1);
                    _mm_prefetch(nv + x, _MM_HINT_T1);
                }
                acc = _mm256_add_ps(acc, _mm256_loadu_ps((const float *)(kb + x)));
                acc = _mm256_add_ps(acc, _mm256_loadu_ps((const float *)(vb + x)));
                for (int64_t i = 0; i < work; ++i) {
                    w = _mm256_fmadd_ps(w, c, c);
                    __asm__("" : "+x"(w));
                }
            }
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc, w));
        for (int i = 0; i < 8; ++i) total += lanes[i];
    }
    return total;
}
