"""Where each rank's time went in a benchmark run: forward pass, collectives, sampling, step messages.

Read from the engine's workers (:class:`pagedllm.distributed.RankTimes`):
under tensor parallelism every rank's, gathered to rank 0; in one process,
the worker's own (its collectives are then empty). Reset after the warm-up so
that the figures cover the timed run alone.
"""

from __future__ import annotations

from dataclasses import asdict

from pagedllm.bench import report
from pagedllm.distributed import RankTimes


def collect(engine, reset: bool = False) -> list[RankTimes]:
    """Every rank's times, in rank order (zeroed afterwards if ``reset``)."""
    from pagedllm.worker.executor import MultiprocExecutor

    if isinstance(engine.executor, MultiprocExecutor):
        return engine.executor.rank_times(reset)
    tp = engine.worker.tp
    times = tp.times
    if reset:
        tp.reset_times()
    return [times]


def to_json(times: list[RankTimes]) -> list[dict]:
    return [asdict(t) for t in times]


def format_rank_times(ranks: list[dict], wall_s: float, label: str = "") -> str:
    """One row per rank: seconds and share of the run's wall time, per-step milliseconds."""
    rows = []
    for r in ranks:
        steps = max(r["num_steps"], 1)
        reduce, gather, message = r["all_reduce"], r["logits_gather"], r["step_message"]
        compute = r["forward_seconds"] - reduce["seconds"] - gather["seconds"]
        compute_cpu = r["forward_cpu_seconds"] - reduce["cpu_seconds"] - gather["cpu_seconds"]
        rows.append([
            r["rank"], r["num_steps"],
            _share(compute, wall_s, steps),
            round(compute_cpu, 2),
            _share(reduce["seconds"], wall_s, steps),
            reduce["num_calls"] / steps,
            reduce["num_bytes"] / max(reduce["num_calls"], 1) / 1e3,
            _share(gather["seconds"], wall_s, steps),
            _share(r["sample_seconds"], wall_s, steps),
            _share(message["seconds"], wall_s, steps),
            message["num_bytes"] / max(message["num_calls"], 1) / 1e3,
        ])
    headers = ["rank", "steps", "compute", "compute CPU s", "all-reduce", "reduces/step", "KB/reduce",
               "logits gather", "sampling", "step message", "KB/message"]
    note = ("seconds (% of the run, ms per step); collectives include waiting for the slower rank; "
            "compute CPU s: the forward thread's CPU time less its collectives' (one thread per rank under TP)")
    return report.format_table(headers, rows, title=f"Where the time went{label}: {note}")


def _share(seconds: float, wall_s: float, steps: int) -> str:
    return f"{seconds:.2f} ({100 * seconds / wall_s:.1f}%, {1e3 * seconds / steps:.2f})"
