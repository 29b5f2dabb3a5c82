"""The vLLM compatibility table (docs/vllm-compat.md), derived from the code.

The lists below name what vLLM users commonly set; whether pagedllm takes
each one is read from the code itself (EngineConfig's fields and vLLM
spellings, the ``pagedllm serve`` parser, SamplingParams' fields, the HTTP
request models), so the table cannot claim what the code does not do.
``python -m pagedllm.vllm_compat --write`` rewrites the file; a test checks it
is current.

Statuses: **same** (name and meaning as vLLM), **different** (accepted, with the
difference noted), **not applicable** (accepted, no effect here, logged once),
**missing** (refused with a ConfigError, or absent from the API).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

SAME, DIFFERENT, NOT_APPLICABLE, MISSING = "same", "different", "not applicable", "missing"
DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "vllm-compat.md"

# vLLM EngineArgs / LLM(...) keywords users commonly set.
VLLM_ENGINE_ARGS = (
    "model", "tokenizer", "tokenizer_mode", "trust_remote_code", "revision", "tokenizer_revision",
    "download_dir", "hf_token", "load_format", "dtype", "seed", "max_model_len",
    "gpu_memory_utilization", "kv_cache_memory_bytes", "swap_space", "cpu_offload_gb",
    "num_gpu_blocks_override", "block_size", "enable_prefix_caching", "max_num_seqs",
    "max_num_batched_tokens", "enable_chunked_prefill", "max_logprobs", "enforce_eager",
    "max_seq_len_to_capture", "compilation_config", "async_scheduling", "preemption_mode",
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    "distributed_executor_backend", "disable_custom_all_reduce", "enable_expert_parallel",
    "quantization", "kv_cache_dtype", "calculate_kv_scales", "generation_config",
    "override_generation_config", "served_model_name", "disable_log_stats", "enable_log_requests",
    "skip_tokenizer_init", "hf_overrides", "rope_scaling", "model_impl", "runner", "task",
    "enable_lora", "max_loras", "max_lora_rank", "speculative_config", "structured_outputs_config",
    "guided_decoding_backend", "logits_processors", "limit_mm_per_prompt", "scheduling_policy",
    "enable_sleep_mode", "kv_transfer_config", "disable_sliding_window", "long_prefill_token_threshold",
)

# `vllm serve` flags users commonly set (engine flags included).
VLLM_SERVE_FLAGS = (
    "MODEL (positional)", "--model", "--host", "--port", "--api-key", "--served-model-name",
    "--chat-template", "--generation-config", "--max-logprobs", "--ssl-keyfile", "--ssl-certfile",
    "--ssl-ca-certs", "--ssl-cert-reqs", "--allowed-origins", "--allowed-methods", "--allowed-headers",
    "--allow-credentials", "--root-path", "--uvicorn-log-level", "--disable-uvicorn-access-log",
    "--dtype", "--max-model-len", "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--swap-space",
    "--num-gpu-blocks-override", "--block-size", "--enable-prefix-caching", "--max-num-seqs",
    "--max-num-batched-tokens", "--enable-chunked-prefill", "--enforce-eager", "--async-scheduling",
    "--seed", "--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
    "--quantization", "--kv-cache-dtype", "--trust-remote-code", "--tokenizer", "--tokenizer-mode",
    "--revision", "--download-dir", "--load-format", "--max-seq-len-to-capture", "--cpu-offload-gb",
    "--distributed-executor-backend", "--disable-log-stats", "--disable-log-requests",
    "--enable-log-requests", "--disable-custom-all-reduce", "--response-role", "--enable-auto-tool-choice",
    "--tool-call-parser", "--chat-template-content-format", "--return-tokens-as-token-ids",
    "--enable-prompt-tokens-details", "--enable-request-id-headers", "--disable-fastapi-docs",
    "--middleware", "--lora-modules", "--trust-request-chat-template",
)

# vllm.SamplingParams / BeamSearchParams fields.
# vllm.SamplingParams / BeamSearchParams fields: vLLM 0.32's public ones (its peer in
# docs/benchmarks.md), then fields of earlier vLLM releases that code written for them still sets.
VLLM_SAMPLING_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "watermarking",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs", "prompt_logprobs", "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids",
    "flat_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length",
    "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args", "bad_words",
    "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection",
    "routed_experts_prompt_start", "trace_decode_token_ids",
)
VLLM_EARLIER_SAMPLING_FIELDS = ("best_of", "logits_processors", "truncate_prompt_tokens", "guided_decoding")
VLLM_BEAM_FIELDS = ("beam_width", "max_tokens", "ignore_eos", "temperature", "length_penalty",
                    "include_stop_str_in_output", "structured_outputs", "skip_special_tokens", "watermarking")

# Fields vLLM's OpenAI server takes beyond OpenAI's own ("extra_body" in the openai client).
VLLM_HTTP_EXTRAS = (
    "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "use_beam_search", "cache_salt", "prompt_logprobs",
    "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "chat_template", "chat_template_kwargs",
    "documents", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structured_outputs", "response_format", "priority", "request_id",
    "return_tokens_as_token_ids", "logits_processors", "vllm_xargs",
)

# Notes on names pagedllm accepts (key: the name as the table shows it); a
# note marks the row "different" unless it starts with SAME_NOTE.
SAME_NOTE = "same; "
ENGINE_NOTES = {
    "model": "an HF directory or a .gguf file on disk; None is the default model; nothing is downloaded",
    "dtype": "auto is float32 on the CPU (bfloat16 on CUDA); half/float and torch dtypes are accepted",
    "seed": "an int (default 0); None is not accepted",
    "gpu_memory_utilization": (
        "share of device memory for weights + KV as vLLM; on the CPU, of the RAM other processes leave; "
        "default None keeps pagedllm's sizing (half the free GPU memory, 4 GiB on the CPU), not 0.9"
    ),
    "swap_space": "GiB as vLLM (stored as swap_space_bytes); default 0, not 4; used by preemption_mode swap/auto",
    "kv_cache_memory_bytes": SAME_NOTE + "bytes, as vLLM (also spelled kv_cache_memory)",
    "num_gpu_blocks_override": "the number of KV blocks (also spelled num_kv_blocks), CPU or GPU",
    "block_size": "8, 16 or 32",
    "max_num_batched_tokens": "default max(2048, max_num_seqs)",
    "max_logprobs": "default 20; -1 (or None) is no cap; 0 is refused; enforced on logprobs and prompt_logprobs",
    "enforce_eager": SAME_NOTE + "turns CUDA graphs off; nothing else is compiled",
    "preemption_mode": SAME_NOTE + "vLLM 0.x's recompute | swap, plus auto",
    "tensor_parallel_size": "N worker processes over torch.distributed (gloo on CPU, NCCL on CUDA); "
                            "no async_scheduling, CUDA graphs or int8/int4 quantization with N > 1 yet (gguf works)",
    "quantization": "none (dense weights), gguf (a GGUF's Q4_0/Q4_1/Q8_0 served packed), int8 | int4 "
                    "(RTN weight-only, CPU); others raise ConfigError. Unset (None): gguf for a GGUF file on the "
                    "CPU in float32, none elsewhere (vLLM: the checkpoint's own scheme)",
    "kv_cache_dtype": "auto | int8 | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2; 8-bit codes carry a float16 scale "
                      "per token and KV head computed on write (no calibrated per-tensor scales)",
    "generation_config": SAME_NOTE + "auto | vllm | a folder, as vLLM; reads temperature, top_p, top_k, min_p, "
                         "repetition_penalty, max_new_tokens (GGUF: general.sampling.*)",
}
SERVE_NOTES = {
    "--ssl-cert-reqs": SAME_NOTE + "0, 1 or 2 (Python's ssl.CERT_*); 1 and 2 need --ssl-ca-certs",
    "--chat-template-content-format": "auto or string: text parts are joined into one string for the template; "
                                      "'openai' (part lists) stops the start-up with an error",
    "--trust-request-chat-template": SAME_NOTE + "without it a request's chat_template is a 400 (never ignored)",
    "--enable-request-id-headers": SAME_NOTE + "X-Request-Id on every response: the request's own, or a new id",
    "--enable-auto-tool-choice": "accepted and needed by nothing: tool calls are always parsed when tool_choice "
                                 "is auto",
    "--tool-call-parser": "hermes only (the `<tool_call>{...}</tool_call>` format pagedllm parses); another name "
                          "stops the start-up with an error listing it",
    "MODEL (positional)": SAME_NOTE + "as `vllm serve MODEL`; --model is kept",
    "--generation-config": "the server applies temperature, top_p, top_k, min_p and repetition_penalty "
                           "(not max_new_tokens) to requests that leave them unset",
    "--allowed-origins": "CORS is off unless given (vLLM always adds it, allowing every origin); "
                         "a JSON list or comma-separated",
    "--max-logprobs": "caps logprobs / top_logprobs / prompt_logprobs (default 20); over HTTP at most 20 "
                      "(OpenAI's range); -1 is refused",
    "--swap-space": SAME_NOTE + "GiB as vLLM, or a size with a unit (512MiB)",
    "--kv-cache-memory-bytes": SAME_NOTE + "bytes, or a size with a unit (2GiB)",
    "--dtype": "auto is float32 on the CPU",
}
HTTP_NOTES = {
    "documents": SAME_NOTE + "dicts of strings (title, text, ...) that the chat template renders as documents; "
                 "at most 256; also on /tokenize with messages",
    "request_id": SAME_NOTE + "the response id is cmpl-/chatcmpl- and it (an X-Request-Id header wins); 1-128 "
                  "letters, digits or ._:-, and two running requests may not share one (400)",
    "chat_template": SAME_NOTE + "rendered only where the server has --trust-request-chat-template, a 400 "
                     "otherwise; also on /tokenize with messages",
    "priority": SAME_NOTE + "0 only (first come, first served); another value is a 400",
    "logits_processors": "no custom logits processors are loaded: a non-empty list is a 400 (vLLM: a 400 "
                         "unless the server allows the named classes)",
    "vllm_xargs": SAME_NOTE + "SamplingParams.extra_args of the request (read by nothing built in); "
                  "JSON-like values, integers within 64 bits",
    "add_special_tokens": SAME_NOTE + "default true on completions, false on chat, as vLLM",
    "return_tokens_as_token_ids": SAME_NOTE + "logprobs name tokens 'token_id:<id>'; unset, the server's "
                                  "--return-tokens-as-token-ids decides",
    "chat_template_kwargs": SAME_NOTE + "the chat template's extra variables (also on /tokenize with messages); "
                            "at most 64 names, none the request sets another way (messages, tools, "
                            "add_generation_prompt, ...): a 400 names the field",
    "allowed_token_ids": SAME_NOTE + "not with use_beam_search (400)",
    "bad_words": SAME_NOTE + "not with use_beam_search (400); at most --max-logit-bias words of --max-stop-chars characters",
    "prompt_logprobs": "vLLM's format (per choice on completions, one list on chat); capped by --max-logprobs, "
                       "so -1 (the whole vocabulary) is a 400; with stream only 0, as vLLM",
    "truncate_prompt_tokens": SAME_NOTE + "keeps the last k prompt tokens (-1: the context length); 0 or more "
                              "than the context length is a 400",
}
SAMPLING_NOTES = {
    "allowed_token_ids": SAME_NOTE + "at most the vocabulary's size; ids outside it raise RequestError",
    "bad_words": SAME_NOTE + "each word banned at the text's start and after a space; at most max_logit_bias "
                 "words of max_stop_chars characters each (RequestLimits)",
    "top_k": SAME_NOTE + "0 or -1 disables",
    "seed": SAME_NOTE + "a per-request generator",
    "truncate_prompt_tokens": SAME_NOTE + "keeps the last k prompt tokens (-1: the context length); 0, below -1 "
                              "or more than the context length raises RequestError",
    "skip_reading_prefix_cache": SAME_NOTE + "False does not make a prompt_logprobs request read the cache: "
                                 "it needs every position's logits",
    "stream_interval": SAME_NOTE + "LLMEngine.step and AsyncLLMEngine.generate honour it",
    "output_kind": SAME_NOTE + "pagedllm.RequestOutputKind; LLMEngine.step and AsyncLLMEngine.generate honour it, "
                   "LLM.generate returns finished outputs",
    "logprob_token_ids": SAME_NOTE + "at most 128 ids and max_logprobs; each with its rank in the vocabulary; "
                         "an empty list raises RequestError (vLLM: no logprobs)",
}
EARLIER_NOTE = "a field of vLLM releases before 0.32"


@dataclass(frozen=True)
class Row:
    name: str
    status: str
    note: str = ""


def _noted(name: str, note: str) -> Row:
    if note.startswith(SAME_NOTE):
        return Row(name, SAME, note.removeprefix(SAME_NOTE))
    return Row(name, DIFFERENT if note else SAME, note)


def engine_rows() -> list[Row]:
    from pagedllm.config import (
        BACKEND_ARGS,
        IGNORED_ARGS,
        NO_OP_VALUES,
        RENAMED_ARGS,
        STRUCTURED_OUTPUT_BACKENDS,
        field_names,
    )

    rows = []
    fields = set(field_names())
    for name in VLLM_ENGINE_ARGS:
        note = ENGINE_NOTES.get(name, "")
        if name in BACKEND_ARGS:
            backends = " or ".join(repr(b) for b in STRUCTURED_OUTPUT_BACKENDS)
            rows.append(Row(name, DIFFERENT, f"the backend must be {backends} (grammars compile with xgrammar); "
                                             "others raise ConfigError"))
        elif name in NO_OP_VALUES:
            accepted = " or ".join(repr(v) for v in NO_OP_VALUES[name])
            rows.append(Row(name, DIFFERENT, f"accepted as {accepted} only; other values raise ConfigError"))
        elif name in IGNORED_ARGS:
            rows.append(Row(name, NOT_APPLICABLE, IGNORED_ARGS[name]))
        elif name in fields or name in RENAMED_ARGS:
            rows.append(_noted(name, note))
        else:
            rows.append(Row(name, MISSING, "raises ConfigError (unknown engine argument)"))
    return rows


def serve_parser() -> argparse.ArgumentParser:
    from pagedllm.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def serve_rows() -> list[Row]:
    from pagedllm.cli import VLLM_ONLY_FLAGS
    from pagedllm.config import IGNORED_ARGS, NO_OP_VALUES

    parser = serve_parser()
    options = {opt for action in parser._actions for opt in action.option_strings}
    positional = any(action.dest == "model_tag" for action in parser._actions)
    vllm_only = {flag for flag, _ in VLLM_ONLY_FLAGS}
    rows = []
    for flag in VLLM_SERVE_FLAGS:
        engine_name = flag.removeprefix("--").replace("-", "_")
        present = positional if flag == "MODEL (positional)" else flag in options
        note = SERVE_NOTES.get(flag, ENGINE_NOTES.get(engine_name, ""))
        if not present:
            rows.append(Row(flag, MISSING, "not a flag of pagedllm serve"))
        elif flag in vllm_only and engine_name in IGNORED_ARGS:
            rows.append(Row(flag, NOT_APPLICABLE, IGNORED_ARGS[engine_name]))
        elif flag in vllm_only and engine_name in NO_OP_VALUES:
            accepted = " or ".join(repr(v) for v in NO_OP_VALUES[engine_name])
            rows.append(Row(flag, DIFFERENT, f"accepted as {accepted} only; other values raise ConfigError"))
        else:
            rows.append(_noted(flag, note))
    return rows


def sampling_rows() -> list[Row]:
    from pagedllm.sampling_params import BeamSearchParams, SamplingParams

    rows = []
    groups = ((SamplingParams, VLLM_SAMPLING_FIELDS, ""), (SamplingParams, VLLM_EARLIER_SAMPLING_FIELDS, EARLIER_NOTE),
              (BeamSearchParams, VLLM_BEAM_FIELDS, ""))
    for owner, names, when in groups:
        fields = {f.name for f in dataclasses.fields(owner)}
        for name in names:
            label = f"{owner.__name__}.{name}"
            if name in fields:
                note = SAMPLING_NOTES.get(name, "") if owner is SamplingParams else ""
                row = _noted(label, note)
                note = "; ".join(n for n in (when, row.note) if n)
                rows.append(Row(label, row.status, note))
            else:
                rows.append(Row(label, MISSING, "; ".join(n for n in (when, "TypeError: not a field") if n)))
    return rows


def http_rows() -> list[Row]:
    from pagedllm.server import protocol as p

    completion, chat = set(p.CompletionRequest.model_fields), set(p.ChatCompletionRequest.model_fields)
    rows = []
    for name in VLLM_HTTP_EXTRAS:
        where = [route for route, fields in (("completions", completion), ("chat", chat)) if name in fields]
        if len(where) == 2:
            rows.append(_noted(name, HTTP_NOTES.get(name, "")))
        elif where:
            note = HTTP_NOTES.get(name, "").removeprefix(SAME_NOTE)
            route = f"/v1/{where[0].replace('chat', 'chat/completions')} only"
            rows.append(Row(name, SAME, f"{route}; {note}" if note else route))
        else:
            rows.append(Row(name, MISSING, "ignored if sent (unknown fields are dropped)"))
    return rows


def render() -> str:
    sections = (
        ("Engine arguments (`LLM(...)`, `EngineConfig(...)`)", engine_rows()),
        ("`pagedllm serve` flags", serve_rows()),
        ("`SamplingParams` / `BeamSearchParams` fields (vLLM 0.32's, then earlier releases')", sampling_rows()),
        ("HTTP request fields beyond OpenAI's (vLLM's extras)", http_rows()),
    )
    lines = [
        "# vLLM compatibility",
        "",
        "Generated by `python -m pagedllm.vllm_compat --write` from the code (the accepted names are",
        "read from EngineConfig, the `pagedllm serve` parser, SamplingParams and the HTTP request models);",
        "`tests/test_vllm_compat.py` fails when this file is out of date.",
        "",
        "Code written for vLLM runs with the import changed (`from pagedllm import LLM, SamplingParams`).",
        "Statuses: **same** (vLLM's name and meaning), **different** (accepted; the difference is noted),",
        "**not applicable** (accepted without effect, one log line), **missing** (refused, or not in the API).",
        "An unknown engine argument raises `ConfigError` naming the closest known one.",
    ]
    for title, rows in sections:
        counts = {s: sum(r.status == s for r in rows) for s in (SAME, DIFFERENT, NOT_APPLICABLE, MISSING)}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        lines += ["", f"## {title}", "", summary, "", "| vLLM | pagedllm | note |", "|---|---|---|"]
        lines += [f"| `{r.name}` | {r.status} | {r.note.replace('|', '/')} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH.name} instead of printing")
    if args.parse_args(argv).write:
        DOC_PATH.write_text(render())
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
