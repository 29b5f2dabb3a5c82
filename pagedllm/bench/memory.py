"""``pagedllm bench memory``: where the KV cache goes, per allocation policy.

Policy audit. The same workload runs under each ``kv_policy`` with the same
scheduler and the same KV budget (``--kv-tokens``). After every engine step
every KV slot of the budget is put in one of four classes:

- token states: the slot holds a token's K/V;
- reserved for future tokens: allocated to a sequence and will be filled by
  a token it has not produced yet;
- internal fragmentation: allocated to a sequence that will finish before
  reaching it (contiguous over-reservation; for paged KV only the tail of the
  last block);
- unused: not allocated to any sequence.

Every request ignores EOS, so its final length (prompt + max_tokens) is
known, which is what tells reserved-for-future from fragmentation. Averages
are over engine steps (each step weighs the same), which keeps them
deterministic; utilization is token states / allocated slots. Prefix caching
is off so that the policies differ only in what they reserve.
``--headroom-tokens`` audits paged KV again under other admission headrooms
(``EngineConfig.num_headroom_tokens``; 0 admits whenever the prompt fits).

Sharing audit. Parallel sampling (n samples) and beam search fork sequences
that share blocks copy-on-write. For each n and beam width the peak of
blocks in use (shared blocks counted once) is compared with the peak of the
summed block-table lengths (what the same tables would take without sharing).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass

from pagedllm.bench import report
from pagedllm.bench.throughput import dtype_name
from pagedllm.bench.workloads import (
    WARMUP_OUTPUT_LEN,
    Workload,
    add_workload_arguments,
    warmup_prompts,
    workload_from_args,
)
from pagedllm.config import KV_POLICIES
from pagedllm.errors import ConfigError

DEFAULT_AUDIT_MAX_MODEL_LEN = 2048
DEFAULT_KV_TOKENS = 16384


@dataclass
class SlotCensus:
    """KV slots by class at one moment; ``num_seqs`` sequences hold device blocks."""

    num_total: int
    num_allocated: int
    num_holding: int
    num_future: int
    num_seqs: int

    @property
    def num_fragmented(self) -> int:
        return self.num_allocated - self.num_holding - self.num_future


def take_census(engine, final_lens: dict[str, int]) -> SlotCensus:
    """Classify the KV slots of the live requests (``final_lens``: request id -> final length)."""
    bm = engine.block_manager
    bs = bm.block_size
    allocated = holding = future = num_seqs = 0
    for request_id, final_len in final_lens.items():
        for seq in engine.sequence(request_id):
            if not bm.has_seq(seq.seq_id) or bm.is_swapped(seq.seq_id):
                continue  # waiting (preempted by recompute) or swapped out: no device slots
            capacity = len(bm.get_block_table(seq.seq_id)) * bs
            filled = bm.get_num_slots(seq.seq_id)
            allocated += capacity
            holding += filled
            future += max(0, min(final_len, capacity) - filled)
            num_seqs += 1
    return SlotCensus(bm.num_blocks * bs, allocated, holding, future, num_seqs)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_censuses(censuses: list[SlotCensus]) -> dict:
    """Step-averaged fractions; utilization and the allocated split ignore steps with nothing allocated."""
    busy = [c for c in censuses if c.num_allocated]
    return {
        "utilization": _mean([c.num_holding / c.num_allocated for c in busy]),
        "reserved_future": _mean([c.num_future / c.num_allocated for c in busy]),
        "internal_fragmentation": _mean([c.num_fragmented / c.num_allocated for c in busy]),
        "budget_breakdown": {
            "token_states": _mean([c.num_holding / c.num_total for c in censuses]),
            "reserved_future": _mean([c.num_future / c.num_total for c in censuses]),
            "internal_fragmentation": _mean([c.num_fragmented / c.num_total for c in censuses]),
            "unused": _mean([1 - c.num_allocated / c.num_total for c in censuses]),
        },
        "max_concurrent_seqs": max((c.num_seqs for c in censuses), default=0),
        "mean_concurrent_seqs": _mean([c.num_seqs for c in busy]),
        "num_steps": len(censuses),
    }


def _warm_up(engine) -> None:
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True)
    for i, prompt in enumerate(warmup_prompts(max_len=engine.max_model_len - WARMUP_OUTPUT_LEN)):
        engine.add_request(f"warmup-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()


def audit_policy(config, workload: Workload, warmup: bool = True, replay: ReplayRecorder | None = None) -> dict:
    """Run the workload under ``config`` (an EngineConfig); census after every step.

    With ``replay``, a KV snapshot is also taken after every step (not charged
    to ``engine_s``) for ``--html``.
    """
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    engine = LLMEngine(config)
    if warmup:
        _warm_up(engine)
    if replay is not None:
        replay.start_run(engine)
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    final_lens: dict[str, int] = {}
    for i, prompt in enumerate(workload.prompt_token_ids):
        engine.add_request(f"audit-{i}", {"prompt_token_ids": prompt}, params)
        final_lens[f"audit-{i}"] = len(prompt) + workload.output_len
    censuses: list[SlotCensus] = []
    engine_s, num_output, num_errors = 0.0, 0, 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        engine_s += time.perf_counter() - start
        for output in outputs:
            if output.finished:
                final_lens.pop(output.request_id, None)
                num_output += sum(len(c.token_ids) for c in output.outputs)
                num_errors += sum(1 for c in output.outputs if c.finish_reason == "error")
        censuses.append(take_census(engine, final_lens))
        if replay is not None:
            replay.record(engine, time.perf_counter() - start)
    stats = engine.block_manager.stats()
    return {
        "kv_policy": config.kv_policy,
        "num_headroom_tokens": config.num_headroom_tokens,
        "block_size": config.block_size,
        "dtype": dtype_name(engine.dtype),
        **summarize_censuses(censuses),
        "output_tokens": num_output,
        "engine_s": engine_s,
        # time inside engine.step() only: the census itself is not charged
        "output_tokens_per_s": num_output / engine_s if engine_s else 0.0,
        "num_preemptions": stats.num_preemptions,
        "peak_used_blocks": stats.peak_used_blocks,
        "num_kv_blocks": stats.num_blocks,
        "num_errors": num_errors,
    }


# ---- replay (--html) -----------------------------------------------------------

MAX_REPLAY_FRAMES = 400  # per run; longer runs keep evenly spaced steps


class ReplayRecorder:
    """KV snapshots after every engine step of each audited run, for the dashboard's replay mode."""

    def __init__(self) -> None:
        self.runs: list[dict] = []
        self._last_tokens = 0

    def start_run(self, engine) -> None:
        from pagedllm.server.dashboard import engine_settings

        engine.block_manager.take_recent_writes()  # the warm-up's copies are not part of the run
        name = engine.config.kv_policy
        if any(run["name"] == name for run in self.runs):  # paged again, under another headroom
            name += f", headroom {engine.config.num_headroom_tokens}"
        self.runs.append({"name": name, "settings": engine_settings(engine), "frames": [], "points": []})
        self._last_tokens = engine.num_generation_tokens_total

    def record(self, engine, step_s: float) -> None:
        from pagedllm.kv.snapshot import snapshot_engine

        run = self.runs[-1]
        snapshot = snapshot_engine(engine, engine.block_manager.take_recent_writes())
        step = len(run["points"])
        c = snapshot.counters
        held = c["num_slots_holding_tokens"] + c["num_slots_saved_by_sharing"]
        new_tokens = engine.num_generation_tokens_total - self._last_tokens
        self._last_tokens = engine.num_generation_tokens_total
        run["points"].append({
            "step": step, "kv_usage": c["usage"],
            "shared_saving": c["num_slots_saved_by_sharing"] / held if held else 0.0,
            "prefix_hit_rate": c["prefix_cache_hit_rate"] if c["prefix_cache_queries"] else None,
            "preemptions": c["num_preemptions_total"], "batch_size": c["num_running_seqs"],
            "gen_tok_s": new_tokens / step_s if step_s > 0 else 0.0,
        })
        run["frames"].append({"step": step, "snapshot": snapshot.to_json()})

    def data(self) -> dict:
        """The replay page's data: every run, thinned to MAX_REPLAY_FRAMES frames (points all kept)."""
        runs = []
        for run in self.runs:
            frames = run["frames"]
            if len(frames) > MAX_REPLAY_FRAMES:
                stride = len(frames) / MAX_REPLAY_FRAMES
                frames = [frames[int(k * stride)] for k in range(MAX_REPLAY_FRAMES - 1)] + [frames[-1]]
            # a frame's step indexes the run's points, so the chart cursor sits at its step
            runs.append({**run, "frames": frames})
        return {"runs": runs}

    def write_html(self, path: str) -> None:
        from pagedllm.server.dashboard import render_page

        with open(path, "w", encoding="utf-8") as f:
            f.write(render_page("replay", self.data()))


