"""Compile every Triton kernel specialization pagedllm launches for a CUDA GPU, on a machine without one.

The Triton interpreter (``TRITON_INTERPRET=1``) checks what the kernels
compute; it does not check that they compile. A ``tl.dot`` shape the GPU
compiler rejects, a tile that needs more shared memory than the SM has, or
register spills only show up in the real compiler, which needs no GPU: only a
target. This script drives the real launchers (``write_kv``, ``paged_decode``
with and without split-K, ``paged_prefill``; unquantized and with int8 / fp8
KV caches) over the configurations the engine
and ``benchmarks/gpu_check.py`` launch, with Triton's active driver replaced
by one that reports the target GPU. Each launch's specialization (argument
types, constexprs, alignment, options) is recorded by Triton's JIT cache hook
instead of being run, then compiled to a cubin, and ``ptxas -v`` reports its
registers and spills.

Usage: ``python benchmarks/kernel_compile.py [--arch 90] [--quick] [--json OUT]``.
Exits 1 if any kernel fails to compile, spills registers, or needs more shared
memory than the target has (a spill in one of gpu_check.py's sweep candidates is
reported, not a failure); prints one line per compiled kernel.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels; must precede the first triton import

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Shared memory one block may use, bytes (CUDA occupancy tables): A100 163 KiB,
# consumer Ampere/Ada 99 KiB, H100/H200 227 KiB.
SHARED_MEMORY_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
MAX_REGISTERS = 255

# (query heads, KV heads, head_dim): the default model (SmolLM2-135M), the
# bandwidth shape of gpu_check.py, a 64-dim GQA model, plain multi-head attention.
HEAD_SHAPES = [(9, 3, 64), (32, 8, 128), (32, 8, 64), (8, 8, 128)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLOCK_SIZES = [8, 16, 32]
# Quantized KV cache formats (cache dtype), launched with 16-bit queries.
KV_FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QUANTIZED_QUERY_DTYPES = [torch.bfloat16, torch.float16]


@dataclass
class KernelReport:
    """One compiled specialization; ``error`` is set when it did not compile."""

    kernel: str
    launch: str
    constexprs: dict
    num_warps: int
    num_stages: int
    shared_bytes: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    seconds: float | None = None
    error: str | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class TargetOnlyDriver:
    """Stands in for Triton's CUDA driver: it names the target and nothing can launch.

    Triton's JIT asks the active driver for the device, the stream and the
    compile target before it binds arguments; with the recording hook
    installed it never gets as far as loading or launching a kernel.
    """

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class LaunchRecorder:
    """Triton's ``jit_cache_hook``: keep each new specialization, skip the launch."""

    def __init__(self) -> None:
        self.launch = ""
        self.seen: set[tuple[str, str]] = set()
        self.specializations: list[tuple[str, object, dict]] = []

    def __call__(self, *, key, fn, compile, **_ignored) -> bool:
        if (fn.name, str(key)) not in self.seen:
            self.seen.add((fn.name, str(key)))
            self.specializations.append((self.launch, fn.jit_function, compile))
        return True  # handled: the JIT returns without compiling or launching


