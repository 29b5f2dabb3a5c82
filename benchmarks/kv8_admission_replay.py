"""How many of the 256-session serve run's requests two KV pools admit at once, without a server.

    python benchmarks/kv8_admission_replay.py [--seeds 0,1,2,3,4]

The serve run of the 8-bit KV target (`bench serve --dataset random
--num-prompts 256 --input-len-range 32:256 --output-len 64 --max-model-len
512 --max-num-seqs 256 --max-num-batched-tokens 2048`) against two pools of
the sizes its servers had: 728 blocks (bf16 KV in 256 MiB) and 1,412 (8-bit
KV in the same memory), block size 16. Per workload seed it prints:

- ``bound``: the packing bound of the first admission wave: the most leading
  prompts whose blocks, plus one headroom block each and the 1% watermark,
  fit the pool (what an admission that happened in a single step could reach);
- ``replay``: the peak running batch when the real scheduler and block
  manager serve all 256 requests at once, offline, on a tiny random model
  (their decisions do not depend on token values: every request generates
  exactly 64 tokens).
"""

from __future__ import annotations

import argparse
import tempfile

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workloads import random_workload

POOLS = (728, 1412)
BLOCK = 16


def tiny_model(directory: str) -> int:
    """A 2-layer random Llama with a word-level tokenizer; returns its vocabulary size."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = 256
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(directory)
    return vocab


def packing_bound(lengths: list[int], pool: int) -> int:
    free, used, n = pool - int(0.01 * pool), 0, 0
    while n < len(lengths) and used + -(-lengths[n] // BLOCK) + 1 <= free:
        used += -(-lengths[n] // BLOCK) + 1
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        vocab = tiny_model(directory)
        for seed in (int(s) for s in args.seeds.split(",")):
            prompts = random_workload(256, (32, 256), 64, seed=seed).prompt_token_ids
            lengths = [len(p) for p in prompts]
            requests = [{"prompt_token_ids": [3 + t % (vocab - 3) for t in p]} for p in prompts]
            bound, replay = {}, {}
            for pool in POOLS:
                llm = LLM(model=directory, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=pool,
                          max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=512)
                llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
                replay[pool] = llm.llm_engine.scheduler.peak_num_running
                bound[pool] = packing_bound(lengths, pool)
                del llm
            small, large = POOLS
            print(f"seed {seed}: bound {bound[small]} / {bound[large]} ({bound[large] / bound[small]:.3f}x), "
                  f"replay {replay[small]} / {replay[large]} ({replay[large] / replay[small]:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
