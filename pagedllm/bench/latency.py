"""``pagedllm bench latency``: one request at a time, timed token by token.

Each run submits one prompt of random token ids (``ignore_eos``, greedy) and
drives the engine's step loop, stamping the moment every new token comes
out. TTFT is submission to first token; TPOT is the mean gap between later
tokens, (last - first) / (n - 1); decode tok/s is its inverse.
"""

from __future__ import annotations

import argparse
import sys
import time

from pagedllm.bench import report
from pagedllm.bench.throughput import dtype_name
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
    summary = {
        key: report.summarize([r[key] for r in runs if r[key] is not None])
        for key in ("ttft_s", "tpot_s", "decode_tokens_per_s", "e2e_s")
        if any(r[key] is not None for r in runs)
    }
    return {
        "backend": "pagedllm",
        "dtype": dtype_name(engine.dtype),
        "input_len": input_len,
        "output_len": output_len,
        "num_runs": num_runs,
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
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config_from_args

    if args.input_len < 1 or args.output_len < 1 or args.runs < 1:
        print("--input-len, --output-len and --runs must be >= 1", file=sys.stderr)
        return 2
    config = engine_config_from_args(args)
    result = run_latency(config, args.input_len, args.output_len, args.runs, args.seed, args.warmup)
    print(format_result(result))
    if args.json:
        report.write_json(args.json, {**result, "env": report.environment()})
    if args.plot:
        report.plot_latency(result, args.plot)
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
        f"Latency ({result['dtype']}): one request at a time, {result['input_len']} prompt tokens -> "
        f"{result['output_len']} new tokens, {result['num_runs']} runs"
    )
    return report.format_table(["metric", "min", "median", "max"], rows, title=title)
