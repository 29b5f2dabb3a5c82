"""Presenting benchmark results: aligned text tables, JSON files and matplotlib plots.

matplotlib is imported only when a plot is asked for, so the benchmarks run
without it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> str:
    """A plain-text table; numbers are right-aligned, floats get 3 significant decimals."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(_is_number(row[i]) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _is_number(value: object) -> bool:
    if value is None:
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def summarize(values: Sequence[float]) -> dict:
    """min / median / max / mean of a non-empty sample."""
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100] (numpy's default method)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# ---- JSON -------------------------------------------------------------------


def git_commit() -> str | None:
    """The repository's short commit id, or None outside a git checkout."""
    repo = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def environment() -> dict:
    """Where and when a figure was measured."""
    import torch

    return {
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": platform.machine(),
        **machine_class(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        # other work on the machine skews every figure: keep the evidence with them
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


_ISA_FLAG_PREFIXES = ("sse4", "avx", "fma", "f16c", "amx", "neon", "asimd", "sve")


def machine_class() -> dict:
    """The CPU a figure was measured on, and the native kernel path it ran.

    Figures compare only within one class: the CPU model, its vector ISA flags,
    whether torch has native bf16 matmuls there, and the dispatched paths of
    pagedllm's native kernels (``PAGEDLLM_CPU_ISA`` forces one) and of its packed
    quantized matmuls (``PAGEDLLM_QUANT_ISA``; None where they did not build), and
    whether attention and dense bfloat16 matmuls run on AMX tiles (and which kernel takes dense
    bfloat16 weights: "amx", "avx512_bf16", or None for oneDNN)."""
    import torch

    from pagedllm.layers.linear import dense_bf16_amx_available
    from pagedllm.native import cpu_ops, quant_ops
    from pagedllm.native.cpu_dtype import native_matmul

    flags = sorted(f for f in cpu_ops.cpu_flags() if f.startswith(_ISA_FLAG_PREFIXES))
    dense_kernel = quant_ops.dense_bf16_kernel() if dense_bf16_amx_available() else None
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count()
    return {
        "cpu_model": cpu_ops.cpu_model(),
        "cpu_isa_flags": flags,
        "bf16_matmul_native": native_matmul(torch.bfloat16),
        "native_isa": cpu_ops.selected_isa(),
        "native_isa_paths": list(cpu_ops.cpu_isa_paths()),
        "attention_amx": cpu_ops.attention_amx(),
        "dense_bf16_amx": dense_kernel == "amx",
        "dense_bf16_kernel": dense_kernel,
        "quant_isa": quant_ops.ISA_NAMES[quant_ops.isa()] if quant_ops.available() else None,
        "cpus_allowed": cores,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
    }


def write_json(path: str | os.PathLike, data: dict) -> None:
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())


# ---- plots ------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:  # a user-facing option asked for it
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


def plot_throughput(results: Sequence[dict], path: str | os.PathLike, title: str = "Throughput") -> None:
    """Bars of output and total tokens/s per backend run."""
    plt = _pyplot()
    labels = [f"{r['backend']}\n{r['dtype']}" for r in results]
    output = [r["output_tokens_per_s"] for r in results]
    total = [r["total_tokens_per_s"] for r in results]
    fig, ax = plt.subplots(figsize=(1.6 * len(results) + 2.5, 4))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], output, width=0.4, label="output tok/s")
    ax.bar([x + 0.2 for x in xs], total, width=0.4, label="total tok/s")
    for x, v in zip(xs, output, strict=True):
        ax.annotate(f"{v:.0f}", (x - 0.2, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.legend()
    _save(fig, path)


MEMORY_PARTS = (
    ("token_states", "token states", "#4c72b0"),
    ("reserved_future", "reserved for future tokens", "#dd8452"),
    ("internal_fragmentation", "internal fragmentation", "#c44e52"),
    ("unused", "unused (free) KV memory", "#cccccc"),
)


def plot_memory(policies: dict, path: str | os.PathLike, title: str = "KV cache usage") -> None:
    """Stacked bars per policy: how the KV budget is spent (the shape of the PagedAttention paper's Fig. 2)."""
    plt = _pyplot()
    names = list(policies)
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2.5, 4.5))
    bottoms = [0.0] * len(names)
    for key, label, color in MEMORY_PARTS:
        values = [100 * policies[n]["budget_breakdown"][key] for n in names]
        ax.bar(names, values, bottom=bottoms, label=label, color=color)
        for i, v in enumerate(values):
            if v >= 4:
                ax.text(i, bottoms[i] + v / 2, f"{v:.1f}%", ha="center", va="center", fontsize=8)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("% of the KV cache (time-averaged)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    _save(fig, path)


def plot_sharing(sharing: dict, path: str | os.PathLike, title: str = "KV memory saved by sharing") -> None:
    """Memory saving vs number of samples / beam width (the shape of the paper's Fig. 15)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6), sharey=True)
    for ax, (kind, label) in zip(axes, (("parallel", "parallel samples n"), ("beam", "beam width")), strict=True):
        entries = sharing.get(kind, {})
        keys = [k for k, v in entries.items() if isinstance(v, dict) and "saving_pct" in v]
        values = [entries[k]["saving_pct"] for k in keys]
        ax.bar(keys, values, color="#55a868")
        for i, v in enumerate(values):
            ax.annotate(f"{v:.1f}%", (i, v), ha="center", va="bottom", fontsize=8)
        ax.set_xlabel(label)
        ax.set_title(kind)
    axes[0].set_ylabel("% peak KV blocks saved")
    fig.suptitle(title)
    _save(fig, path)


def plot_latency(result: dict, path: str | os.PathLike) -> None:
    """Per-token latency over the generated sequence, one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, run in enumerate(result["runs"]):
        gaps = [1000 * g for g in run["inter_token_s"]]
        ax.plot(range(2, len(gaps) + 2), gaps, lw=0.8, label=f"run {i + 1}")
    ax.set_xlabel("output token index")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title(f"{result['backend']} {result['dtype']}: {result['input_len']} -> {result['output_len']} tokens")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_block_sizes(sweep: dict, path: str | os.PathLike) -> None:
    """Throughput and KV utilization per block size."""
    plt = _pyplot()
    sizes = list(sweep)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.bar(sizes, [sweep[s]["output_tokens_per_s"] for s in sizes], color="#4c72b0")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("output tok/s", color="#4c72b0")
    ax2 = ax.twinx()
    ax2.plot(sizes, [100 * sweep[s]["utilization"] for s in sizes], "o-", color="#c44e52")
    ax2.set_ylabel("% of reserved slots holding tokens", color="#c44e52")
    ax2.set_ylim(0, 100)
    ax.set_title("paged KV: block size sweep")
    _save(fig, path)
