"""``pagedllm bench beam``: beam search of width W over one long prompt.

The scenario: a summarizer running W beams over a long transcript. Every beam
shares the prompt's KV blocks copy-on-write, so the peak of blocks in use
should stay near one prompt's blocks plus W beams' own blocks, against the W
prompts an unshared cache would hold. The run reports wall time, the prefill
time (submission to the first beam step), the peak of KV blocks in use against
``prompt + W x (new + 1)`` blocks (the bound), ``W x`` the prompt and one prompt,
and the process's peak resident memory (sampled every 20 ms).

With ``--beam-width 1 --max-tokens 1`` it times a long prompt's prefill alone.
``--compare pagedllm,vllm`` runs vLLM's ``LLM.beam_search`` (its CPU build, in
its own virtualenv) on the same prompt, width and rope scaling afterwards, in
the same invocation: its wall time, the time to its first beam step, and its
processes' peak resident memory.
A prompt longer than the model's trained context gets a YaRN rope scaling
unless ``--rope-scaling`` says otherwise. A run that cannot fit the KV budget
is refused before it starts, with the numbers.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass

from pagedllm.bench import report
from pagedllm.bench.throughput import PEER_PYTHON_ENV
from pagedllm.errors import ConfigError


@dataclass(frozen=True)
class BeamBudget:
    """Block counts of one beam-search run; all in KV blocks of ``block_size`` tokens."""

    block_size: int
    prompt_len: int
    beam_width: int
    max_tokens: int

    @property
    def prompt_blocks(self) -> int:
        return math.ceil(self.prompt_len / self.block_size)

    @property
    def new_blocks(self) -> int:
        """Blocks one beam's new tokens can need (may straddle the prompt's last block)."""
        return math.ceil(self.max_tokens / self.block_size)

    @property
    def shared_bound(self) -> int:
        """The prompt once plus each beam's new blocks and one copied-on-write block."""
        return self.prompt_blocks + self.beam_width * (self.new_blocks + 1)

    @property
    def unshared_blocks(self) -> int:
        """Every beam holding its own copy of prompt and new tokens."""
        return self.beam_width * math.ceil((self.prompt_len + self.max_tokens) / self.block_size)

    def check_fits(self, num_kv_blocks: int) -> None:
        """ConfigError, with the numbers, unless the shared run fits ``num_kv_blocks``."""
        if self.shared_bound > num_kv_blocks:
            raise ConfigError(
                f"beam width {self.beam_width} over a {self.prompt_len}-token prompt with "
                f"{self.max_tokens} new tokens needs up to {self.shared_bound} KV blocks "
                f"({self.prompt_blocks} for the prompt + {self.beam_width} x ({self.new_blocks} + 1) "
                f"for the beams, {self.block_size} tokens a block) but the KV cache has "
                f"{num_kv_blocks}; raise --kv-cache-memory / --num-kv-blocks or shorten the run"
            )


class PeakRSS:
    """Samples a process's resident set size (VmRSS) on a thread until stopped; bytes."""

    def __init__(self, pid: int | str = "self", interval_s: float = 0.02) -> None:
        self.path = f"/proc/{pid}/status"
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []  # (seconds since start, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._start = time.perf_counter()

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def read(self) -> int | None:
        try:
            with open(self.path) as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            rss = self.read()
            if rss is not None:
                self.samples.append((time.perf_counter() - self._start, rss))
            self._stop.wait(self.interval_s)

    @property
    def peak(self) -> int:
        return max((rss for _, rss in self.samples), default=0)


def checkpoint_config(model: str | None) -> dict:
    """The checkpoint's HF config, read without building the model."""
    import json

    from pagedllm.models.paths import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        from pagedllm.models.gguf_loader import load_gguf_checkpoint

        return load_gguf_checkpoint(path).hf_config
    return json.loads((path / "config.json").read_text())


def trained_context(model: str | None) -> int:
    """The checkpoint's max_position_embeddings."""
    return int(checkpoint_config(model).get("max_position_embeddings", 2048))


