"""Quantized KV (int8, fp8_e4m3, fp8_e5m2) in the Triton kernels, against a dense oracle.

The oracle (``tests/kv_quant_reference.py``) is written from the format's
definition (``attention/base.py``): ``quantize`` gives each (token, KV head) row a float16 scale and 8-bit codes,
and the dense attention runs in float64 over ``code * scale``. ``write_kv``
must produce exactly that quantizer's codes and scales; the attention kernels
must match dense attention over the dequantized rows within the tolerance of
their dot dtype (they read the same codes, so quantization error is not in the
comparison). A loose bound against the unquantized oracle checks that the
quantization itself is sane.

Without CUDA the kernels run in Triton's CPU interpreter, on small shapes.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import skip_if_interpreter_too_old, use_triton_interpreter

use_triton_interpreter()

triton = pytest.importorskip("triton", reason="triton is not installed; the Triton backend cannot run")
skip_if_interpreter_too_old(triton)

from attention_reference import make_paged_batch, naive_attention  # noqa: E402
from kv_quant_reference import FORMATS, QMAX, QuantizedBatch, quantize  # noqa: E402
from tiny_models import save_tiny_llama  # noqa: E402

from pagedllm.attention.kernels.paged_decode import paged_decode  # noqa: E402
from pagedllm.attention.kernels.write_kv import write_kv  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Kernel vs dense attention over the same dequantized K/V: the dot dtype's error.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# Quantized vs unquantized attention, RMS error / RMS output (unit-variance K/V,
# head_dim 32): about twice what seeds 5-7 give (int8 0.0066, e4m3 0.030, e5m2 0.067).
QUANT_ERROR_BOUND = {torch.int8: 0.015, torch.float8_e4m3fn: 0.06, torch.float8_e5m2: 0.13}

# (context_len, query_len) per sequence: a fresh prefill, prefix hits starting
# mid-block, a decode row mixed in, a chunk over a cached prefix.
MIXED = [(0, 17), (9, 5), (40, 1), (21, 12)]
PREFILL_NO_PREFIX = [(0, 23), (0, 9)]
DECODE = [(149, 1), (36, 1), (0, 1), (64, 1)]  # the 150-token context spans several 32-token splits

# The interpreter runs each case in about a second: the less telling variants are slow-marked.
SLOW = pytest.mark.slow


def _assert_close(out, ref, dtype):
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err} > {TOLERANCE[dtype]} for {dtype}"


# ------------------------------------------------------------------ write_kv


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_codes_and_scales_match_the_quantizer(fmt, dtype):
    cache_dtype = FORMATS[fmt]
    gen = torch.Generator().manual_seed(1)
    num_tokens, kv_heads, head_dim = 9, 3, 40  # head_dim not a power of two: padded columns
    # Rows from 1e-7 to 1e4 in magnitude (tiny rows hit the 2**-14 scale floor and
    # fp8 subnormals), one all-zero row, and a row with a single nonzero element.
    magnitude = torch.logspace(-7, 4, num_tokens)[:, None, None]
    key = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen) * magnitude).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    key[0] = 0
    value[1] = 0
    value[1, 2, 7] = -3.0
    cache = torch.zeros(4, 4, kv_heads, head_dim, dtype=cache_dtype, device=DEVICE)
    k_cache, v_cache = cache.clone(), cache.clone()
    k_scale = torch.full((4, 4, kv_heads), 7.0, dtype=torch.float16, device=DEVICE)
    v_scale = k_scale.clone()
    slots = torch.tensor([3, 0, 15, -1, 7, 9, -1, 10, 2], dtype=torch.int64, device=DEVICE)
    write_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots, k_scale, v_scale)

    for tensor, cache_t, scale_t in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        codes, scales = quantize(tensor, cache_dtype)
        expected_codes = torch.zeros(16, kv_heads, head_dim, dtype=cache_dtype)
        expected_scales = torch.full((16, kv_heads), 7.0, dtype=torch.float16)
        keep = slots.cpu() >= 0
        expected_codes[slots.cpu()[keep]] = codes[keep]
        expected_scales[slots.cpu()[keep]] = scales[keep]
        got = cache_t.view(16, kv_heads, head_dim).cpu()
        assert torch.equal(got.view(torch.uint8), expected_codes.view(torch.uint8))
        assert torch.equal(scale_t.view(16, kv_heads).cpu(), expected_scales)
    # The all-zero key row (token 0, slot 3) gets the floor scale and zero codes.
    assert k_scale.view(16, kv_heads)[3].tolist() == [2.0**-14] * kv_heads
    assert torch.count_nonzero(k_cache.view(16, kv_heads, head_dim)[3].float()) == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_rounds_ties_to_even(fmt):
    """Rows whose absmax makes the scale exactly 1, with values halfway between codes."""
    cache_dtype = FORMATS[fmt]
    qmax = QMAX[cache_dtype]
    if cache_dtype == torch.int8:
        ties = [0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 3.4999, 3.5001]
        expected = [0.0, 2.0, 2.0, -0.0, -2.0, 126.0, 3.0, 4.0]
    elif cache_dtype == torch.float8_e4m3fn:
        # normals 1.0625 (1 | 1.125), 1.1875 (1.125 | 1.25); subnormals 2**-10 (0 | 2**-9),
        # 3 * 2**-10 (2**-9 | 2**-8); 15 * 2**-10 (the largest subnormal | the smallest
        # normal); 416 is a code; 432 (416 | 448).
        ties = [1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -1.1875, 15 * 2.0**-10, 416.0, 432.0]
        expected = [1.0, 1.25, 0.0, 2.0**-8, -1.25, 2.0**-6, 416.0, 448.0]
    else:
        # normals 1.125 (1 | 1.25), 1.375 (1.25 | 1.5); subnormals 2**-17 (0 | 2**-16),
        # 3 * 2**-17 (2**-16 | 2**-15), 7 * 2**-17 (3 * 2**-16 | the smallest normal 2**-14);
        # 20480 is a code; 53248 (49152 | 57344).
        ties = [1.125, 1.375, 2.0**-17, 3 * 2.0**-17, -1.375, 7 * 2.0**-17, 20480.0, 53248.0]
        expected = [1.0, 1.5, 0.0, 2.0**-15, -1.5, 2.0**-14, 20480.0, 49152.0]
    row = torch.zeros(1, 1, 32)
    row[0, 0, 0] = qmax  # absmax / qmax = 1: the scale is exactly 1
    row[0, 0, 1 : 1 + len(ties)] = torch.tensor(ties)
    cache = torch.zeros(1, 4, 1, 32, dtype=cache_dtype, device=DEVICE)
    k_scale = torch.zeros(1, 4, 1, dtype=torch.float16, device=DEVICE)
    v_cache, v_scale = cache.clone(), k_scale.clone()
    write_kv(row.to(DEVICE), row.to(DEVICE), cache, v_cache, torch.tensor([2], device=DEVICE), k_scale, v_scale)
    assert float(k_scale[0, 2, 0]) == 1.0
    got = cache[0, 2, 0, 1 : 1 + len(ties)].float().cpu()
    assert got.tolist() == expected
    codes, _ = quantize(row, cache_dtype)  # and bit for bit what the oracle's quantizer gives
    assert torch.equal(cache[0, 2, 0].cpu().view(torch.uint8), codes[0, 0].view(torch.uint8))


def test_scales_must_match_the_cache_format():
    b = make_paged_batch(DECODE, device=DEVICE, seed=2)
    md = b.metadata
    codes = torch.zeros(b.k_cache.shape, dtype=torch.int8, device=DEVICE)
    scales = torch.ones(b.k_cache.shape[:3], dtype=torch.float16, device=DEVICE)
    backend = TritonAttentionBackend()
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        backend.write_kv(b.new_key, b.new_value, codes, codes.clone(), md.slot_mapping)
    with pytest.raises(ValueError, match="is not quantized"):
        backend.forward(b.query, b.k_cache, b.v_cache, md, b.scale, scales, scales)
    with pytest.raises(ValueError, match="must be float16"):
        backend.forward(b.query, codes, codes, md, b.scale, scales.float(), scales.float())


# ------------------------------------------------------------------ attention


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "specs,block_size",
    [(MIXED, 8), (MIXED, 16), (MIXED, 32), (PREFILL_NO_PREFIX, 16),
     pytest.param(PREFILL_NO_PREFIX, 8, marks=SLOW), pytest.param(PREFILL_NO_PREFIX, 32, marks=SLOW)],
    ids=["prefix-bs8", "prefix-bs16", "prefix-bs32", "no-prefix-bs16", "no-prefix-bs8", "no-prefix-bs32"],
)
def test_prefill_matches_dense_oracle(fmt, specs, block_size):
    q = QuantizedBatch(specs, FORMATS[fmt], device=DEVICE, seed=block_size, block_size=block_size, num_heads=6,
                       num_kv_heads=2, head_dim=32)
    out, ref, n = q.run(TritonAttentionBackend())
    _assert_close(out[:n], ref[:n], torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [8, 16, pytest.param(32, marks=SLOW)])
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_decode_matches_dense_oracle(fmt, block_size, split):
    backend = TritonAttentionBackend(min_split_tokens=32, target_programs=64 if split else 1)
    q = QuantizedBatch(DECODE, FORMATS[fmt], device=DEVICE, seed=block_size + 1, block_size=block_size, num_heads=6,
                       num_kv_heads=2, head_dim=32)
    num_splits = backend.num_decode_splits(q.batch.metadata, 2, q.batch.query.device)
    assert (num_splits > 1) == split
    out, ref, n = q.run(backend)
    _assert_close(out[:n], ref[:n], torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_splits", [pytest.param(2, marks=SLOW), 5])
def test_decode_kernel_forced_split_counts(fmt, num_splits):
    """Split counts that leave some sequences' chunks empty merge to the same result."""
    q = QuantizedBatch(DECODE, FORMATS[fmt], device=DEVICE, seed=7, num_heads=4, num_kv_heads=4, head_dim=32)
    b, md = q.batch, q.batch.metadata
    write_kv(b.new_key, b.new_value, q.k_cache, q.v_cache, md.slot_mapping, q.k_scale, q.v_scale)
    out = torch.empty_like(b.query)
    paged_decode(b.query, q.k_cache, q.v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                 b.scale, num_splits, out, None, q.k_scale, q.v_scale)
    _assert_close(out, naive_attention(b.query, b), torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "dtype,specs",
    [(torch.float16, MIXED), (torch.float16, DECODE), (torch.bfloat16, MIXED),
     pytest.param(torch.bfloat16, DECODE, marks=SLOW)],
    ids=["fp16-mixed", "fp16-decode", "bf16-mixed", "bf16-decode"],
)
def test_half_precision_queries(fmt, dtype, specs):
    q = QuantizedBatch(specs, FORMATS[fmt], device=DEVICE, seed=3, num_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype)
    out, ref, n = q.run(TritonAttentionBackend(min_split_tokens=32, target_programs=64))
    assert out.dtype == dtype
    _assert_close(out[:n], ref[:n], dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantization_error_is_bounded(fmt):
    """The quantized result is close to unquantized attention (the format's own error)."""
    q = QuantizedBatch(MIXED + DECODE, FORMATS[fmt], device=DEVICE, seed=5, num_heads=6, num_kv_heads=2, head_dim=32)
    out, _, n = q.run(TritonAttentionBackend(min_split_tokens=32, target_programs=64))
    exact = naive_attention(q.original.query, q.original)[:n]
    relative_rms = ((out[:n] - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
    assert 0 < relative_rms <= QUANT_ERROR_BOUND[FORMATS[fmt]], relative_rms


def test_padding_rows_are_zero_and_never_written():
    q = QuantizedBatch(MIXED, torch.int8, device=DEVICE, seed=11, num_heads=6, num_kv_heads=2, head_dim=32,
                       num_padding_tokens=3)
    k_before, scale_before = q.k_cache.clone(), q.k_scale.clone()
    out, ref, n = q.run(TritonAttentionBackend())
    _assert_close(out[:n], ref[:n], torch.float32)
    assert torch.count_nonzero(out[n:]) == 0
    written = torch.zeros(q.k_cache.shape[:2], dtype=torch.bool).view(-1)
    written[q.batch.metadata.slot_mapping[q.batch.metadata.slot_mapping >= 0].cpu()] = True
    untouched = ~written.view(q.k_cache.shape[:2])
    assert torch.equal(q.k_cache[untouched], k_before[untouched])
    assert torch.equal(q.k_scale[untouched], scale_before[untouched])


@pytest.mark.slow
def test_gpu_check_kv_quant_part_interpret_mode(tmp_path):
    """The GPU check's quantized-KV part runs end to end (tiny shapes, interpreter)."""
    import json
    import subprocess
    from pathlib import Path

    repo_root = Path(__file__).resolve().parent.parent
    out_path = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--interpret", "--skip-engine", "--parts", "kv_quant",
         "--out", str(out_path)],
        cwd=repo_root, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    part = json.loads(out_path.read_text())["kv_quant"]
    assert part["ok"], part
    assert {c["case"].split()[0] for c in part["cases"]} == set(FORMATS)
    assert all(c["write_kv_exact"] and c["padding_rows_zero"] for c in part["cases"])
    for shape in part["decode_timing"]:
        timed = {r["kv_format"] for r in shape["runs"] if r["tiling"] is None and r["ms"] > 0}
        assert timed == {"bf16", *FORMATS}, shape
    assert "kv_quant" in proc.stdout and "oracle cases pass" in proc.stdout


def test_oracle_quantizer_equals_the_format_module():
    """The local quantizer and ``pagedllm.kv.kv_format.quantize_kv`` (where it exists) agree bit for bit."""
    kv_format = pytest.importorskip("pagedllm.kv.kv_format", reason="this build has no kv_format module")
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(64, 3, 40, generator=gen) * torch.logspace(-8, 5, 64)[:, None, None]
    rows[0] = 0
    for cache_dtype in FORMATS.values():
        codes, scales = quantize(rows, cache_dtype)
        ref_codes, ref_scales = kv_format.quantize_kv(rows, cache_dtype)
        assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), cache_dtype
        assert torch.equal(scales, ref_scales), cache_dtype


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer random Llama (4 query / 2 KV heads, head_dim 64) with a word-level tokenizer."""
    pytest.importorskip("transformers")
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-triton-kv8"), hidden_size=256, intermediate_size=256)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_engine_greedy_on_triton_equals_torch_backend(tiny_llama_dir, kv_cache_dtype):
    """fp32 greedy through the engine with an 8-bit cache: the Triton kernels give the
    torch reference backend's tokens (prefill, chunked decode, block size 8)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.errors import ConfigError

    gen = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (12 + 9 * i,), generator=gen).tolist()} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        try:
            llm = LLM(str(tiny_llama_dir), device=DEVICE, block_size=8, dtype="float32",
                      kv_cache_dtype=kv_cache_dtype, attention_backend=backend, enforce_eager=True)
        except ConfigError as exc:
            pytest.skip(f"this build's engine does not take kv_cache_dtype={kv_cache_dtype!r} yet: {exc}")
        assert llm.llm_engine.worker.kv_cache.block_tensors()[0].dtype == FORMATS[kv_cache_dtype]
        tokens[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 10 for t in tokens["triton"])
