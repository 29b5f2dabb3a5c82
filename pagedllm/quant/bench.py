"""Quantized against dense weights, in one invocation: decode speed, TTFT, weight memory, W64.

``python -m pagedllm.quant.bench --quantization none,gguf [--w64 PATH] [--num-threads N]``
loads one engine per setting in turn (same prompts, same seed) and prints a
markdown table: one request 128 -> 128 (median decode tok/s and TTFT over
``--runs``), the resident bytes of the model's weights, and, with ``--w64``,
the output tok/s of that workload.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

from pagedllm.config import EngineConfig


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as held in memory: dense parameters, oneDNN's packed copies
    of dense matrices (a tied LM head's beside the embedding it shares), and quantized matrices (tied once)."""
    from pagedllm.layers.linear import _HeldMatmul
    from pagedllm.quant.layers import quantized_weights

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.matmul.nbytes for m in model.modules() if isinstance(getattr(m, "matmul", None), _HeldMatmul))
    return total + sum(w.nbytes + w.table_nbytes for w in quantized_weights(model))


def run_one(setting: str, args: argparse.Namespace) -> dict:
    """One row: ``setting`` is a quantization, optionally with the activations after a slash
    (``gguf/int8``; the engine's default otherwise)."""
    from pagedllm.bench.latency import run_latency
    from pagedllm.bench.throughput import run_pagedllm
    from pagedllm.bench.workloads import load_workload
    from pagedllm.engine.llm_engine import LLMEngine

    quantization, _, activations = setting.partition("/")
    config = EngineConfig(model=args.model, quantization=quantization, num_threads=args.num_threads,
                          **({"quant_activations": activations} if activations else {}))
    latency = run_latency(config, args.input_len, args.output_len, args.runs)
    row = {
        "quantization": setting,
        "decode_tok_s": latency["decode_tokens_per_s"]["median"],
        "ttft_ms": 1000 * latency["ttft_s"]["median"],
    }
    engine = LLMEngine(config)
    row["weight_mb"] = weight_bytes(engine.worker.model) / 1e6
    del engine
    gc.collect()
    if args.w64:
        row["w64_tok_s"] = run_pagedllm(load_workload(args.w64), config).output_tokens_per_s
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="none,gguf", help="comma-separated settings, run in this order; "
                        "a quantization may name its activations after a slash: gguf/int8, gguf/int16")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--w64", default=None, metavar="PATH", help="a workload file, e.g. shared/workloads/w64.json")
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args(argv)
    rows = [run_one(q, args) for q in args.quantization.split(",")]
    print(f"load average before the last row: {os.getloadavg()}")
    print("| weights | decode tok/s (1 request) | TTFT ms | weight MB | W64 output tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        w64 = f"{r['w64_tok_s']:.1f}" if "w64_tok_s" in r else "-"
        print(f"| {r['quantization']} | {r['decode_tok_s']:.1f} | {r['ttft_ms']:.1f} | {r['weight_mb']:.1f} | {w64} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
