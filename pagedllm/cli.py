"""The `pagedllm` command: serve | generate | chat | bench.

Each subcommand's module adds its own arguments and runs it; this file only
dispatches, and holds the engine options every subcommand shares.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedllm.config import (
    DEFAULT_NUM_HEADROOM_TOKENS,
    KV_POLICIES,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATIONS,
    PREEMPTION_MODES,
    SUPPORTED_BLOCK_SIZES,
    EngineConfig,
)
from pagedllm.errors import PagedLLMError

# subcommand -> module with add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "generate": ("pagedllm.cli_generate", "Generate a completion for a prompt"),
    "chat": ("pagedllm.cli_generate", "Interactive chat with streaming output"),
    "serve": ("pagedllm.server.launcher", "Start the OpenAI-compatible HTTP server"),
    "bench": ("pagedllm.bench.cli", "Benchmarks: throughput, latency, serve, memory"),
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every subcommand that starts an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument("--block-size", type=int, default=16, choices=list(SUPPORTED_BLOCK_SIZES))
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV cache size, e.g. 2GiB or 500MB")
    g.add_argument("--swap-space", type=parse_size, default=0, help="CPU swap pool size, e.g. 1GiB")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--num-headroom-tokens", type=int, default=DEFAULT_NUM_HEADROOM_TOKENS,
                   help="admit a request only while every running sequence can still grow this many tokens "
                   "(0: admit whenever the prompt fits)")
    g.add_argument("--preemption-mode", default="recompute", choices=list(PREEMPTION_MODES))
    g.add_argument("--kv-policy", default="paged", choices=list(KV_POLICIES))
    g.add_argument("--attention-backend", default=None)
    g.add_argument("--enforce-eager", action="store_true", help="disable graph capture / compilation")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule each decode step before the previous step's tokens are read "
                   "(default: on with CUDA graphs)")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS),
                   help="weights: none (dense --dtype), gguf (GGUF Q4_0/Q4_1/Q8_0 served packed), int8|int4 (RTN)")
    g.add_argument("--quantization-group-size", type=int, default=32, choices=list(QUANTIZATION_GROUP_SIZES))
    g.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        swap_space=args.swap_space,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        num_headroom_tokens=args.num_headroom_tokens,
        preemption_mode=args.preemption_mode,
        kv_policy=args.kv_policy,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        num_threads=args.num_threads,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        seed=args.seed,
    )


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """Parse '2GiB', '500MB', '1048576' into bytes."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    if unit not in _UNITS or not number:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 1048576, 500MB or 2GiB")
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 500MB or 2GiB") from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sp, name)
        sp.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except PagedLLMError as exc:
        print(f"pagedllm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
