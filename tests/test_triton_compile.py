"""The Triton kernels compile for an H100/H200 (sm_90) without spilling, on a machine with no GPU.

The interpreter tests check what the kernels compute; these check what only
the GPU compiler can: that every specialization the launchers make compiles
to a cubin, fits the SM's shared memory and keeps its registers (ptxas -v).
``benchmarks/kernel_compile.py`` runs in a process of its own, because it
points Triton at a compile target instead of a device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "kernel_compile.py"
SM90_SHARED_MEMORY = 232_448


def _compile_environment() -> dict:
    triton = pytest.importorskip("triton", reason="triton is not installed; nothing to compile")
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as exc:
        pytest.skip(f"this triton ({triton.__version__}) lacks the compile-only API the check uses: {exc}")
    if not hasattr(knobs.runtime, "jit_cache_hook") or not Path(get_ptxas(90).path).exists():
        pytest.skip(f"this triton ({triton.__version__}) has no JIT cache hook or no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the GPU default; set only to silence triton's notice
    return env


def _run_script(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "kernels.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90", "--json", str(out), *args],
        cwd=REPO_ROOT, env=_compile_environment(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


def _check_reports(kernels: list[dict]) -> None:
    for k in kernels:
        where = f"{k['kernel']} ({k['launch']})"
        assert k["error"] is None, where + ": " + k["error"]
        assert k["shared_bytes"] <= SM90_SHARED_MEMORY, where
        assert k["registers"] is not None and k["registers"] <= 255, where
        # the engine's launches never spill; gpu_check.py's sweep candidates must compile and fit,
        # and a spill there is reported (the sweep times it), as some Triton releases spill one
        if " sweep " not in k["launch"]:
            assert k["spill_bytes"] == 0, where
        else:
            assert k["spill_bytes"] == 0 or k["notes"], where


def _launches_by_kernel(kernels: list[dict]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for k in kernels:
        found.setdefault(k["kernel"], set()).add(k["launch"])
    return found


def test_every_launch_compiles_for_sm90_without_spills(tmp_path):
    report = _run_script(tmp_path, "--quick")
    kernels = report["kernels"]
    _check_reports(kernels)
    found = _launches_by_kernel(kernels)
    assert set(found) == {"_write_kv_kernel", "_decode_split_kernel", "_decode_merge_kernel", "_prefill_kernel"}
    # Each dtype of each head shape reached each launcher (the merge only with split-K).
    for dtype in ("bfloat16", "float16", "float32"):
        for shape in ("h9/kv3 d64", "h32/kv8 d128"):
            tag = f"{shape} {dtype} bs16"
            assert f"write_kv {tag}" in found["_write_kv_kernel"]
            assert {f"paged_decode 1-split {tag}", f"paged_decode 4-split {tag}"} <= found["_decode_split_kernel"]
            assert f"paged_decode 4-split {tag}" in found["_decode_merge_kernel"]
            assert f"paged_prefill {tag}" in found["_prefill_kernel"]
    # Quantized caches (int8 / fp8 codes with float16 scales) reach every kernel that reads the cache.
    for fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
        for dtype in ("bfloat16", "float16"):
            for shape in ("h9/kv3 d64", "h32/kv8 d128"):
                tag = f"{shape} {dtype} bs16 kv {fmt}"
                assert f"write_kv {tag}" in found["_write_kv_kernel"]
                assert {f"paged_decode 1-split {tag}", f"paged_decode 4-split {tag}"} <= found["_decode_split_kernel"]
                assert f"paged_prefill {tag}" in found["_prefill_kernel"]
    # (the merge kernel reads only fp32 partials: the unquantized launch's specialization serves)
    int8_decode = next(k for k in kernels if k["launch"] == "paged_decode 1-split h32/kv8 d128 bfloat16 bs16 kv int8")
    assert int8_decode["constexprs"]["KV_FORMAT"] == "int8" and int8_decode["constexprs"]["DOT_DTYPE"] == "bf16"
    # 16-bit dots run on tensor cores: the compiled operands are the cache dtype.
    bf16_decode = next(k for k in kernels if k["launch"] == "paged_decode 1-split h32/kv8 d128 bfloat16 bs16")
    assert bf16_decode["constexprs"]["DOT_DTYPE"] == "bf16"
    assert bf16_decode["constexprs"]["GROUP_PAD"] == "16"


@pytest.mark.slow
def test_full_launch_matrix_compiles_for_sm90(tmp_path):
    kernels = _run_script(tmp_path)["kernels"]
    _check_reports(kernels)
    launches = {k["launch"] for k in kernels}
    for bs in (8, 16, 32):
        assert f"paged_prefill h8/kv8 d128 float16 bs{bs}" in launches
    assert any("sweep" in launch for launch in launches)


def test_oversized_tile_is_reported(tmp_path):
    """The check can fail: a 1,024-token decode tile needs more shared memory than sm_90 has."""
    code = textwrap.dedent(
        """
        import json, sys
        sys.path.insert(0, "benchmarks")
        import torch
        import kernel_compile as kc

        def drive(recorder):
            from pagedllm.attention.kernels.paged_decode import DecodeTiling, paged_decode
            b = kc._tiny_batch(32, 8, 128, torch.bfloat16, 16)
            recorder.launch = "oversized"
            paged_decode(b["query"], b["k_cache"], b["v_cache"], b["tables"], b["lens"], b["starts"],
                         0.1, 1, b["out"], DecodeTiling(block_n=1024, num_stages=3))

        print(json.dumps([r.problems for r in kc.run(90, drive)]))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_compile_environment(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    (problems,) = json.loads(result.stdout.strip().splitlines()[-1])
    assert any("shared memory" in p and "sm_90 has 232448" in p for p in problems), problems