def drive_launchers(recorder: LaunchRecorder, *, quick: bool) -> None:
    """Call each launcher on small CPU tensors of every configuration in the plan.

    Constexprs depend on head shape, dtype, block size and tiling, not on the
    number of sequences or context length, so tiny batches cover the launches
    the engine makes at full size.
    """
    from pagedllm.attention.kernels.paged_decode import DecodeTiling, paged_decode

    shapes = HEAD_SHAPES[:2] if quick else HEAD_SHAPES
    block_sizes = [16] if quick else BLOCK_SIZES
    for num_heads, num_kv_heads, head_dim in shapes:
        for dtype in DTYPES:
            for block_size in block_sizes:
                tag = f"h{num_heads}/kv{num_kv_heads} d{head_dim} {str(dtype).removeprefix('torch.')} bs{block_size}"
                _drive_attention(recorder, tag, _tiny_batch(num_heads, num_kv_heads, head_dim, dtype, block_size))
            if dtype not in QUANTIZED_QUERY_DTYPES:
                continue
            for fmt, cache_dtype in KV_FORMATS.items():
                # Block size changes only BLOCK_SIZE / BLOCK_N: one format and dtype take them all.
                for block_size in block_sizes if (fmt, dtype) == ("int8", torch.bfloat16) else [16]:
                    tag = f"h{num_heads}/kv{num_kv_heads} d{head_dim} {str(dtype).removeprefix('torch.')} bs{block_size}"
                    b = _tiny_batch(num_heads, num_kv_heads, head_dim, dtype, block_size, cache_dtype)
                    _drive_attention(recorder, f"{tag} kv {fmt}", b)
    # The decode tilings gpu_check.py sweeps at its bandwidth shape.
    b = _tiny_batch(32, 8, 128, torch.bfloat16, 16)
    tilings = [DecodeTiling(block_n=n, num_warps=w) for n in (32, 64, 128) for w in (4, 8)]
    tilings += [DecodeTiling(block_n=64, num_stages=3), DecodeTiling(block_n=128, num_warps=8, num_stages=3)]
    for tiling in tilings:
        for splits in (1, 4):
            recorder.launch = f"paged_decode {splits}-split sweep {tiling}"
            paged_decode(b["query"], b["k_cache"], b["v_cache"], b["tables"], b["lens"], b["starts"],
                         0.1, splits, b["out"], tiling)


def _drive_attention(recorder: LaunchRecorder, tag: str, b: dict) -> None:
    """write_kv, decode with and without split-K, and prefill on one tiny batch."""
    from pagedllm.attention.kernels.paged_decode import paged_decode
    from pagedllm.attention.kernels.paged_prefill import paged_prefill
    from pagedllm.attention.kernels.write_kv import write_kv

    scales = (b["k_scale"], b["v_scale"])
    recorder.launch = f"write_kv {tag}"
    write_kv(b["key"], b["key"], b["k_cache"], b["v_cache"], b["slots"], *scales)
    for splits in (1, 4):
        recorder.launch = f"paged_decode {splits}-split {tag}"
        paged_decode(b["query"], b["k_cache"], b["v_cache"], b["tables"], b["lens"], b["starts"],
                     0.1, splits, b["out"], None, *scales)
    recorder.launch = f"paged_prefill {tag}"
    paged_prefill(b["query"], b["k_cache"], b["v_cache"], b["tables"], b["lens"], b["starts"],
                  0.1, 1, b["out"], *scales)


def _tiny_batch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                cache_dtype: torch.dtype | None = None) -> dict:
    """Tensors for one launch of each kernel; ``cache_dtype`` (int8 / fp8) makes a quantized cache."""
    num_seqs, blocks_per_seq = 2, 2
    cache_shape = (num_seqs * blocks_per_seq, block_size, num_kv_heads, head_dim)
    quantized = cache_dtype is not None
    scale = torch.zeros(cache_shape[:3], dtype=torch.float16) if quantized else None
    return {
        "k_scale": scale,
        "v_scale": None if scale is None else scale.clone(),
        "query": torch.zeros(num_seqs, num_heads, head_dim, dtype=dtype),  # [tokens, H, D]
        "out": torch.zeros(num_seqs, num_heads, head_dim, dtype=dtype),
        "key": torch.zeros(num_seqs, num_kv_heads, head_dim, dtype=dtype),  # [tokens, KH, D]
        "k_cache": torch.zeros(cache_shape, dtype=cache_dtype or dtype),
        "v_cache": torch.zeros(cache_shape, dtype=cache_dtype or dtype),
        "tables": torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, blocks_per_seq),
        "lens": torch.full((num_seqs,), block_size + 1, dtype=torch.int32),
        "starts": torch.arange(num_seqs + 1, dtype=torch.int32),
        "slots": torch.arange(num_seqs, dtype=torch.int64),
    }


