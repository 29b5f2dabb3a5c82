"""pagedllm: an LLM inference and serving engine built on PagedAttention.

Public API: LLM, SamplingParams, BeamSearchParams, RequestOutput,
RequestOutputKind, CompletionOutput, EngineConfig. ``LLM`` is imported lazily so that
``import pagedllm`` stays cheap.
"""

from pagedllm.native.threads import set_openmp_defaults

set_openmp_defaults()  # before torch starts its OpenMP runtime (see pagedllm/native/threads.py)

from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]


def __getattr__(name: str):
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