def default_rope_scaling(args: argparse.Namespace, needed: int) -> dict | None:
    """``--rope-scaling`` if given, else YaRN just long enough when ``needed`` passes the trained context."""
    if args.rope_scaling is not None:
        return args.rope_scaling
    trained = trained_context(args.model)
    if needed <= trained:
        return None
    return {"rope_type": "yarn", "factor": float(math.ceil(needed / trained)),
            "original_max_position_embeddings": trained}


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def run_beam(config, budget: BeamBudget, seed: int = 0) -> dict:
    """One beam search of ``budget``'s shape on a fresh engine built from ``config``."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import BeamSearchParams

    engine = LLMEngine(config)
    budget.check_fits(engine.kv_cache.num_blocks)
    prompt = random_prompt(budget.prompt_len, engine.model_config.vocab_size, seed)
    params = BeamSearchParams(beam_width=budget.beam_width, max_tokens=budget.max_tokens, ignore_eos=True)
    prefill_s = None
    with PeakRSS() as rss:
        start = time.perf_counter()
        engine.add_request("beam", {"prompt_token_ids": prompt}, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
            seqs = engine.sequence("beam") if engine.has_unfinished_requests() else []
            if prefill_s is None and (not seqs or any(s.num_output_tokens for s in seqs)):
                prefill_s = time.perf_counter() - start
                print(f"prompt of {budget.prompt_len} tokens prefilled in {prefill_s:.1f} s; "
                      f"{engine.block_manager.stats().num_used_blocks} KV blocks in use", file=sys.stderr)
        wall_s = time.perf_counter() - start
    stats = engine.block_manager.stats()
    stats_ok = stats.num_used_blocks == 0
    engine.block_manager.check_invariants()
    return {
        "prompt_len": budget.prompt_len,
        "beam_width": budget.beam_width,
        "max_tokens": budget.max_tokens,
        "rope_scaling": config.rope_scaling,
        "max_model_len": engine.max_model_len,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "attention": "native" if _native_attention(engine) else "torch",
        "wall_s": wall_s,
        "prefill_s": prefill_s,
        "num_hypotheses": len(outputs[0].outputs) if outputs else 0,
        "new_tokens_best": len(outputs[0].outputs[0].token_ids) if outputs else 0,
        "peak_used_blocks": stats.peak_used_blocks,
        "peak_blocks_without_sharing": stats.peak_blocks_without_sharing,
        "prompt_blocks": budget.prompt_blocks,
        "bound_blocks": budget.shared_bound,
        "unshared_blocks": budget.unshared_blocks,
        "within_bound": stats.peak_used_blocks <= 1.1 * budget.shared_bound,
        "num_kv_blocks": engine.kv_cache.num_blocks,
        "kv_empty_after": stats_ok,
        "peak_rss_bytes": rss.peak,
        "num_preemptions": stats.num_preemptions,
    }


def _native_attention(engine) -> bool:
    from pagedllm.native import cpu_ops

    backend = engine.worker.attn_backend
    return engine.device.type == "cpu" and getattr(backend, "use_native", None) is not False and cpu_ops.available()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedllm.cli import add_engine_arguments

    g = parser.add_argument_group("beam")
    g.add_argument("--beam-width", type=int, default=8)
    g.add_argument("--prompt-len", type=int, default=32768, help="prompt tokens (random ids)")
    g.add_argument("--max-tokens", type=int, default=32, help="new tokens per beam")
    g.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    g.add_argument("--compare", default=None, metavar="pagedllm,vllm",
                   help="also run vLLM's LLM.beam_search on the same prompt (needs --peer-python)")
    g.add_argument("--peer-python", default=None, metavar="PATH", help="the python of vLLM's virtualenv")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config_from_args

    if args.beam_width < 1 or args.prompt_len < 1 or args.max_tokens < 1:
        print("pagedllm bench beam: --beam-width, --prompt-len and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    backends = ["pagedllm"]
    if args.compare:
        backends = [b.strip() for b in args.compare.split(",") if b.strip()]
        if not backends or not set(backends) <= {"pagedllm", "vllm"}:
            print(f"pagedllm bench beam: --compare {args.compare!r}: choose from pagedllm, vllm", file=sys.stderr)
            return 2
    python = args.peer_python or os.environ.get(PEER_PYTHON_ENV)
    if "vllm" in backends and not python:
        print("pagedllm bench beam: --compare vllm needs --peer-python PATH (the python of vLLM's virtualenv) "
              f"or ${PEER_PYTHON_ENV}", file=sys.stderr)
        return 2
    needed = args.prompt_len + args.max_tokens
    args.rope_scaling = default_rope_scaling(args, needed)
    if args.max_model_len is None:
        args.max_model_len = needed
    config = engine_config_from_args(args)
    budget = BeamBudget(config.block_size, args.prompt_len, args.beam_width, args.max_tokens)
    if config.num_kv_blocks is not None:
        budget.check_fits(config.num_kv_blocks)  # before the model loads
    body = {"environment": report.environment()}
    ok = True
    if "pagedllm" in backends:
        result = run_beam(config, budget, seed=args.seed)
        print(format_result(result))
        body["pagedllm"] = result
        ok = result["within_bound"] and result["kv_empty_after"]
    if "vllm" in backends:
        from pagedllm.bench.peers import run_vllm_beam

        vocab_size = int(checkpoint_config(args.model)["vocab_size"])  # as the engine draws its prompt
        peer = run_vllm_beam(random_prompt(args.prompt_len, vocab_size, args.seed), python, args.model, args.dtype,
                             args.beam_width, args.max_tokens, args.rope_scaling, config.max_model_len or needed)
        body["vllm"] = peer
        print(format_peer(peer, body.get("pagedllm")))
    if args.json:
        report.write_json(args.json, body)
    return 0 if ok else 1


def format_peer(peer: dict, ours: dict | None) -> str:
    """vLLM's run, and pagedllm's beside it when both ran."""
    def row(label, key, fmt="{:.1f}", scale=1.0):
        def cell(result):
            value = result.get(key)
            return None if value is None else value * scale

        theirs = cell(peer)
        cells = [label, "-" if theirs is None else fmt.format(theirs)]
        if ours is not None:
            mine = cell(ours)
            cells += ["-" if mine is None else fmt.format(mine),
                      f"{theirs / mine:.2f}x" if theirs and mine else "-"]
        return cells

    rows = [row("wall time (s)", "wall_s"), row("prefill until the first beam step (s)", "prefill_s"),
            row("peak RSS, all processes (GiB)", "peak_rss_bytes", "{:.2f}", 2**-30)]
    header = ["LLM.beam_search", f"vLLM {peer.get('vllm_version')}"]
    if ours is not None:
        header += ["pagedllm", "vLLM / pagedllm"]
    return report.format_table(header, rows, title="vLLM, same prompt, width and rope scaling")


def format_result(r: dict) -> str:
    scaling = r["rope_scaling"]
    rows = [
        ["prompt tokens / new tokens / width", f"{r['prompt_len']} / {r['max_tokens']} / {r['beam_width']}"],
        ["rope scaling", "none" if scaling is None else f"{scaling['rope_type']} x{scaling['factor']:g}"],
        ["attention / dtype", f"{r['attention']} / {r['dtype']}"],
        ["wall time (s)", f"{r['wall_s']:.1f}"],
        ["prefill until the first beam step (s)", f"{r['prefill_s']:.1f}" if r["prefill_s"] else "-"],
        ["peak KV blocks in use", r["peak_used_blocks"]],
        ["bound: prompt + W x (new + 1) blocks", f"{r['bound_blocks']} (peak/bound {r['peak_used_blocks'] / r['bound_blocks']:.3f})"],
        ["one prompt's blocks", r["prompt_blocks"]],
        ["unshared: W x (prompt + new) blocks", r["unshared_blocks"]],
        ["peak of summed block tables", r["peak_blocks_without_sharing"]],
        ["peak RSS (GiB)", f"{r['peak_rss_bytes'] / 2**30:.2f}"],
        ["KV empty afterwards", r["kv_empty_after"]],
    ]
    return report.format_table(["beam search", "value"], rows, title="pagedllm bench beam")
