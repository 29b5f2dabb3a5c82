"""``pagedllm bench throughput``: offline throughput on a fixed workload.

All requests are submitted at once, greedy, ``ignore_eos``, prompts as token
ids; the clock runs from the first submission to the last finished request,
after a warm-up of a few short requests. The same workload can be run through
HF transformers, vLLM and llama.cpp (:mod:`pagedllm.bench.peers`); ``--compare`` runs
each backend in its own process, one after another, and prints them side by side.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.bench import rank_times, report, stopping
from pagedllm.bench.workloads import (
    WARMUP_OUTPUT_LEN,
    Workload,
    add_workload_arguments,
    warmup_prompts,
    workload_from_args,
)
from pagedllm.errors import ConfigError

BACKENDS = ("pagedllm", "hf", "vllm", "llamacpp")
# Environment variable naming the python of vLLM's virtualenv, when --peer-python is not given.
PEER_PYTHON_ENV = "PAGEDLLM_VLLM_PYTHON"


@dataclass
class ThroughputResult:
    """One backend on one workload; times in seconds."""

    backend: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    load_s: float | None = None
    num_errors: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "dtype": self.dtype,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "requests_per_s": self.num_requests / self.wall_s,
            "load_s": self.load_s,
            "num_errors": self.num_errors,
            **self.extra,
        }


def dtype_name(dtype) -> str:
    """'torch.float32' / 'float32' -> 'float32'."""
    return str(dtype).removeprefix("torch.")


# ---- pagedllm -----------------------------------------------------------------


def run_pagedllm(workload: Workload, config, warmup: bool = True) -> ThroughputResult:
    """Load an engine from ``config`` (an EngineConfig), warm it up, time the workload."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM.from_engine(LLMEngine(config))
    load_s = time.perf_counter() - start
    if warmup:
        warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True)
        warm_prompts = warmup_prompts(max_len=llm.llm_engine.max_model_len - WARMUP_OUTPUT_LEN)
        llm.generate([{"prompt_token_ids": p} for p in warm_prompts], warm, use_tqdm=False)
    rank_times.collect(llm.llm_engine, reset=True)  # the figures below cover the timed run alone

    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=workload.ignore_eos)
    prompts = [{"prompt_token_ids": p} for p in workload.prompt_token_ids]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start

    engine = llm.llm_engine
    ranks = rank_times.to_json(rank_times.collect(engine))
    stats = engine.block_manager.stats()
    return ThroughputResult(
        backend="pagedllm",
        dtype=dtype_name(engine.dtype),
        num_requests=len(outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        wall_s=wall_s,
        load_s=load_s,
        num_errors=sum(1 for o in outputs for c in o.outputs if c.finish_reason == "error"),
        extra={
            "block_size": config.block_size,
            "kv_policy": config.kv_policy,
            "num_kv_blocks": engine.kv_cache.num_blocks,
            "max_num_seqs": config.max_num_seqs,
            "peak_used_blocks": stats.peak_used_blocks,
            "num_preemptions": stats.num_preemptions,
            "tensor_parallel_size": config.tensor_parallel_size,
            # the weights as resolved (quantization=None picks per checkpoint and device)
            "quantization": engine.config.quantization,
            "quant_activations": engine.config.quant_activations,
            "rank_times": ranks,
        },
    )


# ---- command line -------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedllm.cli import add_engine_arguments

    add_workload_arguments(
        parser, default_workload=True, default_num_prompts=64, default_output_len=None, with_seed=False
    )
    g = parser.add_argument_group("backends")
    g.add_argument("--backend", default="pagedllm", choices=list(BACKENDS))
    g.add_argument(
        "--compare", default=None,
        help="comma-separated backends, each run in its own process, e.g. pagedllm,hf,vllm",
    )
    g.add_argument("--hf-batch-size", type=int, default=32, help="static batch size of the HF backend")
    g.add_argument(
        "--peer-python", default=None,
        help=f"python of the virtualenv with vLLM (default: ${PEER_PYTHON_ENV})",
    )
    add_llamacpp_arguments(g)
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="a few short requests before timing")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="draw the results (matplotlib)")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    print(workload.describe(), file=sys.stderr)
    if args.compare:
        results = compare(args, workload)
    else:
        results = [run_backend(args, workload).to_json()]
    print(format_results(results, workload))
    data = {"workload": workload.describe(), "env": report.environment(), "results": results}
    if not args.compare:
        data = {**results[0], "workload": workload.describe(), "env": data["env"]}
    if args.json:
        report.write_json(args.json, data)
    if args.plot:
        report.plot_throughput(results, args.plot, title=f"Throughput on {workload.name}")
    return 0 if all(r.get("num_errors", 0) == 0 for r in results) else 1


def run_backend(args: argparse.Namespace, workload: Workload) -> ThroughputResult:
    from pagedllm.bench import peers
    from pagedllm.cli import engine_config_from_args

    if args.backend == "pagedllm":
        return run_pagedllm(workload, engine_config_from_args(args), args.warmup)
    if args.backend == "hf":
        return peers.run_hf(workload, args.model, args.dtype, args.hf_batch_size, args.num_threads, args.warmup)
    if args.backend == "llamacpp":
        python, skipped = peers.find_llamacpp_python(args.llamacpp_python)
        if python is None:
            raise ConfigError(f"--backend llamacpp: {skipped}")
        return peers.run_llamacpp(workload, python, args.model, args.num_threads, args.llamacpp_slots)
    python = args.peer_python or os.environ.get(PEER_PYTHON_ENV)
    if not python:
        raise ConfigError(f"--backend vllm needs --peer-python PATH (the python of vLLM's virtualenv) or ${PEER_PYTHON_ENV}")
    return peers.run_vllm(workload, python, args.model, args.dtype, max_num_seqs=args.max_num_seqs)


