"""The `pagedllm` command: serve | generate | chat | bench.

Each subcommand's module adds its own arguments and runs it; this file only
dispatches, and holds the engine options every subcommand shares.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys

from pagedllm.config import (
    DEFAULT_KV_CACHE_DIR_SIZE,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_NUM_HEADROOM_TOKENS,
    DTYPE_ALIASES,
    KV_POLICIES,
    PREEMPTION_MODES,
    QUANT_ACTIVATIONS,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATIONS,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_KV_CACHE_DTYPES,
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
    g.add_argument("--dtype", default="auto", choices=[*SUPPORTED_DTYPES, *DTYPE_ALIASES])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    _add_kv_memory_arguments(g)
    _add_scheduling_arguments(g)
    _add_numerics_arguments(g)
    _add_vllm_only_flags(parser.add_argument_group("vLLM flags accepted without effect (one log line each)"))


def _add_kv_memory_arguments(g) -> None:
    """Where the KV cache lives and how big it is."""
    g.add_argument("--block-size", type=int, default=16, choices=list(SUPPORTED_BLOCK_SIZES))
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks", type=int, default=None,
                   help="exact number of KV blocks")
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", type=parse_size,
                   default=None, help="KV cache size in bytes, or with a unit: 2GiB, 500MB")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the device's memory (CPU: of the RAM other processes leave) for weights "
                   "plus KV cache, as vLLM (default: half the free GPU memory, 4 GiB on the CPU)")
    g.add_argument("--swap-space", dest="swap_space_bytes", type=parse_gib, default=0,
                   help="CPU swap pool in GiB as vLLM (4 = 4 GiB), or with a unit: 512MiB")
    g.add_argument("--kv-cache-dir", default=None,
                   help="disk tier of the prefix cache: evicted KV blocks are written here and reused, "
                   "also after a restart (off when unset)")
    g.add_argument("--kv-cache-dir-size", type=parse_size, default=DEFAULT_KV_CACHE_DIR_SIZE,
                   help="cap on the disk tier's files, e.g. 16GiB (the least recently used go first)")
    g.add_argument("--kv-host-cache-memory", type=parse_size, default=None,
                   help="host-memory tier of the prefix cache, e.g. 4GiB (default: 0 on a CPU device, "
                   "whose KV pool already is host memory; 4GiB on CUDA)")
    g.add_argument("--kv-cache-prefault", action=argparse.BooleanOptionalAction, default=None,
                   help="zero-fill the KV pools in host memory at start-up, so the process is at its full "
                   "size from the start, on 2 MiB pages where Linux grants them (default: on for serve, off otherwise)")


def _add_scheduling_arguments(g) -> None:
    """What runs each step, and on how many threads and processes."""
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
    g.add_argument("--num-threads", type=int, default=None, help="intra-op threads (per rank with tensor parallelism)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many worker processes (torch.distributed)")
    g.add_argument("--quantization-group-size", type=int, default=32, choices=list(QUANTIZATION_GROUP_SIZES))
    g.add_argument("--seed", type=int, default=0)


def _add_numerics_arguments(g) -> None:
    """What the model computes: its context scaling, weight and KV formats, sampling defaults."""
    g.add_argument("--rope-scaling", type=parse_json_object, default=None,
                   help='HF rope_scaling JSON replacing the model\'s, e.g. \'{"rope_type":"yarn","factor":4.0}\' '
                   "(linear | dynamic | yarn | llama3); lets --max-model-len pass the trained context")
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATIONS),
                   help="weights: none (default: dense --dtype), gguf (GGUF Q4_0/Q4_1/Q8_0 served packed), "
                   "int8|int4 (RTN, --quantization-group-size per scale); CPU only")
    g.add_argument("--quant-activations", default="int16", choices=list(QUANT_ACTIVATIONS),
                   help="with packed weights, quantize each matmul's inputs per 32 values to int16 (two int8 "
                   "levels: the dequantized weights' accuracy; default) or int8 (less integer work on big "
                   "batches, larger logit error)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(SUPPORTED_KV_CACHE_DTYPES),
                   help="KV cache storage: auto (the model dtype) or 8-bit codes with a float16 scale per "
                   "token and KV head -- int8, fp8_e4m3 (also fp8) or fp8_e5m2 -- which fit ~1.9x the "
                   "tokens of bfloat16 (~3.8x float32) in the same --kv-cache-memory")
    g.add_argument("--override-generation-config", type=parse_json_object, default=None,
                   help='generation_config.json keys set over the generation config\'s defaults, e.g. '
                   '\'{"temperature": 0.5, "max_new_tokens": 64}\'')
    g.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: auto (the model's generation_config.json or GGUF "
                   "metadata), vllm (SamplingParams' defaults) or a folder with generation_config.json")


def bounded(kind: type, low: float | None = None, high: float | None = None, *, above: bool = False,
            subject: str = "must be"):
    """An argparse type: a finite ``kind`` (int or float) >= ``low`` (> with ``above``) and <= ``high``.
    Errors read "<subject> ...": "must be >= 1, got 0", "a port is in 0-65535, got 99999"."""
    noun = "a whole number" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{subject} {noun}, got {text!r}") from None
        finite = kind is int or math.isfinite(value)
        if low is not None and high is not None:
            if not (finite and low <= value <= high):
                raise argparse.ArgumentTypeError(f"{subject} in {low}-{high}, got {text}")
        elif low is not None and not (finite and (value > low if above else value >= low)):
            raise argparse.ArgumentTypeError(
                f"{subject} {'a finite number ' if kind is float else ''}{'>' if above else '>='} {low}, got {text}")
        return value

    return parse


def parse_json_object(text: str) -> dict:
    """Parse a JSON object given on the command line (e.g. ``--rope-scaling``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object ({{...}})")
    return value



# vLLM flags that mean nothing here, or only their default: (flag, value type;
# None for a switch). EngineConfig logs the ignored ones and rejects a value
# other than the default for the rest (pagedllm.config.IGNORED_ARGS / NO_OP_VALUES).
VLLM_ONLY_FLAGS = (
    ("--trust-remote-code", None),
    ("--disable-log-stats", None),
    ("--disable-log-requests", None),
    ("--enable-log-requests", None),
    ("--disable-custom-all-reduce", None),
    ("--enable-chunked-prefill", None),
    ("--tokenizer-mode", str),
    ("--revision", str),
    ("--tokenizer-revision", str),
    ("--download-dir", str),
    ("--load-format", str),
    ("--max-seq-len-to-capture", int),
    ("--distributed-executor-backend", str),
    ("--tokenizer", str),
    ("--pipeline-parallel-size", int),
    ("--data-parallel-size", int),
    ("--cpu-offload-gb", float),
    ("--guided-decoding-backend", str),  # auto or xgrammar, else refused
    ("--structured-outputs-config", parse_json_object),  # {"backend": "xgrammar"}
)


def _add_vllm_only_flags(group) -> None:
    for flag, value_type in VLLM_ONLY_FLAGS:
        dest = "vllm_" + flag.removeprefix("--").replace("-", "_")
        if value_type is None:
            group.add_argument(flag, dest=dest, action="store_const", const=True, default=None)
        else:
            group.add_argument(flag, dest=dest, type=value_type, default=None, metavar="VALUE")


def _vllm_only_args(args: argparse.Namespace) -> dict:
    """The vLLM-only flags the user gave, as engine arguments."""
    given = {}
    for flag, _ in VLLM_ONLY_FLAGS:
        name = flag.removeprefix("--").replace("-", "_")
        value = getattr(args, "vllm_" + name, None)
        if value is not None:
            given[name] = value
    return given


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space_bytes=args.swap_space_bytes,
        kv_cache_dir=args.kv_cache_dir,
        kv_cache_dir_size=args.kv_cache_dir_size,
        kv_host_cache_memory=args.kv_host_cache_memory,
        kv_cache_prefault=bool(getattr(args, "kv_cache_prefault", None)),
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
        quantization_group_size=args.quantization_group_size,
        seed=args.seed,
        rope_scaling=args.rope_scaling,
        # `pagedllm serve --max-logprobs` (a request limit) also sets the engine's cap
        max_logprobs=getattr(args, "max_logprobs", DEFAULT_MAX_LOGPROBS),
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        quant_activations=args.quant_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        **_vllm_only_args(args),
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


def parse_gib(text: str) -> int:
    """Bytes from vLLM's GiB count ('4', '0.5') or a size with a unit ('512MiB')."""
    raw = text.strip()
    try:
        gib = float(raw)
    except ValueError:
        return parse_size(raw)
    if gib < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the swap space must be >= 0 GiB")
    return int(gib * 2**30)


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
