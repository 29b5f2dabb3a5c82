/* Decode attention timed in C, without Python around each call: a build of cpu_ops.c (or
 * a variant of it) called on the default model's decode shape (9 query / 3 KV heads of 64,
 * blocks of 16, every block of the pool drawn at random), LAYERS caches of SEQS sequences
 * of CTX tokens each. Prints GB/s of K/V read (codes and scales for int8) and ms per layer,
 * the best of ROUNDS rounds over all layers, and one output value (the same for builds that
 * give the same bits). SPLIT=1 in the environment sets split_heads, as the engine does for a call
 * of fewer than 4 sequences per thread.
 *
 *   gcc -O3 -mavx2 -mfma -mf16c -fopenmp -std=gnu11 \
 *       -DKERNEL_SOURCE='"../pagedllm/native/cpu_ops.c"' [-DKV8=1] \
 *       benchmarks/attention_decode_bench.c -o /tmp/attn -lm
 *   OMP_NUM_THREADS=2 /tmp/attn LAYERS SEQS CTX ROUNDS
 *
 * (KERNEL_SOURCE is relative to this file; -mavx512f -mavx512bw -mavx512vl -mavx512dq
 * instead of -mavx2 builds the AVX-512 path; add -mavx512bf16 for avx512_bf16, and -DBF16=1 for bfloat16
 * queries and caches.) LAYOUT=head in the environment stores the caches
 * in cpu_ops.c's KV_LAYOUT_HEAD (the same random values, rearranged: the check value must not
 * change), LAYOUT=token (the default) as [block][token][head][dim]. 30 64 340 4 streams 1 GB (float32) from
 * memory, as a W64 decode step's attention does; 1 4 340 1500 keeps the caches in L2 and
 * times the arithmetic alone. HUGE=1 in the environment puts the caches on 2 MiB pages; CONTIGUOUS=1
 * gives each sequence its blocks side by side instead of drawn at random.
 * docs/profile.md, "Eleventh round", has what it showed on AMD Zen 3.
 *
 * B_SO=path.so (float32, or bfloat16 with -DBF16=1) compares two builds in one process: this binary's kernel (A) and
 * paged_attention_f32 (_bf16) of a shared build of another cpu_ops.c (B, `gcc ... -fPIC -shared`), each
 * round running all layers with A then B (B then A on odd rounds); it prints both rates and in how
 * many rounds B was faster. On a VM whose read bandwidth drifts by tens of percent within minutes
 * this pairs each of B's rounds with one of A's a second apart (docs/profile.md, twenty-first round). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <dlfcn.h>
#include KERNEL_SOURCE
#ifndef KV8
#define KV8 0
#endif
#ifndef BF16 /* -DBF16=1: bfloat16 queries and caches (paged_attention_bf16) */
#define BF16 0
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static float uniform(void) { return (float)rand() / RAND_MAX - 0.5f; }

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s LAYERS SEQS CTX ROUNDS\n", argv[0]);
        return 2;
    }
    const int64_t layers = atoi(argv[1]), seqs = atoi(argv[2]), ctx = atoi(argv[3]), rounds = atoi(argv[4]);
    const int32_t layout = getenv("LAYOUT") && strcmp(getenv("LAYOUT"), "head") == 0 ? KV_LAYOUT_HEAD : KV_LAYOUT_TOKEN;
    const int64_t H = 9, KVH = 3, D = 64, BS = 16, bps = (ctx + BS - 1) / BS, nblocks = seqs * bps + 1;
    const int64_t elems = nblocks * BS * KVH * D;
    const size_t huge = (size_t)2 << 20, bytes_each = ((size_t)elems * 4 + huge - 1) & ~(huge - 1);
    float **k = malloc(layers * sizeof *k), **v = malloc(layers * sizeof *v);
    int32_t *tables = malloc(seqs * bps * sizeof(int32_t));
    int64_t *perm = malloc(nblocks * sizeof(int64_t));
    srand(1);
    for (int64_t i = 0; i < nblocks; ++i) perm[i] = i;
    if (!getenv("CONTIGUOUS")) /* CONTIGUOUS=1: each sequence's blocks side by side, in order */
        for (int64_t i = nblocks - 1; i > 0; --i) {
            const int64_t j = rand() % (i + 1), t = perm[i];
            perm[i] = perm[j], perm[j] = t;
        }
    for (int64_t i = 0; i < seqs * bps; ++i) tables[i] = (int32_t)perm[i];
    for (int64_t l = 0; l < layers; ++l) {
        k[l] = aligned_alloc(huge, bytes_each), v[l] = aligned_alloc(huge, bytes_each);
        if (getenv("HUGE")) madvise(k[l], bytes_each, MADV_HUGEPAGE), madvise(v[l], bytes_each, MADV_HUGEPAGE);
        if (KV8) { /* codes, then one float16 scale per slot and KV head */
            uint8_t *kc = (uint8_t *)k[l], *vc = (uint8_t *)v[l];
            for (int64_t i = 0; i < elems; ++i) kc[i] = (uint8_t)(rand() % 200 - 100), vc[i] = (uint8_t)(rand() % 200 - 100);
            uint16_t *ks = (uint16_t *)(kc + elems), *vs = (uint16_t *)(vc + elems);
            for (int64_t i = 0; i < elems / D; ++i) ks[i] = vs[i] = f32_to_f16(0.01f);
        } else if (BF16) {
            bf16_t *kb = (bf16_t *)k[l], *vb = (bf16_t *)v[l];
            for (int64_t i = 0; i < elems; ++i) kb[i] = f32_to_bf16(uniform()), vb[i] = f32_to_bf16(uniform());
        } else {
            for (int64_t i = 0; i < elems; ++i) k[l][i] = uniform(), v[l][i] = uniform();
        }
        if (layout == KV_LAYOUT_HEAD) { /* the same slots' values, rearranged (codes: 1 byte, floats: 4) */
            const size_t e = KV8 ? 1 : BF16 ? 2 : 4;
            char *tk = malloc(elems * e), *tv = malloc(elems * e), *sk = (char *)k[l], *sv = (char *)v[l];
            for (int64_t i = 0; i < nblocks * BS * KVH; ++i) {
                const int64_t slot = i / KVH, h = i % KVH;
                for (int64_t d = 0; d < D; ++d) {
                    memcpy(tk + (key_at(slot, h, KVH, D, BS, layout) + d * BS) * e, sk + (i * D + d) * e, e);
                    memcpy(tv + (value_at(slot, h, KVH, D, BS, layout) + d) * e, sv + (i * D + d) * e, e);
                }
            }
            memcpy(sk, tk, elems * e), memcpy(sv, tv, elems * e);
            free(tk), free(tv);
        }
    }
    float *q = aligned_alloc(64, seqs * H * D * 4), *out = aligned_alloc(64, seqs * H * D * 4);
    for (int64_t i = 0; i < seqs * H * D; ++i) q[i] = uniform();
    bf16_t *qb = aligned_alloc(64, seqs * H * D * 2), *outb = aligned_alloc(64, seqs * H * D * 2);
    for (int64_t i = 0; i < seqs * H * D; ++i) qb[i] = f32_to_bf16(q[i]);
    tile_t *tiles = malloc(seqs * sizeof(tile_t));
    for (int64_t s = 0; s < seqs; ++s) tiles[s] = (tile_t){(int32_t)s, (int32_t)s, (int32_t)ctx, 1};
    const double bytes = 2.0 * seqs * ctx * KVH * (KV8 ? D + 2 : BF16 ? D * 2 : D * 4) * layers;
    const int32_t split = getenv("SPLIT") ? atoi(getenv("SPLIT")) : 0; /* split_heads, as the engine sets it for few sequences */
    if (getenv("B_SO")) {
        if (KV8 || rounds > 1000) {
            fprintf(stderr, "B_SO compares float32 or bfloat16 builds, at most 1000 rounds\n");
            return 2;
        }
        /* paged_attention_f32 or _bf16: the same arguments, pointers to float or bf16_t */
        typedef void (*attention_fn)(const void *, int64_t, const void *, const void *, const uint16_t *,
                                     const uint16_t *, const int32_t *, int64_t, const tile_t *, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, int32_t, float, int32_t, const int32_t *, void *);
        const char *name = BF16 ? "paged_attention_bf16" : "paged_attention_f32";
        void *other = dlopen(getenv("B_SO"), RTLD_NOW | RTLD_LOCAL);
        if (!other) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
        const attention_fn fns[2] = {BF16 ? (attention_fn)paged_attention_bf16 : (attention_fn)paged_attention_f32,
                                     (attention_fn)dlsym(other, name)};
        const void *qa = BF16 ? (const void *)qb : (const void *)q;
        void *oa = BF16 ? (void *)outb : (void *)out;
        static double ts[2][1000];
        int b_faster = 0;
        for (int64_t r = 0; r < rounds; ++r) {
            for (int i = 0; i < 2; ++i) {
                const int which = (r & 1) ? 1 - i : i;
                const double t0 = now();
                for (int64_t l = 0; l < layers; ++l)
                    fns[which](qa, H * D, k[l], v[l], 0, 0, tables, bps, tiles, seqs, H, KVH, D, BS, layout, 0.125f,
                               split, 0, oa);
                ts[which][r] = now() - t0;
            }
            b_faster += ts[1][r] < ts[0][r];
        }
        double ratio = 0;
        for (int w = 0; w < 2; ++w) {
            double best = 1e30, sum = 0;
            for (int64_t r = 0; r < rounds; ++r) best = ts[w][r] < best ? ts[w][r] : best, sum += ts[w][r];
            printf("%s: best %.2f GB/s, mean %.2f GB/s\n", w ? "B" : "A", bytes / best / 1e9, bytes / (sum / rounds) / 1e9);
        }
        for (int64_t r = 0; r < rounds; ++r) ratio += ts[0][r] / ts[1][r];
        printf("B faster in %d of %ld rounds; mean time A / B %.3f\n", b_faster, (long)rounds, ratio / rounds);
        return 0;
    }
    double best = 1e30;
    for (int64_t r = 0; r < rounds; ++r) {
        const double t0 = now();
        for (int64_t l = 0; l < layers; ++l) {
            if (KV8)
                paged_attention_f32_i8(q, H * D, (kv8_t *)k[l], (kv8_t *)v[l], (uint16_t *)((uint8_t *)k[l] + elems),
                                       (uint16_t *)((uint8_t *)v[l] + elems), tables, bps, tiles, seqs, H, KVH, D, BS,
                                       layout, 0.125f, split, 0, out);
            else if (BF16)
                paged_attention_bf16(qb, H * D, (bf16_t *)k[l], (bf16_t *)v[l], 0, 0, tables, bps, tiles, seqs, H, KVH,
                                     D, BS, layout, 0.125f, split, 0, outb);
            else
                paged_attention_f32(q, H * D, k[l], v[l], 0, 0, tables, bps, tiles, seqs, H, KVH, D, BS, layout, 0.125f,
                                    split, 0, out);
        }
        const double t = now() - t0;
        if (t < best) best = t;
    }
    if (BF16) out[7] = bf16_to_f32(outb[7]);
    printf("%s %s %s layers %ld seqs %ld ctx %ld: %.2f GB/s (%.3f ms per layer) check %g\n", KV8 ? "int8" : BF16 ? "bf16" : "f32",
           ISA_NAME, layout ? "head" : "token", (long)layers, (long)seqs, (long)ctx, bytes / best / 1e9,
           best / layers * 1e3, out[7]);
    return 0;
}
