"""`pagedllm generate` and `pagedllm chat`."""

from __future__ import annotations

import argparse
import sys

from pagedllm.cli import add_engine_arguments, engine_config_from_args
from pagedllm.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    if name == "generate":
        parser.add_argument("prompt", nargs="+", help="one or more prompts")
    else:
        parser.add_argument("--system", default=None, help="system message")
    s = parser.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=128 if name == "generate" else 256)
    s.add_argument("--temperature", type=float, default=0.0 if name == "generate" else 0.7)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--n", type=int, default=1)
    s.add_argument("--stop", action="append", default=None)
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_arguments(parser)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        n=args.n,
        stop=args.stop,
        seed=args.sampling_seed,
    )


def run(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # validate before the (slow) model load
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    if args.command == "generate":
        return _generate(engine, args.prompt, params)
    return _chat(engine, args.system, params)


def _generate(engine, prompts: list[str], params: SamplingParams) -> int:
    from pagedllm.llm import LLM

    llm = LLM.from_engine(engine)
    for output in llm.generate(prompts, params, use_tqdm=False):
        for completion in output.outputs:
            header = f"[{output.request_id}.{completion.index}] " if len(prompts) * params.n > 1 else ""
            print(f"{header}{output.prompt}{completion.text}")
    return 0


def _stream_reply(engine, token_ids: list[int], params: SamplingParams, request_id: str) -> str:
    """Run one request, printing text as it is produced; returns the full reply."""
    engine.add_request(request_id, {"prompt_token_ids": token_ids}, params)
    printed = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text if output.outputs else ""
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    sys.stdout.write("\n")
    return printed


def _chat(engine, system: str | None, params: SamplingParams) -> int:
    messages = [{"role": "system", "content": system}] if system else []
    tokenizer = engine.tokenizer
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    for turn in range(10**9):
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        reply = _stream_reply(engine, ids, params, f"chat-{turn}")
        messages.append({"role": "assistant", "content": reply})
    return 0
