"""Tiny random-weight Llamas with a word-level tokenizer, saved in HF format for the tests.

Weights come from ``torch.manual_seed(0)`` then ``LlamaForCausalLM(config)``, so a given
configuration always saves the same model. Token ``t{i}`` is id ``i``; ``t0`` is unknown,
``t1`` BOS and ``t2`` EOS.
"""

from __future__ import annotations

from pathlib import Path

import torch

DEFAULTS = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
)


def save_tiny_llama(directory, *, random_biases: bool = False, chat_template: str | None = None,
                    **config) -> Path:
    """Save a random Llama (``DEFAULTS`` updated with ``config``) and its tokenizer into
    ``directory``. ``random_biases``: draw every bias from N(0, 0.5) (the initialiser zeroes them)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    options = {**DEFAULTS, **config}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**options))
    if random_biases:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    vocab = options["vocab_size"]
    words = RustTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return Path(directory)