def compare(args: argparse.Namespace, workload: Workload) -> list[dict]:
    """Run each backend of ``--compare`` in a fresh process on the same workload file."""
    from pagedllm.bench.peers import find_llamacpp_python
    from pagedllm.native.cpu_ops import ISA_PATHS, isa_environment

    backends = split_compare(args.compare)
    # pagedllm@ISA runs pagedllm with its native kernels forced to that path (isa_environment);
    # pagedllm[FLAGS] runs it with extra engine flags, e.g. pagedllm[--kv-cache-dtype int8]
    specs = [_parse_spec(b) for b in backends]
    unknown = [b for b, (name, isa, extra) in zip(backends, specs)
               if name not in BACKENDS or ((isa or extra) and name != "pagedllm")
               or (isa and isa not in ISA_PATHS)]
    if unknown or not backends:
        raise ConfigError(
            f"--compare {args.compare!r}: choose from {list(BACKENDS)}, pagedllm@ISA with ISA one of "
            f"{list(ISA_PATHS)}, or pagedllm[ENGINE FLAGS]"
        )
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as tmp:
        workload_file = Path(tmp) / "workload.json"
        workload.save(workload_file)
        for index, (label, (backend, isa, extra)) in enumerate(zip(backends, specs)):
            if backend == "llamacpp" and not llamacpp_available(args):
                continue
            out = Path(tmp) / f"{index}-{backend}.json"
            cmd = [
                sys.executable, "-m", "pagedllm.cli", "bench", "throughput",
                "--backend", backend, "--workload", str(workload_file), "--json", str(out),
                "--hf-batch-size", str(args.hf_batch_size),
            ]
            if args.peer_python:
                cmd += ["--peer-python", args.peer_python]
            if backend == "llamacpp":
                cmd += ["--llamacpp-python", find_llamacpp_python(args.llamacpp_python)[0],
                        "--llamacpp-slots", str(args.llamacpp_slots)]
            if not args.warmup:
                cmd.append("--no-warmup")
            cmd += engine_argv(args) + extra  # a variant's flags come last and win
            env = {**os.environ, **isa_environment(isa)} if isa else None
            print(f"running {label} ...", file=sys.stderr, flush=True)
            done = stopping.run_child(cmd, env=env)
            if done.returncode != 0 or not out.is_file():
                raise ConfigError(
                    f"the {label} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
                )
            results.append({**report.read_json(out), "backend": label})
    return results


def add_llamacpp_arguments(group) -> None:
    from pagedllm.bench.peers import DEFAULT_LLAMACPP_SLOTS, LLAMACPP_PYTHON_ENV

    group.add_argument(
        "--llamacpp-python", default=None, metavar="PATH",
        help=f"python of the virtualenv with llama-cpp-python (default: ${LLAMACPP_PYTHON_ENV}); "
             "without one the llamacpp peer is skipped",
    )
    group.add_argument("--llamacpp-slots", type=int, default=DEFAULT_LLAMACPP_SLOTS,
                       help="sequences llama.cpp decodes together (its server's --parallel)")


def llamacpp_available(args: argparse.Namespace) -> bool:
    """Whether llama.cpp's virtualenv is there; prints the line saying why it is skipped when not."""
    from pagedllm.bench.peers import find_llamacpp_python

    python, skipped = find_llamacpp_python(args.llamacpp_python)
    if python is None:
        print(f"skipping llamacpp: {skipped}", file=sys.stderr, flush=True)
    return python is not None


def split_compare(text: str) -> list[str]:
    """``--compare``'s comma-separated backends; commas inside ``[...]`` belong to a variant's flags."""
    parts, depth, current = [], 0, []
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    parts.append("".join(current).strip())
    return [p for p in parts if p]


def _parse_spec(spec: str) -> tuple[str, str, list[str]]:
    """``name[@isa][[flags]]`` -> (name, isa or "", extra engine flags)."""
    import shlex

    head, bracket, rest = spec.partition("[")
    if bracket and not rest.endswith("]"):
        raise ConfigError(f"--compare entry {spec!r}: a variant's flags go in one pair of brackets, last")
    extra = shlex.split(rest[:-1]) if bracket else []
    name, _, isa = head.strip().partition("@")
    return name, isa, extra


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options of ``args`` that differ from their defaults, as command-line flags."""
    from pagedllm.cli import add_engine_arguments

    probe = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(probe)
    defaults = vars(probe.parse_args([]))
    argv: list[str] = []
    for dest, default in defaults.items():
        value = getattr(args, dest, default)
        if value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + dest.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def format_results(results: list[dict], workload: Workload) -> str:
    base = next((r for r in results if r["backend"].partition("@")[0] == "pagedllm"), None)
    rows = []
    for r in results:
        ratio = r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None
        rows.append([
            r["backend"], r["dtype"], r["num_requests"], r["prompt_tokens"], r["output_tokens"],
            r["wall_s"], r["output_tokens_per_s"], r["total_tokens_per_s"], ratio,
        ])
    headers = ["backend", "dtype", "requests", "prompt tok", "output tok", "wall s",
               "output tok/s", "total tok/s", "x pagedllm"]
    tables = [report.format_table(headers, rows, title=f"Throughput: {workload.describe()}")]
    for r in results:
        if r.get("rank_times"):
            tables.append(rank_times.format_rank_times(r["rank_times"], r["wall_s"], f" ({r['backend']})"))
    return "\n\n".join(tables)
