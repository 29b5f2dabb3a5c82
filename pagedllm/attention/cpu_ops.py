"""An optional native kernel for paged attention on the CPU.

The kernel is plain C (no PyTorch headers, so it compiles in about a second),
built with the system C compiler on first use into a per-user cache directory
and called through ``ctypes``. It reads K/V straight from the paged cache
through the block table (no gather copy), one query token (all its heads) per
work item, with a per-block online softmax and fp32 accumulation; float32 and
bfloat16 caches are supported. Decode and prefill tokens are the same kind of
item: a token at position ``p`` attends to the first ``p + 1`` tokens. Parallel loops run on the OpenMP runtime that
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

MAX_HEADS = 64  # query heads the kernel's stack buffers hold
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 64

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM %(max_head_dim)d
#define MAX_BLOCK_SIZE %(max_block_size)d
#define MAX_HEADS %(max_heads)d

static inline float load_f32(const float *p) { return *p; }
static inline float load_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
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

/* exp(x) for x in [-87, 0] (softmax arguments): 2^k * 2^f with f in [-1/2, 1/2],
   2^f from its degree-6 Taylor polynomial (relative error below 3e-7). */
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

/* scores[0..n) <- exp(scores - shift), returns their sum. */
static inline float exp_shift_sum(float *scores, int64_t n, float shift) {
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    __m512 v = _mm512_maskz_loadu_ps(mask, scores);
    v = vexp(_mm512_sub_ps(v, _mm512_set1_ps(shift)));
    _mm512_mask_storeu_ps(scores, mask, v);
    return _mm512_mask_reduce_add_ps(mask, v);
}
#define EXP_CHUNK 16
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

static inline float exp_shift_sum(float *scores, int64_t n, float shift) {
    float sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) {
        scores[t] = expf(scores[t] - shift);
        sum += scores[t];
    }
    return sum;
}
#define EXP_CHUNK MAX_BLOCK_SIZE
#endif

/* Softmax bookkeeping for one block of n scores per row: scores become
   exp(score - running max); run_max / run_sum are updated and correction[r]
   is the factor that rescales row r's earlier accumulation. */
static inline void block_softmax(float scores[][MAX_BLOCK_SIZE], int64_t rows, int64_t n,
                                 float *run_max, float *run_sum, float *correction) {
    for (int64_t r = 0; r < rows; ++r) {
        float block_max = scores[r][0];
        for (int64_t t = 1; t < n; ++t) block_max = scores[r][t] > block_max ? scores[r][t] : block_max;
        const float new_max = block_max > run_max[r] ? block_max : run_max[r];
        correction[r] = expf(run_max[r] - new_max);
        float block_sum = 0.0f;
        for (int64_t t0 = 0; t0 < n; t0 += EXP_CHUNK)
            block_sum += exp_shift_sum(scores[r] + t0, n - t0 < EXP_CHUNK ? n - t0 : EXP_CHUNK, new_max);
        run_sum[r] = run_sum[r] * correction[r] + block_sum;
        run_max[r] = new_max;
    }
}

/* One query token: its H query rows qs [H, D] (pre-scaled) attend to len tokens
   read through table, block by block and, within a block, every KV head in
   turn (so each token's K and V rows are read front to back, once). Query
   head h * G + g reads KV head h. Results go to os [H, D]. head_dim must be
   a multiple of VEC. The score loop keeps one accumulator per query row in a
   register; the value loop one per 16-lane chunk. */
#define DEFINE_SEQ(NAME, T, VLOAD)                                                            \
static void NAME(const float *qs, const T *k_cache, const T *v_cache, const int32_t *table,     \
                 int64_t len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,      \
                 int64_t block_size, float *os) {                                             \
    const int64_t group = num_heads / num_kv_heads;                                           \
    const int64_t chunks = head_dim / VEC, token_stride = num_kv_heads * head_dim;            \
    vec_t acc[MAX_HEADS * MAX_HEAD_DIM / VEC];                                                \
    float scores[MAX_HEADS][MAX_BLOCK_SIZE];                                                  \
    float run_max[MAX_HEADS], run_sum[MAX_HEADS], correction[MAX_HEADS];                      \
    for (int64_t j = 0; j < num_heads * chunks; ++j) acc[j] = VZERO();                        \
    for (int64_t r = 0; r < num_heads; ++r) { run_max[r] = -INFINITY; run_sum[r] = 0.0f; }    \
    for (int64_t start = 0; start < len; start += block_size) {                               \
        const int64_t block = table[start / block_size];                                      \
        const int64_t n = len - start < block_size ? len - start : block_size;                \
        const T *kb = k_cache + block * block_size * token_stride;                            \
        const T *vb = v_cache + block * block_size * token_stride;                            \
        for (int64_t t = 0; t < n; ++t) {                                                     \
            for (int64_t r = 0; r < num_heads; ++r) {                                         \
                const T *krow = kb + t * token_stride + (r / group) * head_dim;               \
                const float *qr = qs + r * head_dim;                                          \
                vec_t dot = VZERO();                                                          \
                for (int64_t c = 0; c < chunks; ++c)                                          \
                    dot = VFMA(vload_f32(qr + c * VEC), VLOAD(krow + c * VEC), dot);          \
                scores[r][t] = VSUM(dot);                                                     \
            }                                                                                 \
        }                                                                                     \
        block_softmax(scores, num_heads, n, run_max, run_sum, correction);                    \
        for (int64_t r = 0; r < num_heads; ++r) {                                             \
            const T *vcol = vb + (r / group) * head_dim;                                      \
            const vec_t scale = VSET1(correction[r]);                                         \
            for (int64_t c = 0; c < chunks; ++c) {                                            \
                vec_t a = VMUL(acc[r * chunks + c], scale);                                   \
                for (int64_t t = 0; t < n; ++t)                                               \
                    a = VFMA(VSET1(scores[r][t]), VLOAD(vcol + t * token_stride + c * VEC), a);\
                acc[r * chunks + c] = a;                                                      \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int64_t r = 0; r < num_heads; ++r) {                                                 \
        const vec_t inv = VSET1(1.0f / run_sum[r]);                                           \
        for (int64_t c = 0; c < chunks; ++c)                                                  \
            VSTORE(os + r * head_dim + c * VEC, VMUL(acc[r * chunks + c], inv));              \
    }                                                                                         \
}

DEFINE_SEQ(attend_row_f32, float, vload_f32)
DEFINE_SEQ(attend_row_bf16, uint16_t, vload_bf16)

/* Row s of q attends to the first lens[s] tokens of the sequence whose block
   table is row s of tables. A decode token is one such row; a prefill token
   at position p is one with len p + 1 (the causal mask for free).
   q: [S, H, D] fp32, already multiplied by the softmax scale.
   k_cache, v_cache: [num_blocks, block_size, KH, D].
   tables: [S, table_stride] int32; lens: [S] int32 (>= 1).
   out: [S, H, D] fp32. */
#define DEFINE_DECODE(NAME, T, SEQ)                                                           \
void NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *tables,          \
          int64_t table_stride, const int32_t *lens, int64_t num_seqs, int64_t num_heads,      \
          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float *out) {            \
    _Pragma("omp parallel for schedule(dynamic, 1) if(num_seqs > 1)")                         \
    for (int64_t s = 0; s < num_seqs; ++s) {                                                  \
        const int64_t offset = s * num_heads * head_dim;                                      \
        SEQ(q + offset, k_cache, v_cache, tables + s * table_stride, lens[s], num_heads,      \
            num_kv_heads, head_dim, block_size, out + offset);                                \
    }                                                                                         \
}

DEFINE_DECODE(paged_rows_f32, float, attend_row_f32)
DEFINE_DECODE(paged_rows_bf16, uint16_t, attend_row_bf16)

int vector_width(void) { return VEC; }
""" % {"max_head_dim": MAX_HEAD_DIM, "max_block_size": MAX_BLOCK_SIZE,
                 "max_heads": MAX_HEADS}

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
        and num_heads <= MAX_HEADS
        and head_dim <= MAX_HEAD_DIM
        and head_dim % _vector_width == 0
        and k_cache.shape[1] <= MAX_BLOCK_SIZE
        and k_cache.is_contiguous()
    )


def paged_attention(
    query: torch.Tensor,  # [R, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KH, D], float32 or bfloat16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, max_blocks], the block table of each row's sequence
    lens: torch.Tensor,  # [R], every entry >= 1
    scale: float,
) -> torch.Tensor:  # [R, H, D], query's dtype
    """Query row r attends to the first ``lens[r]`` cached tokens of its sequence.

    A decode token passes its sequence's length; a prefill token at position
    ``p`` passes ``p + 1``, which is exactly the causal mask. Each row reads
    K/V through its block table, so nothing is gathered.
    """
    assert _library is not None, "call available() first"
    num_rows, num_heads, head_dim = query.shape
    q = (query.float() * scale).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = lens.to(torch.int32).contiguous()
    out = torch.empty((num_rows, num_heads, head_dim), dtype=torch.float32)
    kernel = _library.paged_rows_bf16 if k_cache.dtype == torch.bfloat16 else _library.paged_rows_f32
    kernel(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), num_rows, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], out.data_ptr(),
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
    for fn in (library.paged_rows_f32, library.paged_rows_bf16):
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
