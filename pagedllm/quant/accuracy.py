"""How far a quantized model's logits are from its dequantized reference.

``python -m pagedllm.quant.accuracy [--model M] [--quantization gguf] --text FILE``
prints, for one fixed text, the max abs logit error, top-1 agreement and
both perplexities, then greedy continuations of a few prompts under both
paths (a divergence is reported with the reference's logit gap between the
two tokens, so near ties are visible). The reference is the same checkpoint
loaded with ``quantization="none"``: for a GGUF, the very weights the packed
blocks represent, dequantized to float32.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.loader import LoadedModel, load_model

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short list of fruits:",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\n\n# compute the mean of",
)


@dataclass
class LogitComparison:
    num_positions: int
    max_abs_error: float
    top1_agreement: float  # fraction of positions whose argmax agrees
    perplexity_reference: float
    perplexity_quantized: float


@dataclass
class GreedyComparison:
    prompt: str
    equal: bool
    first_divergence: int | None  # generated-token index of the first difference
    reference_gap: float | None  # reference logit(reference token) - logit(quantized token) there


def load(model: str | None, quantization: str, group_size: int = 32, quant_activations: str = "int16") -> LoadedModel:
    return load_model(
        model, dtype=torch.float32, device=torch.device("cpu"), attn_backend=TorchAttentionBackend(),
        quantization=quantization, quantization_group_size=group_size, quant_activations=quant_activations,
    )


@torch.inference_mode()
def prefill_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """float32 ``[len(tokens), vocab]``: one prompt through a contiguous block table."""
    block_size, n = 16, len(tokens)
    num_blocks = -(-n // block_size)
    cfg = loaded.config
    cache = KVCache(
        num_layers=cfg.num_layers, num_blocks=num_blocks, block_size=block_size, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=torch.float32, device="cpu",
    )
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n, max_seq_len=n, seq_lens_host=[n], query_lens_host=[n],
    )
    return loaded.model(torch.tensor(tokens), torch.arange(n), cache.layers, metadata)


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    """exp of the mean next-token negative log-likelihood of ``tokens[1:]``."""
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(tokens[1:])).item())


def compare_logits(reference: LoadedModel, quantized: LoadedModel, tokens: list[int]) -> LogitComparison:
    want, got = prefill_logits(reference, tokens), prefill_logits(quantized, tokens)
    return LogitComparison(
        num_positions=len(tokens),
        max_abs_error=(got - want).abs().max().item(),
        top1_agreement=(got.argmax(-1) == want.argmax(-1)).float().mean().item(),
        perplexity_reference=perplexity(want, tokens),
        perplexity_quantized=perplexity(got, tokens),
    )


def greedy_tokens(loaded: LoadedModel, prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(prefill_logits(loaded, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def compare_greedy(reference: LoadedModel, quantized: LoadedModel, prompt_ids: list[int], prompt: str,
                   num_tokens: int) -> GreedyComparison:
    want = greedy_tokens(reference, prompt_ids, num_tokens)
    got = greedy_tokens(quantized, prompt_ids, num_tokens)
    if want == got:
        return GreedyComparison(prompt, True, None, None)
    index = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    logits = prefill_logits(reference, prompt_ids + want[:index])[-1]
    return GreedyComparison(prompt, False, index, (logits[want[index]] - logits[got[index]]).item())


def main(argv: list[str] | None = None) -> int:
    from pagedllm.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--text", required=True, help="an English text file (the tests ship tests/data/english_text.txt)")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--quant-activations", default="int16", choices=["int16", "int8"])
    args = parser.parse_args(argv)
    reference = load(args.model, "none")
    quantized = load(args.model, args.quantization, args.group_size, args.quant_activations)
    tokenizer = Tokenizer.load(reference.path)
    tokens = tokenizer.encode(open(args.text, encoding="utf-8").read())
    c = compare_logits(reference, quantized, tokens)
    print(f"| {args.quantization} ({args.quant_activations} activations) | {c.num_positions} | {c.max_abs_error:.3f} | {100 * c.top1_agreement:.1f}% "
          f"| {c.perplexity_reference:.3f} | {c.perplexity_quantized:.3f} |")
    for prompt in PROMPTS:
        g = compare_greedy(reference, quantized, tokenizer.encode(prompt), prompt, args.greedy_tokens)
        detail = "equal" if g.equal else f"differs at token {g.first_divergence}, reference gap {g.reference_gap:.3f}"
        print(f"| {prompt!r} | {detail} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