# ---- sharing ---------------------------------------------------------------------


def measure_sharing(engine, prompts: list[list[int]], params) -> dict:
    """Peak KV blocks with sharing vs without for ``params`` on every prompt at once."""
    bm = engine.block_manager
    live = {f"share-{time.monotonic_ns()}-{i}": p for i, p in enumerate(prompts)}
    for request_id, prompt in live.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    peak_with = peak_without = 0
    savings: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                live.pop(output.request_id, None)
                if output.error:
                    errors.append(output.error)
        with_sharing = bm.stats().num_used_blocks
        without = sum(
            len(bm.get_block_table(seq.seq_id))
            for request_id in live
            for seq in engine.sequence(request_id)
            if bm.has_seq(seq.seq_id) and not bm.is_swapped(seq.seq_id)
        )
        peak_with, peak_without = max(peak_with, with_sharing), max(peak_without, without)
        if without:
            savings.append(1 - with_sharing / without)
    if errors:
        raise RuntimeError(errors[0])
    return {
        "peak_blocks_with_sharing": peak_with,
        "peak_blocks_without_sharing": peak_without,
        "saving_pct": 100 * (1 - peak_with / peak_without) if peak_without else 0.0,
        "mean_saving_pct": 100 * _mean(savings),
        "wall_s": time.perf_counter() - start,
    }


