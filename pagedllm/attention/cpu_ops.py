"""An optional native kernel for paged decode attention on the CPU.

The kernel is plain C (no PyTorch headers, so it compiles in about a second),
built with the system C compiler on first use into a per-user cache directory
and called through ``ctypes``. It reads K/V straight from the paged cache
through the block table (no gather copy), one (sequence, KV head) pair per
work item, with a per-block online softmax and fp32 accumulation; float32 and
bfloat16 caches are supported. Parallel loops run on the OpenMP runtime that
PyTorch already loaded, so the two share one thread pool.

When no compiler is found, the build fails, or ``PAGEDLLM_NATIVE_OPS=0`` is
set, :func:`available` is False and the pure-PyTorch path is used; the tests
compare the two.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger("pagedllm")

MAX_GROUP = 16  # query heads per KV head the kernel's stack buffers hold
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 64

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP %(max_group)d
#define MAX_HEAD_DIM %(max_head_dim)d
#define MAX_BLOCK_SIZE %(max_block_size)d

static inline float load_f32(const float *p) { return *p; }
static inline float load_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Softmax bookkeeping for one block: scores[g][0..n) become exp(score - new max);
   returns nothing, updates run_max/run_sum and writes each group's correction factor. */
static inline void block_softmax(float scores[][MAX_BLOCK_SIZE], int64_t group, int64_t n,
                                 float *run_max, float *run_sum, float *correction) {
    for (int64_t g = 0; g < group; ++g) {
        float block_max = scores[g][0];
        for (int64_t t = 1; t < n; ++t) block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
        const float new_max = block_max > run_max[g] ? block_max : run_max[g];
        correction[g] = expf(run_max[g] - new_max);
        float block_sum = 0.0f;
        for (int64_t t = 0; t < n; ++t) {
            scores[g][t] = expf(scores[g][t] - new_max);
            block_sum += scores[g][t];
        }
        run_sum[g] = run_sum[g] * correction[g] + block_sum;
        run_max[g] = new_max;
    }
}

#ifdef __AVX512F__
#include <immintrin.h>
#define VEC 16
typedef __m512 vec_t;
static inline vec_t vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vec_t vload_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSUM(v) _mm512_reduce_add_ps(v)
#else
#define VEC 1
typedef float vec_t;
static inline vec_t vload_f32(const float *p) { return *p; }
static inline vec_t vload_bf16(const uint16_t *p) { return load_bf16(p); }
#define VZERO() 0.0f
#define VSET1(x) (x)
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VMUL(a, b) ((a) * (b))
#define VSTORE(p, v) (*(p) = (v))
#define VSUM(v) (v)
#endif

/* One (sequence, KV head) pair: G query rows qs [G, D] (pre-scaled) attend to
   len tokens read through table; result rows written to os [G, D].
   head_dim must be a multiple of VEC. Accumulators stay in vector registers
   for the inner loops: the score loop keeps one per query row, the value loop
   one per (query row, 16-lane chunk). */
#define DEFINE_ITEM(NAME, T, VLOAD)                                                           \
static void NAME(const float *qs, const T *k_cache, const T *v_cache, const int32_t *table,     \
                 int64_t len, int64_t h, int64_t group, int64_t head_dim, int64_t num_kv_heads,\
                 int64_t block_size, float *os) {                                             \
    const int64_t chunks = head_dim / VEC, token_stride = num_kv_heads * head_dim;            \
    vec_t acc[MAX_GROUP * MAX_HEAD_DIM / VEC];                                                \
    float scores[MAX_GROUP][MAX_BLOCK_SIZE];                                                  \
    float run_max[MAX_GROUP], run_sum[MAX_GROUP], correction[MAX_GROUP];                      \
    for (int64_t j = 0; j < group * chunks; ++j) acc[j] = VZERO();                            \
    for (int64_t g = 0; g < group; ++g) { run_max[g] = -INFINITY; run_sum[g] = 0.0f; }        \
    for (int64_t start = 0; start < len; start += block_size) {                               \
        const int64_t block = table[start / block_size];                                      \
        const int64_t n = len - start < block_size ? len - start : block_size;                \
        const int64_t base = (block * block_size * num_kv_heads + h) * head_dim;              \
        const T *kb = k_cache + base, *vb = v_cache + base;                                   \
        for (int64_t t = 0; t < n; ++t) {                                                     \
            const T *krow = kb + t * token_stride;                                            \
            for (int64_t g = 0; g < group; ++g) {                                             \
                const float *qg = qs + g * head_dim;                                          \
                vec_t dot = VZERO();                                                          \
                for (int64_t c = 0; c < chunks; ++c)                                          \
                    dot = VFMA(vload_f32(qg + c * VEC), VLOAD(krow + c * VEC), dot);          \
                scores[g][t] = VSUM(dot);                                                     \
            }                                                                                 \
        }                                                                                     \
        block_softmax(scores, group, n, run_max, run_sum, correction);                        \
        for (int64_t g = 0; g < group; ++g) {                                                 \
            const vec_t scale = VSET1(correction[g]);                                         \
            for (int64_t c = 0; c < chunks; ++c) {                                            \
                vec_t a = VMUL(acc[g * chunks + c], scale);                                   \
                for (int64_t t = 0; t < n; ++t)                                               \
                    a = VFMA(VSET1(scores[g][t]), VLOAD(vb + t * token_stride + c * VEC), a); \
                acc[g * chunks + c] = a;                                                      \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int64_t g = 0; g < group; ++g) {                                                     \
        const vec_t inv = VSET1(1.0f / run_sum[g]);                                           \
        for (int64_t c = 0; c < chunks; ++c)                                                  \
            VSTORE(os + g * head_dim + c * VEC, VMUL(acc[g * chunks + c], inv));              \
    }                                                                                         \
}

DEFINE_ITEM(decode_item_f32, float, vload_f32)
DEFINE_ITEM(decode_item_bf16, uint16_t, vload_bf16)

/* q: [S, H, D] fp32, already multiplied by the softmax scale.
   k_cache, v_cache: [num_blocks, block_size, KH, D].
   tables: [S, table_stride] int32; lens: [S] int32 (>= 1).
   out: [S, H, D] fp32. Query head h * G + g reads KV head h. */
#define DEFINE_DECODE(NAME, T, ITEM)                                                          \
void NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *tables,          \
          int64_t table_stride, const int32_t *lens, int64_t num_seqs, int64_t num_heads,      \
          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float *out) {            \
    const int64_t group = num_heads / num_kv_heads;                                           \
    const int64_t num_items = num_seqs * num_kv_heads;                                        \
    _Pragma("omp parallel for schedule(dynamic, 1) if(num_items > 1)")                        \
    for (int64_t item = 0; item < num_items; ++item) {                                        \
        const int64_t s = item / num_kv_heads, h = item %% num_kv_heads;                       \
        const int64_t offset = (s * num_heads + h * group) * head_dim;                        \
        ITEM(q + offset, k_cache, v_cache, tables + s * table_stride, lens[s], h, group,      \
             head_dim, num_kv_heads, block_size, out + offset);                               \
    }                                                                                         \
}

DEFINE_DECODE(paged_decode_f32, float, decode_item_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, decode_item_bf16)

int vector_width(void) { return VEC; }
""" % {"max_group": MAX_GROUP, "max_head_dim": MAX_HEAD_DIM, "max_block_size": MAX_BLOCK_SIZE}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_vector_width = 1


