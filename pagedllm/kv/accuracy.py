"""Greedy output with an 8-bit KV cache against the same model with bfloat16 KV.

``python -m pagedllm.kv.accuracy [--model M] [--num-prompts N] [--max-tokens T]``
runs the model (bfloat16 weights and activations; ``--dtype float32`` too)
greedily on N prompts once with ``kv_cache_dtype=auto`` (KV in the model's
dtype, the reference) and once per 8-bit format, through the engine as a user
runs it, and prints one Markdown row per format: how many prompts gave identical tokens, and for each that diverged the
first divergent generated token and the log-probability gap between the two
candidate tokens at that step (both runs saw the same context up to it), under
the reference (``ref``: how much more the reference preferred its own token)
and under the format (``q``: how much more the quantized run preferred its
token), read from the step's own top-20 logprobs. Small gaps on both sides are
near ties that the format's rounding tipped, not damage. A control row runs
the reference again one prompt at a time (other batch shapes, same KV), so
the table shows how often mere arithmetic noise tips the same greedy choices.

``--text FILE`` adds next-token logits over one text, prefilled into each
cache: max abs logit error, top-1 agreement, mean KL and perplexity.

Prompts: the English prompts of :mod:`pagedllm.quant.accuracy`, then, for
more than those, the prompts of a workload file (``--workload``, e.g.
shared/workloads/w64.json: random token ids).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
from dataclasses import dataclass
from pathlib import Path

from pagedllm.kv.kv_format import FORMATS


@dataclass
class Divergence:
    """Where one prompt's quantized-KV greedy output first differs from the reference's."""

    prompt_index: int
    position: int  # index of the first differing generated token
    reference_gap: float  # reference: logprob(its token) - logprob(the quantized run's token)
    quantized_gap: float  # quantized run: logprob(its token) - logprob(the reference's token)
    exact: bool  # False: a token was outside the step's top candidates, the gap is a lower bound


@dataclass
class FormatResult:
    kv_cache_dtype: str
    num_prompts: int
    num_equal: int
    divergences: list[Divergence]


def prompt_token_ids(tokenizer, num_prompts: int, workload: Path | None) -> list[list[int]]:
    from pagedllm.quant.accuracy import PROMPTS

    prompts = [tokenizer.encode(p) for p in PROMPTS]
    if len(prompts) < num_prompts and workload is not None:
        prompts += json.loads(workload.read_text())["prompt_token_ids"]
    return prompts[:num_prompts]


def _engine(model: str | None, dtype: str, kv_cache_dtype: str, kv_cache_memory: int):
    from pagedllm import LLM

    return LLM(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=kv_cache_memory)


TOP_LOGPROBS = 20  # the candidates each step reports; a gap past them is a lower bound


@dataclass
class GreedyRun:
    """One prompt's greedy tokens and, per token, the step's top log-probabilities."""

    tokens: list[int]
    logprobs: list[dict[int, float]]

    def gap(self, position: int, other: int) -> tuple[float, bool]:
        """(logprob of this run's token - logprob of ``other`` at ``position``, exact?);
        when ``other`` is not among the reported candidates, the gap to the last one (a lower bound)."""
        step = self.logprobs[position]
        mine = step[self.tokens[position]]
        if other in step:
            return mine - step[other], True
        return mine - min(step.values()), False


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[GreedyRun]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        GreedyRun(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
        for o in outputs
    ]


def divergence(index: int, want: GreedyRun, got: GreedyRun) -> Divergence:
    """Both runs saw the same context up to the first differing token: the gaps are that step's own."""
    position = next(i for i, (a, b) in enumerate(zip(want.tokens, got.tokens, strict=True)) if a != b)
    reference_gap, ref_exact = want.gap(position, got.tokens[position])
    quantized_gap, q_exact = got.gap(position, want.tokens[position])
    return Divergence(index, position, reference_gap, quantized_gap, ref_exact and q_exact)


@dataclass
class TextComparison:
    """Next-token logits over one text (a single prefill), 8-bit KV against KV in the model's dtype."""

    kv_cache_dtype: str
    num_positions: int
    max_abs_logit_error: float
    top1_agreement: float  # fraction of positions whose argmax agrees
    mean_kl: float  # mean KL(reference || quantized) of the next-token distributions, nats
    perplexity_reference: float
    perplexity_quantized: float


def text_logits(loaded, tokens: list[int], cache_dtype):
    """Logits ``[len(tokens), vocab]``: the text as one prefill into a cache of ``cache_dtype``,
    so every position's attention reads the (quantized) cache."""
    return prefill(loaded, tokens, cache_dtype)[0]


def prefill(loaded, tokens: list[int], cache_dtype):
    """``tokens`` as one prefill of ``loaded.model`` into a fresh KV cache of ``cache_dtype``
    (blocks of 16, slots ``0 .. len(tokens) - 1`` in order): (logits ``[len(tokens), vocab]``, the cache)."""
    import torch

    from pagedllm.attention.base import AttentionMetadata
    from pagedllm.kv.kv_cache import KVCache

    n, block_size, cfg = len(tokens), 16, loaded.config
    num_blocks = -(-n // block_size)
    cache = KVCache(num_layers=cfg.num_layers, num_blocks=num_blocks, block_size=block_size,
                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cache_dtype, device="cpu")
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n, max_seq_len=n, seq_lens_host=[n], query_lens_host=[n],
    )
    with torch.inference_mode():
        return loaded.model(torch.tensor(tokens), torch.arange(n), cache.layers, metadata), cache


def compare_text(model: str | None, text: str, formats: list[str], dtype: str = "float32",
                 max_tokens: int = 1024) -> list[TextComparison]:
    import torch

    from pagedllm.attention.torch_backend import TorchAttentionBackend
    from pagedllm.kv import kv_format
    from pagedllm.models.loader import load_model
    from pagedllm.quant.accuracy import perplexity
    from pagedllm.tokenizer import Tokenizer

    model_dtype = getattr(torch, dtype)
    loaded = load_model(model, dtype=model_dtype, device=torch.device("cpu"), attn_backend=TorchAttentionBackend())
    tokens = Tokenizer.load(loaded.path).encode(text)[:max_tokens]
    want = text_logits(loaded, tokens, model_dtype).float()
    want_lp = want.log_softmax(-1)
    results = []
    for name in formats:
        got = text_logits(loaded, tokens, kv_format.cache_dtype(name, model_dtype)).float()
        got_lp = got.log_softmax(-1)
        results.append(TextComparison(
            name, len(tokens), (got - want).abs().max().item(),
            (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
            (want_lp.exp() * (want_lp - got_lp)).sum(-1).mean().item(),
            perplexity(want, tokens), perplexity(got, tokens),
        ))
    return results


CONTROL = "auto, one prompt at a time"  # the reference's own noise floor


def compare(model: str | None, num_prompts: int, max_tokens: int, formats: list[str],
            kv_cache_memory: int, workload: Path | None = None, dtype: str = "bfloat16",
            control: bool = True) -> list[FormatResult]:
    """One result per format, after (with ``control``) the reference against itself run one
    prompt at a time: different batch shapes, the same KV format, so its divergences are
    the arithmetic's near ties that any perturbation tips."""
    reference = _engine(model, dtype, "auto", kv_cache_memory)
    prompts = prompt_token_ids(reference.get_tokenizer(), num_prompts, workload)
    want = greedy(reference, prompts, max_tokens)
    results = []
    if control:
        alone = [greedy(reference, [p], max_tokens)[0] for p in prompts]
        results.append(_result(CONTROL, want, alone))
    for name in formats:
        quantized = _engine(model, dtype, name, kv_cache_memory)
        results.append(_result(name, want, greedy(quantized, prompts, max_tokens)))
        del quantized
        gc.collect()
    return results


def _result(name: str, want: list[GreedyRun], got: list[GreedyRun]) -> FormatResult:
    diverged = [divergence(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=True)) if w.tokens != g.tokens]
    return FormatResult(name, len(want), len(want) - len(diverged), diverged)


def format_row(result: FormatResult) -> str:
    details = "; ".join(
        f"#{d.prompt_index} at token {d.position} (ref {'' if d.exact else '>'}{d.reference_gap:.3f}, "
        f"q {'' if d.exact else '>'}{d.quantized_gap:.3f})"
        for d in result.divergences
    )
    largest = max((d.reference_gap for d in result.divergences), default=None)
    largest_text = "-" if largest is None else f"{largest:.3f}"
    return f"| {result.kv_cache_dtype} | {result.num_equal}/{result.num_prompts} | {largest_text} | {details or '-'} |"


def print_greedy(args: argparse.Namespace) -> None:
    results = compare(args.model, args.num_prompts, args.max_tokens, args.formats, args.kv_cache_memory,
                      args.workload, args.dtype, not args.no_control)
    print(f"{results[0].num_prompts} prompts x {args.max_tokens} greedy tokens, {args.dtype} model; "
          f"reference: {args.dtype} KV, all prompts in one batch")
    print(f"| kv_cache_dtype | prompts equal to {args.dtype} KV | largest ref gap | "
          "divergences: prompt, first token, logprob gaps |")
    print("|---|---|---|---|")
    for result in results:
        print(format_row(result))


def main(argv: list[str] | None = None) -> int:
    from pagedllm.native import cpu_ops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2 GGUF)")
    parser.add_argument("--num-prompts", type=int, default=8, help="0: only the --text comparison")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--kv-cache-memory", type=int, default=512 * 2**20, help="bytes")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the model's dtype; the reference KV is the same dtype")
    parser.add_argument("--no-control", action="store_true", help="skip the reference-against-itself row")
    parser.add_argument("--text", type=Path, default=None,
                        help="also compare next-token logits over this text (e.g. tests/data/english_text.txt)")
    parser.add_argument("--workload", type=Path, default=None,
                        help="more prompts past the 8 English ones: a workload JSON with prompt_token_ids")
    args = parser.parse_args(argv)
    print(f"machine: {cpu_ops.cpu_model()} ({platform.machine()}), native kernels: {cpu_ops.selected_isa()}")
    if args.num_prompts > 0:
        print_greedy(args)
    if args.text is not None:
        print(f"\nnext-token logits over {args.text} (one prefill), {args.dtype} model, against {args.dtype} KV")
        print("| kv_cache_dtype | positions | max abs logit error | top-1 agreement | mean KL (nats) "
              "| perplexity (ref -> 8-bit) |")
        print("|---|---|---|---|---|---|")
        for c in compare_text(args.model, args.text.read_text(encoding="utf-8"), args.formats, args.dtype):
            print(f"| {c.kv_cache_dtype} | {c.num_positions} | {c.max_abs_logit_error:.3f} | "
                  f"{100 * c.top1_agreement:.2f}% | {c.mean_kl:.2e} | {c.perplexity_reference:.3f} -> "
                  f"{c.perplexity_quantized:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