def audit_sharing(
    config, prompts: list[list[int]], max_tokens: int, samples: list[int], beam_widths: list[int], seed: int
) -> dict:
    """One engine, one measurement per n and beam width; a failing entry records its error."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import BeamSearchParams, SamplingParams

    engine = LLMEngine(config)  # only block counts are measured here: no warm-up needed
    result: dict = {"parallel": {}, "beam": {}, "num_prompts": len(prompts), "max_tokens": max_tokens}
    entries = [
        ("parallel", n, SamplingParams(n=n, temperature=0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True))
        for n in samples
    ] + [
        ("beam", width, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
        for width in beam_widths
    ]
    for kind, k, params in entries:
        try:
            result[kind][str(k)] = measure_sharing(engine, prompts, params)
        except Exception as exc:  # parallel sampling / beam search failures are reported, not fatal
            result[kind][str(k)] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"sharing {kind} {k}: {type(exc).__name__}: {exc}", file=sys.stderr)
            engine = LLMEngine(config)  # the failed requests may have left state behind
    return result


# ---- command line ---------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedllm.cli import add_engine_arguments

    add_workload_arguments(
        parser, default_workload=True, default_num_prompts=64, default_output_len=None, with_seed=False
    )
    g = parser.add_argument_group("memory audit")
    g.add_argument(
        "--kv-tokens", type=int, default=None,
        help=f"KV budget in token slots for every policy (default {DEFAULT_KV_TOKENS}; --num-kv-blocks wins)",
    )
    g.add_argument("--policies", default=",".join(KV_POLICIES), help="comma-separated kv policies to audit")
    g.add_argument(
        "--headroom-tokens", type=_int_list, default=[],
        help="also audit paged KV admitting with these num_headroom_tokens, e.g. 0 (admit whenever the prompt fits)",
    )
    g.add_argument("--block-sizes", type=_int_list, default=None, help="also sweep paged KV over these block sizes, e.g. 8,16,32")
    g.add_argument("--sharing", action=argparse.BooleanOptionalAction, default=True, help="audit parallel sampling / beam search sharing")
    g.add_argument("--sharing-prompts", type=int, default=4, help="prompts (from the workload) per sharing measurement")
    g.add_argument("--sharing-output-len", type=int, default=None, help="new tokens per sharing request (default: the workload's)")
    g.add_argument("--sharing-n", type=_int_list, default=[2, 4, 8], help="parallel sample counts")
    g.add_argument("--sharing-beam", type=_int_list, default=[2, 4, 8], help="beam widths")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="a few short requests before each run")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    g.add_argument(
        "--html", default=None, metavar="FILE.html",
        help="write the dashboard's view of every audited run as an offline replay (step slider, play)",
    )
    g.add_argument("--plot", default=None, metavar="FILE.png", help="KV usage per policy (matplotlib)")
    g.add_argument("--sharing-plot", default=None, metavar="FILE.png", help="sharing savings (matplotlib)")
    g.add_argument("--sweep-plot", default=None, metavar="FILE.png", help="block-size sweep (matplotlib)")
    add_engine_arguments(parser)


def audit_config(args: argparse.Namespace, block_size: int, policy: str):
    """The engine config of one audit run: the same budget in tokens whatever the block size."""
    from pagedllm.cli import engine_config_from_args

    base = engine_config_from_args(args)
    kv_tokens = args.kv_tokens or DEFAULT_KV_TOKENS
    num_blocks = args.num_kv_blocks if args.num_kv_blocks else kv_tokens // block_size
    max_model_len = args.max_model_len or min(DEFAULT_AUDIT_MAX_MODEL_LEN, num_blocks * block_size)
    return dataclasses.replace(
        base, block_size=block_size, kv_policy=policy, num_kv_blocks=num_blocks,
        max_model_len=max_model_len, enable_prefix_caching=False,
    )


def run(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in KV_POLICIES]
    if unknown or not policies:
        raise ConfigError(f"--policies {args.policies!r}: choose from {list(KV_POLICIES)}")
    print(workload.describe(), file=sys.stderr)
    result: dict = {"workload": workload.describe(), "policies": {}}
    replay = ReplayRecorder() if args.html else None
    for policy in policies:
        print(f"auditing {policy} ...", file=sys.stderr, flush=True)
        config = audit_config(args, args.block_size, policy)
        result["policies"][policy] = audit_policy(config, workload, args.warmup, replay)
    result["paged_headroom"] = audit_headrooms(args, workload, replay)
    config = audit_config(args, args.block_size, policies[0])
    result.update(kv_tokens=config.num_kv_blocks * config.block_size, max_model_len=config.max_model_len)
    print(format_policies(result))
    if args.block_sizes:
        result["block_sizes"] = sweep_block_sizes(args, workload, result["policies"].get("paged"))
        print(format_sweep(result["block_sizes"]))
    if args.sharing:
        prompts = workload.prompt_token_ids[: args.sharing_prompts]
        max_tokens = args.sharing_output_len or workload.output_len
        print("auditing sharing ...", file=sys.stderr, flush=True)
        result["sharing"] = audit_sharing(
            audit_config(args, args.block_size, "paged"), prompts, max_tokens,
            args.sharing_n, args.sharing_beam, args.seed,
        )
        print(format_sharing(result["sharing"]))
    result["env"] = report.environment()
    _write_outputs(args, result)
    if replay is not None:
        replay.write_html(args.html)
        print(f"replay of {len(replay.runs)} run(s) written to {args.html}", file=sys.stderr)
    return 0


def audit_headrooms(args: argparse.Namespace, workload: Workload, replay: ReplayRecorder | None = None) -> dict:
    """Paged KV under each ``--headroom-tokens`` value, keyed by the value as a string."""
    runs = {}
    for num_tokens in args.headroom_tokens:
        print(f"auditing paged, headroom {num_tokens} tokens ...", file=sys.stderr, flush=True)
        config = audit_config(args, args.block_size, "paged")
        config = dataclasses.replace(config, num_headroom_tokens=num_tokens)
        runs[str(num_tokens)] = audit_policy(config, workload, args.warmup, replay)
    return runs


def labelled_runs(result: dict) -> dict:
    """Every audited run by its table label: the policies, then paged under other headrooms."""
    extra = {f"paged, headroom {n}": r for n, r in result.get("paged_headroom", {}).items()}
    return {**result["policies"], **extra}


def sweep_block_sizes(args: argparse.Namespace, workload: Workload, already: dict | None) -> dict:
    sweep = {}
    for block_size in args.block_sizes:
        if already is not None and block_size == args.block_size:
            sweep[str(block_size)] = already
            continue
        print(f"auditing paged, block size {block_size} ...", file=sys.stderr, flush=True)
        sweep[str(block_size)] = audit_policy(audit_config(args, block_size, "paged"), workload, args.warmup)
    return sweep


def _write_outputs(args: argparse.Namespace, result: dict) -> None:
    if args.json:
        report.write_json(args.json, result)
    if args.plot:
        report.plot_memory(labelled_runs(result), args.plot, title=f"KV cache usage, {result['kv_tokens']} token slots")
    if args.sharing_plot and "sharing" in result:
        report.plot_sharing(result["sharing"], args.sharing_plot)
    if args.sweep_plot and "block_sizes" in result:
        report.plot_block_sizes(result["block_sizes"], args.sweep_plot)


# ---- tables ------------------------------------------------------------------


def format_policies(result: dict) -> str:
    rows = []
    for name, r in labelled_runs(result).items():
        b = r["budget_breakdown"]
        rows.append([
            name, report.pct(r["utilization"]), report.pct(b["token_states"]), report.pct(b["reserved_future"]),
            report.pct(b["internal_fragmentation"]), report.pct(b["unused"]), r["max_concurrent_seqs"],
            r["mean_concurrent_seqs"], r["num_preemptions"], r["output_tokens_per_s"],
        ])
    headers = ["policy", "utilization", "tokens", "reserved", "int. frag", "unused", "max seqs",
               "mean seqs", "preempt", "output tok/s"]
    title = (
        f"KV memory audit ({result['kv_tokens']} token slots, max_model_len {result['max_model_len']}); "
        "utilization = tokens / allocated, the rest as % of the whole budget, averaged over steps"
    )
    return report.format_table(headers, rows, title=title)


def format_sweep(sweep: dict) -> str:
    rows = [
        [size, report.pct(r["utilization"]), report.pct(r["reserved_future"]), report.pct(r["internal_fragmentation"]),
         r["max_concurrent_seqs"], r["num_preemptions"], r["output_tokens_per_s"]]
        for size, r in sweep.items()
    ]
    headers = ["block size", "utilization", "reserved", "int. frag", "max seqs", "preempt", "output tok/s"]
    return report.format_table(headers, rows, title="Paged KV: block-size sweep (% of allocated slots)")


def format_sharing(sharing: dict) -> str:
    rows = []
    for kind in ("parallel", "beam"):
        for k, r in sharing.get(kind, {}).items():
            if "error" in r:
                rows.append([kind, k, None, None, r["error"][:60], None])
                continue
            rows.append([
                kind, k, r["peak_blocks_with_sharing"], r["peak_blocks_without_sharing"],
                f"{r['saving_pct']:.1f}%", f"{r['mean_saving_pct']:.1f}%",
            ])
    headers = ["kind", "n / width", "peak blocks", "peak w/o sharing", "saved (peak)", "saved (mean)"]
    title = f"KV sharing: {sharing['num_prompts']} prompts, {sharing['max_tokens']} new tokens each"
    return report.format_table(headers, rows, title=title)
