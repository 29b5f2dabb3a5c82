"""The Triton attention backend against the dense oracle.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1
must be set before triton is imported), on small shapes so the file stays fast.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import skip_if_interpreter_too_old, use_triton_interpreter

use_triton_interpreter()

triton = pytest.importorskip("triton", reason="triton is not installed; the Triton backend cannot run")
skip_if_interpreter_too_old(triton)

from attention_reference import make_paged_batch, naive_attention  # noqa: E402

from pagedllm.attention.base import get_attention_backend  # noqa: E402
from pagedllm.attention.kernels.paged_decode import paged_decode  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO_ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# (context_len, query_len) per sequence: a fresh prefill, prefix hits that start
# mid-block, a long prefill chunk over a cached prefix, and a decode row.
MIXED = [(0, 17), (9, 5), (40, 1), (21, 30)]
# Decode only; the 150-token context spans several 32-token splits.
DECODE = [(149, 1), (36, 1), (0, 1), (64, 1)]


def _run(backend, batch):
    """Write the new K/V, attend, and return (output, oracle) for the real rows."""
    md = batch.metadata
    backend.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    out = backend.forward(batch.query, batch.k_cache, batch.v_cache, md, batch.scale)
    num_real = sum(md.query_lens_host)
    return out, naive_attention(batch.query, batch), num_real


def _assert_close(out, ref, dtype):
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err} > {TOLERANCE[dtype]} for {dtype}"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_mixed_batch_matches_oracle_fp32(block_size, num_heads, num_kv_heads, head_dim):
    batch = make_paged_batch(
        MIXED, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, device=DEVICE, seed=block_size + head_dim + num_heads,
    )
    out, ref, n = _run(TritonAttentionBackend(), batch)
    _assert_close(out[:n], ref[:n], torch.float32)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_decode_with_split_k_matches_oracle(block_size, num_heads, num_kv_heads):
    backend = TritonAttentionBackend(min_split_tokens=32, target_programs=64)
    batch = make_paged_batch(
        DECODE, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=32, device=DEVICE, seed=block_size,
    )
    num_splits = backend.num_decode_splits(batch.metadata, num_kv_heads, batch.query.device)
    longest_split = -(-batch.metadata.max_seq_len // num_splits)
    assert num_splits > 1 and longest_split < batch.metadata.max_seq_len
    out, ref, n = _run(backend, batch)
    _assert_close(out[:n], ref[:n], torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_kernel_any_split_count(num_splits):
    """Splits that leave some sequences' chunks empty must merge to the same result."""
    batch = make_paged_batch(DECODE, num_heads=6, num_kv_heads=2, head_dim=32, device=DEVICE, seed=7)
    md = batch.metadata
    TritonAttentionBackend().write_kv(
        batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping
    )
    out = torch.empty_like(batch.query)
    paged_decode(
        batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
        md.query_start_loc, batch.scale, num_splits, out,
    )
    _assert_close(out, naive_attention(batch.query, batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_half_precision_matches_oracle(dtype, specs):
    batch = make_paged_batch(
        specs, block_size=16, num_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype,
        device=DEVICE, seed=3,
    )
    out, ref, n = _run(TritonAttentionBackend(min_split_tokens=32, target_programs=64), batch)
    assert out.dtype == dtype
    _assert_close(out[:n], ref[:n], dtype)


@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_bf16_output_is_rounded_not_truncated(specs):
    """Rounding toward zero (the interpreter's fp32 -> bf16 cast) biases every
    output by about -0.2%; through 30 layers that flips greedy near-ties."""
    batch = make_paged_batch(
        specs, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device=DEVICE, seed=19
    )
    out, ref, n = _run(TritonAttentionBackend(min_split_tokens=32, target_programs=64), batch)
    ref = ref[:n].double()
    signed_err = ((out[:n].double() - ref) * ref.sign()).mean()
    assert signed_err.item() > -5e-4 * ref.abs().mean().item()


@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_block_size_8_and_padding_rows_are_zero(specs):
    batch = make_paged_batch(
        specs, block_size=8, num_heads=6, num_kv_heads=2, head_dim=32, device=DEVICE,
        num_padding_tokens=3, seed=11,
    )
    out, ref, n = _run(TritonAttentionBackend(min_split_tokens=32, target_programs=64), batch)
    _assert_close(out[:n], ref[:n], torch.float32)
    assert torch.count_nonzero(out[n:]) == 0


def test_strided_query_view():
    """Query as a view into a fused QKV projection (row stride > num_heads * head_dim)."""
    batch = make_paged_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=32, device=DEVICE, seed=5)
    num_tokens = batch.query.shape[0]
    fused = torch.randn(num_tokens, 10, 32, device=DEVICE)
    fused[:, :6] = batch.query
    batch.query = fused[:, :6]
    assert not batch.query.is_contiguous()
    out, ref, n = _run(TritonAttentionBackend(), batch)
    _assert_close(out[:n], ref[:n], torch.float32)


def test_matches_torch_backend():
    torch_backend = pytest.importorskip("pagedllm.attention.torch_backend")
    batch = make_paged_batch(
        MIXED + DECODE, num_heads=6, num_kv_heads=2, head_dim=32, device=DEVICE,
        num_padding_tokens=2, seed=13,
    )
    out, _, _ = _run(TritonAttentionBackend(), batch)
    expected = torch_backend.TorchAttentionBackend().forward(
        batch.query, batch.k_cache, batch.v_cache, batch.metadata, batch.scale
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_exact_and_skips_padding(dtype):
    batch = make_paged_batch(
        MIXED, num_heads=6, num_kv_heads=2, head_dim=32, dtype=dtype, device=DEVICE,
        num_padding_tokens=4, seed=17,
    )
    k_before, v_before = batch.k_cache.clone(), batch.v_cache.clone()
    slots = batch.metadata.slot_mapping
    TritonAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, slots)

    keep = slots >= 0
    expected_k = k_before.view(-1, 2, 32).clone()
    expected_v = v_before.view(-1, 2, 32).clone()
    expected_k[slots[keep]] = batch.new_key[keep]
    expected_v[slots[keep]] = batch.new_value[keep]
    assert torch.equal(batch.k_cache.view(-1, 2, 32), expected_k)
    assert torch.equal(batch.v_cache.view(-1, 2, 32), expected_v)
    assert (~keep).sum() == 4  # the padding rows existed and wrote nothing


def test_registry_returns_triton_backend():
    backend = get_attention_backend("triton", torch.device(DEVICE))
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"


def test_import_pagedllm_does_not_import_triton():
    code = (
        "import sys, pagedllm, pagedllm.attention.base; "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_gpu_check_script_interpret_mode(tmp_path):
    out_path = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--interpret", "--skip-engine", "--out", str(out_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out_path.read_text())
    kernel_check = report["kernel_check"]
    assert kernel_check["ok"], kernel_check
    assert kernel_check["cases"] and all(case["ok"] for case in kernel_check["cases"])
    assert report["decode_bandwidth"]["ok"], report["decode_bandwidth"]
    assert report["engine_greedy"]["skipped"] and report["w64_throughput"]["skipped"]


def test_gpu_check_script_runs_only_the_named_parts(tmp_path):
    out_path = tmp_path / "gpu_check.json"
    script = [sys.executable, "benchmarks/gpu_check.py", "--interpret", "--out", str(out_path)]
    proc = subprocess.run(script + ["--parts", "decode_bandwidth"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out_path.read_text())
    assert report["decode_bandwidth"]["ok"] and report["decode_bandwidth"]["runs"]
    for part in ("kernel_check", "engine_greedy", "w64_throughput"):
        assert report[part] == {"skipped": True, "reason": "not in --parts"}
    bad = subprocess.run(script + ["--parts", "kernel_check,bandwidth"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown part(s) bandwidth" in bad.stderr


def test_gpu_check_logprob_gap_sizes_a_divergence():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import gpu_check

    positions = [{5: -0.1, 6: -2.0}, {7: -0.60, 8: -0.75, 9: -3.0}]
    assert gpu_check._logprob_gap(positions, 1, [5, 7], [5, 8]) == 0.15
    assert gpu_check._logprob_gap(positions, 1, [5, 7], [5, 4]) is None  # outside the CPU's top-k
    assert gpu_check._logprob_gap(positions, 2, [5, 7], [5, 7, 1]) is None  # the CPU run had ended


def test_split_plan_matches_the_h200_sweep():
    """The split counts that gave the most bandwidth on an H200 (132 SMs, 8 KV heads)."""
    from pagedllm.attention.kernels.paged_decode import plan_num_splits

    target = 4 * 132  # the backend's default target on that device
    best = {(4, 16384): 16, (16, 8192): 4, (32, 4096): 2, (64, 4096): 1, (128, 2048): 1}
    for (batch, context), splits in best.items():
        assert plan_num_splits(batch, 8, context, target_programs=target) == splits, (batch, context)
    # short contexts are not cut below min_split_tokens
    assert plan_num_splits(4, 8, 600, target_programs=target, min_split_tokens=256) == 3
