"""``pagedllm bench latency``: one request at a time, timed token by token.

Each run submits one prompt of random token ids (``ignore_eos``, greedy) and
drives the engine's step loop, stamping the moment every new token comes
out. TTFT is submission to first token; TPOT is the mean gap between later
tokens, (last - first) / (n - 1); decode tok/s is its inverse.

``--compare pagedllm,vllm,llamacpp`` times the same prompts through vLLM's own
engine step loop and through llama.cpp on the same GGUF file as well (each in
its own virtualenv, see :mod:`pagedllm.bench.peers`), stamped the same way,
with the same thread count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from pagedllm.bench import report
from pagedllm.bench.throughput import (
    PEER_PYTHON_ENV,
    add_llamacpp_arguments,
    dtype_name,
    llamacpp_available,
)
from pagedllm.bench.workloads import WARMUP_OUTPUT_LEN, random_workload, warmup_prompts


def time_one_request(engine, request_id: str, prompt_token_ids: list[int], output_len: int) -> dict:
    """Run one request alone; return TTFT, TPOT, and the gap before each token after the first."""
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    stamps: list[float] = []
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            now = time.perf_counter()
            num_tokens = len(output.outputs[0].token_ids)
            # a step may yield several tokens at once; they share its timestamp
            stamps += [now] * (num_tokens - len(stamps))
    if len(stamps) != output_len:
        raise RuntimeError(f"request {request_id} produced {len(stamps)} tokens, expected {output_len}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    decode_s = stamps[-1] - stamps[0]
    return {
        "ttft_s": stamps[0] - start,
        "tpot_s": decode_s / (len(stamps) - 1) if len(stamps) > 1 else None,
        "decode_tokens_per_s": (len(stamps) - 1) / decode_s if decode_s > 0 else None,
        "e2e_s": stamps[-1] - start,
        "inter_token_s": gaps,
    }


def run_latency(
    config, input_len: int, output_len: int, num_runs: int, seed: int = 0, warmup: bool = True
) -> dict:
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    warm = warmup_prompts(max_len=engine.max_model_len - WARMUP_OUTPUT_LEN) if warmup else []
    for i, prompt in enumerate(warm):
        time_one_request(engine, f"warmup-{i}", prompt, WARMUP_OUTPUT_LEN)
    prompts = random_workload(num_runs, (input_len, input_len), output_len, seed=seed).prompt_token_ids
    runs = [time_one_request(engine, f"run-{i}", p, output_len) for i, p in enumerate(prompts)]
    # the weights as resolved (quantization=None picks per checkpoint and device)
    weights = {"quantization": engine.config.quantization, "quant_activations": engine.config.quant_activations}
    return {**summarize_runs("pagedllm", dtype_name(engine.dtype), input_len, output_len, runs), **weights}


def run_latency_vllm(args: argparse.Namespace, python: str) -> dict:
    """The same prompts (same seed) through vLLM, one at a time."""
    from pagedllm.bench.peers import resolve_dtype_name, run_vllm_latency

    workload = random_workload(args.runs, (args.input_len, args.input_len), args.output_len, seed=args.seed)
    runs, version = run_vllm_latency(workload, python, args.model, args.dtype)
    dtype = resolve_dtype_name(args.dtype)
    return {**summarize_runs("vllm", dtype, args.input_len, args.output_len, runs), "vllm": version}


def run_latency_llamacpp(args: argparse.Namespace) -> dict:
    """The same prompts (same seed) through llama.cpp on the same GGUF, one at a time."""
    from pagedllm.bench.peers import find_llamacpp_python, run_llamacpp_latency

    workload = random_workload(args.runs, (args.input_len, args.input_len), args.output_len, seed=args.seed)
    python, _ = find_llamacpp_python(args.llamacpp_python)
    data = run_llamacpp_latency(workload, python, args.model, args.num_threads)
    info = {key: data[key] for key in ("llama_cpp_python", "threads", "build_flags", "system_info", "gguf")}
    return {**summarize_runs("llamacpp", data["dtype"], args.input_len, args.output_len, data["runs"]), **info}


def summarize_runs(backend: str, dtype: str, input_len: int, output_len: int, runs: list[dict]) -> dict:
    summary = {
        key: report.summarize([r[key] for r in runs if r[key] is not None])
        for key in ("ttft_s", "tpot_s", "decode_tokens_per_s", "e2e_s")
        if any(r[key] is not None for r in runs)
    }
    return {
        "backend": backend,
        "dtype": dtype,
        "input_len": input_len,
        "output_len": output_len,
        "num_runs": len(runs),
        **summary,
        "runs": runs,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedllm.cli import add_engine_arguments

    g = parser.add_argument_group("latency")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    g.add_argument("--output-len", type=int, default=128, help="new tokens per request")
    g.add_argument("--runs", type=int, default=3, help="requests, one after another")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="a few short requests before timing")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="inter-token latency per run (matplotlib)")
    g.add_argument(
        "--compare", default=None, metavar="pagedllm,vllm,llamacpp",
        help="also time the same prompts through vLLM (needs --peer-python) and/or llama.cpp (--llamacpp-python)",
    )
    g.add_argument("--peer-python", default=None, metavar="PATH", help="the python of vLLM's virtualenv")
    add_llamacpp_arguments(g)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config_from_args

    if args.input_len < 1 or args.output_len < 1 or args.runs < 1:
        print("--input-len, --output-len and --runs must be >= 1", file=sys.stderr)
        return 2
    backends = ["pagedllm"]
    python = None
    if args.compare:
        backends = [b.strip() for b in args.compare.split(",") if b.strip()]
        if not backends or not set(backends) <= {"pagedllm", "vllm", "llamacpp"}:
            print(f"--compare {args.compare!r}: choose from pagedllm, vllm, llamacpp", file=sys.stderr)
            return 2
        if "llamacpp" in backends and not llamacpp_available(args):
            backends.remove("llamacpp")
        python = args.peer_python or os.environ.get(PEER_PYTHON_ENV)
        if "vllm" in backends and not python:
            print("--compare vllm needs --peer-python PATH (the python of vLLM's virtualenv)", file=sys.stderr)
            return 2
    config = engine_config_from_args(args)
    results = []
    for backend in backends:
        if backend == "pagedllm":
            result = run_latency(config, args.input_len, args.output_len, args.runs, args.seed, args.warmup)
        elif backend == "llamacpp":
            result = run_latency_llamacpp(args)
        else:
            result = run_latency_vllm(args, python)
        print(format_result(result))
        results.append(result)
    if args.json:
        body = results[0] if len(results) == 1 else {"results": results}
        report.write_json(args.json, {**body, "env": report.environment()})
    if args.plot:
        report.plot_latency(results[0], args.plot)
    return 0


def format_result(result: dict) -> str:
    scale = {"ttft_s": 1000, "tpot_s": 1000, "e2e_s": 1, "decode_tokens_per_s": 1}
    labels = {"ttft_s": "TTFT (ms)", "tpot_s": "TPOT (ms)", "decode_tokens_per_s": "decode tok/s", "e2e_s": "E2E (s)"}
    rows = [
        [labels[key], *(scale[key] * result[key][stat] for stat in ("min", "median", "max"))]
        for key in labels
        if key in result
    ]
    title = (
        f"Latency, {result['backend']} ({result['dtype']}): one request at a time, {result['input_len']} prompt tokens -> "
        f"{result['output_len']} new tokens, {result['num_runs']} runs"
    )
    return report.format_table(["metric", "min", "median", "max"], rows, title=title)
