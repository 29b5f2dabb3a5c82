"""pagedllm: an LLM inference and serving engine built on PagedAttention.

Public API: LLM, SamplingParams, BeamSearchParams, RequestOutput,
CompletionOutput, EngineConfig. ``LLM`` is imported lazily so that
``import pagedllm`` stays cheap.
"""

from pagedllm.config import EngineConfig
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str):
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
