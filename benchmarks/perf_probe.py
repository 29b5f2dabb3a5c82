"""Quick performance probe for the CPU path: decode step times, one stream, W64.

Usage (one process per dtype; repeat runs, the machine's cores are shared):

    python benchmarks/perf_probe.py --dtype float32 steps      # runner step times
    python benchmarks/perf_probe.py --dtype float32 single     # 128 -> 128, one request
    python benchmarks/perf_probe.py --dtype float32 w64 --num-requests 32
    python benchmarks/perf_probe.py --dtype float32 profile    # torch.profiler table of a decode step
    python benchmarks/perf_probe.py --dtype bfloat16 breakdown # W64 under cProfile, by function

``steps`` times the worker's forward pass on synthetic decode batches (every
sequence at the same context length) without the scheduler, so it isolates
the forward pass plus input building.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

W64_PATH = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w64.json"  # ../shared beside the repo


def make_llm(args):
    from pagedllm import LLM

    started = time.perf_counter()
    options = dict(kv_cache_memory=args.kv_memory * 2**20, dtype=args.dtype)
    if args.eager:
        options["enforce_eager"] = True
    if args.threads:
        options["num_threads"] = args.threads
    llm = LLM(**options)
    return llm, time.perf_counter() - started


def decode_batch(batch: int, context: int, block_size: int, first_block: int = 1):
    """Chunks for ``batch`` sequences each decoding its token at position ``context``."""
    blocks_per_seq = context // block_size + 1
    chunks = []
    for i in range(batch):
        table = list(range(first_block + i * blocks_per_seq, first_block + (i + 1) * blocks_per_seq))
        chunks.append(
            SimpleNamespace(
                token_ids=[100 + i], start_pos=context, block_table=table, needs_logits=True, all_logits=False
            )
        )
    return SimpleNamespace(chunks=chunks, memory_ops=[])


def forward(worker, out):
    """One forward pass of the worker's model over ``out.chunks`` (no sampling)."""
    from pagedllm.runner.inputs import build_model_inputs

    inputs = build_model_inputs(out.chunks, worker.config.block_size, worker.device)
    with torch.inference_mode():
        return worker.model(
            inputs.input_ids, inputs.positions, worker.kv_cache.layers, inputs.metadata, inputs.logits_indices
        )


def time_steps(worker, out, repeats: int) -> list[float]:
    forward(worker, out)  # warm-up (and compile, if any)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        forward(worker, out)
        times.append(time.perf_counter() - started)
    return times


def cmd_steps(args) -> None:
    llm, load_s = make_llm(args)
    engine = llm.llm_engine
    print(f"load {load_s:.2f} s, threads {torch.get_num_threads()}, dtype {engine.dtype}")
    for batch, context in [(1, 128), (1, 512), (16, 300), (64, 300), (64, 500)]:
        out = decode_batch(batch, context, engine.config.block_size)
        times = time_steps(engine.worker, out, args.repeats)
        print(
            f"decode batch {batch:3d} ctx {context:4d}: median {1e3 * statistics.median(times):7.2f} ms"
            f"  min {1e3 * min(times):7.2f} ms"
        )
    prefill = SimpleNamespace(
        chunks=[SimpleNamespace(token_ids=list(range(200, 328)), start_pos=0, block_table=list(range(1, 9)),
                                needs_logits=True, all_logits=False)],
        memory_ops=[],
    )
    times = time_steps(engine.worker, prefill, args.repeats)
    print(f"prefill 128 tokens: median {1e3 * statistics.median(times):7.2f} ms  min {1e3 * min(times):7.2f} ms")


def cmd_single(args) -> None:
    from pagedllm import SamplingParams

    llm, load_s = make_llm(args)
    prompt = {"prompt_token_ids": [(i * 7919) % 49000 + 100 for i in range(128)]}
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for _ in range(args.repeats):
        started = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        wall = time.perf_counter() - started
        ttft = out.metrics.first_token_time - out.metrics.arrival_time
        decode_s = out.metrics.last_token_time - out.metrics.first_token_time
        print(
            f"load {load_s:.2f} s  TTFT {ttft * 1e3:.0f} ms  decode {127 / decode_s:.1f} tok/s"
            f"  end-to-end {128 / wall:.1f} tok/s"
        )


def w64_ready(args):
    """W64's prompts and sampling params, and an engine warmed up on two of them."""
    from pagedllm import SamplingParams

    work = json.loads(W64_PATH.read_text())
    prompts = [{"prompt_token_ids": p} for p in work["prompt_token_ids"][: args.num_requests]]
    params = SamplingParams(max_tokens=work["output_len"], temperature=0.0, ignore_eos=True)
    llm, load_s = make_llm(args)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return prompts, params, llm, load_s


def cmd_w64(args) -> None:

    prompts, params, llm, load_s = w64_ready(args)
    for _ in range(args.repeats):
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        num_out = sum(len(o.outputs[0].token_ids) for o in outs)
        num_in = sum(len(p["prompt_token_ids"]) for p in prompts)
        print(
            f"load {load_s:.2f} s  {len(prompts)} requests: {wall:.1f} s, "
            f"{num_out / wall:.1f} output tok/s, {(num_in + num_out) / wall:.1f} total tok/s"
        )
        if args.save_tokens:
            Path(args.save_tokens).write_text(json.dumps([o.outputs[0].token_ids for o in outs]))


def cmd_breakdown(args) -> None:
    """W64 once under cProfile: where the wall time goes, by function (own time)."""
    import cProfile
    import pstats


    prompts, params, llm, _ = w64_ready(args)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    print(f"wall {time.perf_counter() - started:.2f} s (under cProfile)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.rows)


def cmd_profile(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    llm, _ = make_llm(args)
    engine = llm.llm_engine
    out = decode_batch(args.batch, args.context, engine.config.block_size)
    time_steps(engine.worker, out, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            forward(engine.worker, out)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["steps", "single", "w64", "profile", "breakdown"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-memory", type=int, default=2048, help="MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--save-tokens", default="")
    args = parser.parse_args()
    {"steps": cmd_steps, "single": cmd_single, "w64": cmd_w64, "profile": cmd_profile, "breakdown": cmd_breakdown}[args.command](args)


if __name__ == "__main__":
    main()