def compile_one(launch: str, jit_function, spec: dict, target, ptxas: str) -> KernelReport:
    """Compile one recorded specialization for ``target`` and check its resources."""
    import triton
    from triton.compiler import ASTSource

    options = _options_from(spec["specialization_data"])
    constexprs = {jit_function.arg_names[path[0]]: str(value) for path, value in spec["constants"].items()}
    report = KernelReport(
        kernel=jit_function.__name__, launch=launch, constexprs=constexprs,
        num_warps=options["num_warps"], num_stages=options["num_stages"],
    )
    start = time.perf_counter()
    try:
        source = ASTSource(jit_function, spec["signature"], spec["constants"], spec["configs"][0])
        compiled = triton.compile(source, target=target, options=options)
    except Exception as exc:  # noqa: BLE001 - a compile failure is the result being reported
        last_line = (str(exc).strip().splitlines() or [""])[-1]
        report.error = f"{type(exc).__name__}: {last_line}"
        report.problems.append("does not compile")
        return report
    report.seconds = round(time.perf_counter() - start, 2)
    report.shared_bytes = int(compiled.metadata.shared)
    report.registers, report.spill_bytes = _ptxas_resources(compiled.asm["ptx"], target.arch, ptxas)
    limit = SHARED_MEMORY_LIMIT.get(target.arch)
    if limit is not None and report.shared_bytes > limit:
        report.problems.append(f"needs {report.shared_bytes} B of shared memory, sm_{target.arch} has {limit}")
    if report.spill_bytes and " sweep " in report.launch:
        # a candidate gpu_check.py times, not a shape the engine launches: its spills are reported
        # (the sweep's timing shows their cost), not a failure (some Triton releases spill 4 B at
        # block_n=128 on 4 warps, sm_90)
        report.notes.append(f"spills {report.spill_bytes} B of registers (a sweep candidate)")
    elif report.spill_bytes:
        report.problems.append(f"spills {report.spill_bytes} B of registers")
    if report.registers is not None and report.registers > MAX_REGISTERS:
        report.problems.append(f"uses {report.registers} registers")
    return report


def _options_from(specialization_data: str) -> dict:
    """The JIT's compile options, with the lists JSON made of tuples turned back into tuples."""

    def as_tuple(value):
        return tuple(as_tuple(v) for v in value) if isinstance(value, list) else value

    return {k: as_tuple(v) for k, v in json.loads(specialization_data)["options"].items()}


def _ptxas_resources(ptx: str, arch: int, ptxas: str) -> tuple[int | None, int | None]:
    """(registers, spill store bytes) that ``ptxas -v`` reports for the kernel."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        suffix = "a" if arch >= 90 else ""
        result = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=False)
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    return (int(registers.group(1)) if registers else None, int(spills.group(1)) if spills else None)


def run(arch: int, drive) -> list[KernelReport]:
    """Record every launch ``drive(recorder)`` makes, then compile each distinct specialization.

    Leaves this process's Triton pointed at the target, not at a device: run it
    in a process of its own (there is no device driver to restore here).
    """
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime.driver import driver

    target = GPUTarget("cuda", arch, 32)
    recorder = LaunchRecorder()
    driver.set_active(TargetOnlyDriver(target))
    knobs.runtime.jit_cache_hook = recorder
    try:
        drive(recorder)
    finally:
        knobs.runtime.jit_cache_hook = None
    ptxas = get_ptxas(arch).path
    return [compile_one(launch, fn, spec, target, ptxas) for launch, fn, spec in recorder.specializations]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (90 = H100/H200)")
    parser.add_argument("--quick", action="store_true", help="two head shapes and block size 16 only")
    parser.add_argument("--json", help="write the per-kernel reports here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    reports = run(args.arch, lambda recorder: drive_launchers(recorder, quick=args.quick))
    for r in reports:
        status = "FAIL " + "; ".join(r.problems) if r.problems else "; ".join(["ok", *r.notes])
        print(f"{r.kernel:22s} {r.launch:58s} warps={r.num_warps} stages={r.num_stages} "
              f"smem={r.shared_bytes} regs={r.registers} spill={r.spill_bytes}  {status}")
        if r.error:
            print(f"    {r.error}")
    failed = [r for r in reports if r.problems]
    print(f"{len(reports)} specializations for sm_{args.arch}, {len(failed)} with problems, "
          f"{time.perf_counter() - started:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.arch, "kernels": [asdict(r) for r in reports]}, indent=1))
    return 1 if failed or not reports else 0


if __name__ == "__main__":
    sys.exit(main())
