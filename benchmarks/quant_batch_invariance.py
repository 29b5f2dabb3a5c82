"""Greedy tokens of 12 prompts alone, in one batch of 12 and in pairs, on one engine.

    python benchmarks/quant_batch_invariance.py none|gguf

Prints how many prompts give the same 32 greedy tokens in a batch as alone
(fp32 activations; ``PAGEDLLM_QUANT_ISA`` picks the quantized kernels' path).
Pairs stay below the tiled kernel's 3 rows; the batch of 12 is above it.
"""

from __future__ import annotations

import sys

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is", "Here is a short list of fruits:", "Water boils at a temperature of",
    "Once upon a time, in a small village,", "The three primary colors are", "To make a cup of tea, first",
    "The largest planet in the solar system is", "In computer science, a linked list is",
    "My favourite book is", "The quick brown fox", "Photosynthesis is the process by which",
    "The French Revolution began in",
]


def main() -> None:
    quantization = sys.argv[1] if len(sys.argv) > 1 else "gguf"
    llm = LLM(quantization=quantization, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def run(prompts):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    alone = [run([p])[0] for p in PROMPTS]
    together = run(PROMPTS)
    pairs = [t for i in range(0, len(PROMPTS), 2) for t in run(PROMPTS[i : i + 2])]
    same_batch = sum(a == b for a, b in zip(alone, together, strict=True))
    same_pairs = sum(a == b for a, b in zip(alone, pairs, strict=True))
    print(f"{quantization}: alone == batch of 12: {same_batch}/12; alone == pairs: {same_pairs}/12")


if __name__ == "__main__":
    main()
