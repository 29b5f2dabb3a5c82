"""The offline API, shaped like vLLM's ``LLM`` class."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedllm.chat import template_kwargs
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import RequestError
from pagedllm.generation_config import default_sampling_fields
from pagedllm.kv.stats import KVCacheStats
from pagedllm.limits import RequestLimits
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.tokenizer import Tokenizer

PromptInput = str | dict


class LLM:
    """Load a model once, then generate for batches of prompts.

    ``model`` is an HF directory or a GGUF file; ``None`` is the default model
    (SmolLM2-135M-Instruct). ``num_kv_blocks`` (exact), ``kv_cache_memory``
    (bytes) or ``gpu_memory_utilization`` size the KV cache. ``request_limits``
    bounds what one request may ask for (``n``, stop strings, logit_bias entries,
    ...; see :class:`RequestLimits`). Every other keyword is an
    :class:`EngineConfig` field or one of vLLM's EngineArgs names (``swap_space``
    in GiB, ``kv_cache_memory_bytes``, ``trust_remote_code``, ...): code written
    for ``vllm.LLM`` runs unchanged.
    """

    def __init__(
        self, model: str | None = None, *, request_limits: RequestLimits | None = None, **engine_options
    ) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_options), request_limits)
        self._request_ids = itertools.count()
        self._default_sampling: dict | None = None

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine that is already running (the CLI builds one from its flags)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._request_ids = itertools.count()
        llm._default_sampling = None
        return llm

    # ---- generation -------------------------------------------------------

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order; without sampling_params, the
        model's defaults (:meth:`get_default_sampling_params`)."""
        prompt_list = _prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompt_list))
        return self._run(prompt_list, params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``, Jinja text) to one
        conversation or a list of them; ``chat_template_kwargs`` reach the template."""
        if not isinstance(messages, (list, tuple)):
            raise RequestError(
                f"messages must be a list of messages or a list of conversations, got {type(messages).__name__}",
                param="messages",
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tokenizer.encode(
                tokenizer.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                    **template_kwargs(chat_template_kwargs),
                ),
                add_special_tokens=False,
            )}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(
        self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Beam search per prompt; ``.outputs`` holds the beam_width best hypotheses, best first."""
        prompt_list = _prompt_list(prompts)
        return self._run(prompt_list, [params] * len(prompt_list), use_tqdm)

    # ---- introspection ----------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (``generation_config``), as vLLM."""
        if self._default_sampling is None:
            engine = self.llm_engine
            self._default_sampling = default_sampling_fields(engine.model_path, engine.config.generation_config,
                                                             engine.config.override_generation_config)
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def kv_cache_stats(self) -> KVCacheStats:
        return self.llm_engine.block_manager.stats()

    # ---- the loop ---------------------------------------------------------

    def _params_per_prompt(self, sampling_params, count: int) -> list:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, (SamplingParams, BeamSearchParams)):
            return [sampling_params] * count
        if not isinstance(sampling_params, (list, tuple)):
            raise RequestError(
                "sampling_params must be SamplingParams or a list of them, one per prompt, "
                f"got {type(sampling_params).__name__}",
                param="sampling_params",
            )
        params = list(sampling_params)
        if len(params) != count:
            raise RequestError(
                f"got {len(params)} sampling params for {count} prompts; pass one, or one per prompt",
                param="sampling_params",
            )
        return params

    def _run(self, prompts: list, params: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._request_ids)) for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                engine.add_request(request_id, prompt, p, output_kind=RequestOutputKind.FINAL_ONLY)
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, num_out_tokens = time.monotonic(), 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        num_out_tokens += sum(len(o.token_ids) for o in output.outputs)
                        bar.update(1)
                        elapsed = max(time.monotonic() - start, 1e-6)
                        bar.set_postfix_str(f"output {num_out_tokens / elapsed:.1f} tok/s")
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _prompt_list(prompts: object) -> list:
    """One prompt (text or a prompt dict) as a list of one; a list or tuple of prompts as is."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise RequestError(
            f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}",
            param="prompts",
        )
    return list(prompts)
