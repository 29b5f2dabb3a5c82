"""Which model class serves which checkpoint, keyed by HF ``architectures`` / ``model_type``."""

from __future__ import annotations

from pagedllm.errors import UnsupportedModelError
from pagedllm.models.llama import LlamaForCausalLM

# One implementation covers the family; the differences (q/k/v bias, rope
# scaling, tied head) are flags in ModelConfig.
ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def resolve_architecture(hf_config: dict) -> type:
    """The model class for a config.json dict.

    ``architectures`` wins when it names a supported class; otherwise
    ``model_type`` is consulted. Raises UnsupportedModelError listing the
    supported architectures.
    """
    for name in hf_config.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = hf_config.get("model_type")
    if not hf_config.get("architectures") and model_type in MODEL_TYPES:
        return ARCHITECTURES[MODEL_TYPES[model_type]]
    found = hf_config.get("architectures") or model_type
    raise UnsupportedModelError(
        f"model architecture {found!r} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