def available() -> bool:
    """True when the native kernel is built and loaded (builds it on the first call)."""
    global _library, _tried
    if _tried:
        return _library is not None
    with _lock:
        if not _tried:
            _library = _load()
            _tried = True
    return _library is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these shapes and dtypes (otherwise use the PyTorch path)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (
        k_cache.dtype in (torch.float32, torch.bfloat16)
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and head_dim % _vector_width == 0
        and k_cache.shape[1] <= MAX_BLOCK_SIZE
        and k_cache.is_contiguous()
    )


def paged_decode_attention(
    query: torch.Tensor,  # [S, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KH, D], float32 or bfloat16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    seq_lens: torch.Tensor,  # [S], every entry >= 1
    scale: float,
) -> torch.Tensor:  # [S, H, D], query's dtype
    """One query token per sequence attending to its first ``seq_lens[s]`` cached tokens."""
    assert _library is not None, "call available() first"
    num_seqs, num_heads, head_dim = query.shape
    q = (query.float() * scale).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=torch.float32)
    kernel = _library.paged_decode_bf16 if k_cache.dtype == torch.bfloat16 else _library.paged_decode_f32
    kernel(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], out.data_ptr(),
    )
    return out if query.dtype == torch.float32 else out.to(query.dtype)


# ---------------------------------------------------------------- build and load


def _load() -> ctypes.CDLL | None:
    if os.environ.get("PAGEDLLM_NATIVE_OPS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None or platform.system() != "Linux":
        return None
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
    try:
        path = _build(compiler, flags)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU attention kernel unavailable (%s); using the PyTorch path", exc)
        return None
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.vector_width.restype = ctypes.c_int
    global _vector_width
    _vector_width = library.vector_width()
    for fn in (library.paged_decode_f32, library.paged_decode_bf16):
        fn.argtypes = [pointer, pointer, pointer, pointer, i64, pointer, i64, i64, i64, i64, i64, pointer]
        fn.restype = None
    return library


def _build(compiler: str, flags: list[str]) -> Path:
    """Compile into the cache directory unless an identical build is there already."""
    # -march=native code is only valid on this CPU model: key the file on it too.
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm")
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"cpu_ops-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        source = Path(tmp) / "cpu_ops.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / "cpu_ops.so"
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(built), "-lm"],
            check=True, capture_output=True, timeout=120,
        )
        os.replace(built, target)  # atomic: concurrent builders never see a partial file
    return target


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("flags", "model name"))]
    return "\n".join(sorted(set(wanted)))
