"""``pagedllm bench structured``: the cost of grammar-constrained decoding.

One engine, one invocation: the workload unconstrained, then every request
under one JSON schema, then unconstrained again (the two unconstrained runs
bracket the constrained one, so drift on a shared machine shows). The schema
asks for at least ``MIN_ITEMS`` strings, so no request can finish it before
max_tokens and all runs generate the same number of tokens. Mask time per
step is the host time spent filling the bitmasks (one xgrammar call per
sequence, into one tensor, engine side), packing them into the batch's mask
(worker side) and applying them (one batched op), per step of the constrained
run; accept time is the matchers' advance past each sampled token.
Grammar compile time is measured on a 20-field schema: first use, then the
cached lookup.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass, field

from pagedllm.bench import report
from pagedllm.bench.workloads import add_workload_arguments, workload_from_args

MIN_ITEMS = 64
LONG_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": MIN_ITEMS}},
    "required": ["notes"],
}


def twenty_field_schema(nonce: str) -> dict:
    kinds = [{"type": "integer"}, {"type": "string", "maxLength": 32}, {"type": "boolean"},
             {"type": "number"}, {"enum": ["low", "medium", "high"]}]
    properties = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "description": nonce, "properties": properties, "required": list(properties)}


@dataclass
class MaskClock:
    """Host seconds in the grammar's bitmask work, and how many fills (steps with a mask) it timed.

    ``fill_s``: the matchers' fills of the allowed next tokens (engine side, one
    per row and position; ``num_steps``/``num_rows`` count the steps' masks);
    ``pack_s``: the worker joining the rows into the batch's mask; ``apply_s``:
    the one batched op on the logits; ``accept_s``: the matchers' advance past
    each sampled token.
    """

    fill_s: float = 0.0
    pack_s: float = 0.0
    apply_s: float = 0.0
    accept_s: float = 0.0
    num_steps: int = 0
    num_rows: int = 0
    _undo: list = field(default_factory=list)

    def install(self) -> None:
        """Wraps the hooks of pagedllm.structured for the duration of a run."""
        from pagedllm.structured import bitmask
        from pagedllm.structured.grammar import GrammarState
        from pagedllm.worker import worker  # the worker packs each step's rows into one mask

        rows_of_step, fill, pack = bitmask.fill_rows, GrammarState.fill_bitmask, worker._grammar_mask
        apply, accept = bitmask.GrammarMask.apply, GrammarState.accept

        def counted_rows(states, vocab_size):
            rows = rows_of_step(states, vocab_size)
            self.num_steps += 1
            self.num_rows += len(rows)
            return rows

        def timed_fill(state, bitmask_, row):
            start = time.perf_counter()
            fill(state, bitmask_, row)
            self.fill_s += time.perf_counter() - start

        def timed_pack(jobs, vocab_size):
            start = time.perf_counter()
            mask = pack(jobs, vocab_size)
            self.pack_s += time.perf_counter() - start
            return mask

        def timed_apply(mask, logits):
            start = time.perf_counter()
            out = apply(mask, logits)
            self.apply_s += time.perf_counter() - start
            return out

        def timed_accept(state, token_id):
            start = time.perf_counter()
            ok = accept(state, token_id)
            self.accept_s += time.perf_counter() - start
            return ok

        bitmask.fill_rows = counted_rows
        GrammarState.fill_bitmask = timed_fill
        worker._grammar_mask = timed_pack
        bitmask.GrammarMask.apply = timed_apply
        GrammarState.accept = timed_accept
        self._undo = [(bitmask, "fill_rows", rows_of_step), (GrammarState, "fill_bitmask", fill),
                      (worker, "_grammar_mask", pack),
                      (bitmask.GrammarMask, "apply", apply), (GrammarState, "accept", accept)]

    def uninstall(self) -> None:
        for owner, name, original in self._undo:
            setattr(owner, name, original)

    @property
    def total_s(self) -> float:
        return self.fill_s + self.pack_s + self.apply_s + self.accept_s


def _timed_generate(llm, prompts, params) -> dict:
    """One timed pass over ``prompts``. The prefix cache is emptied first: every pass
    prefills the same prompts, so without this the later passes skip their prefill and
    the constrained pass would be compared with a colder or warmer control."""
    if not llm.llm_engine.block_manager.reset_prefix_cache():
        raise RuntimeError("blocks are still in use between benchmark passes")
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"wall_s": wall_s, "output_tokens": num_output, "output_tok_s": num_output / wall_s,
            "texts": [o.outputs[0].text for o in outputs]}


def _compile_times(compiler) -> dict:
    from pagedllm.structured import StructuredOutputsParams

    params = StructuredOutputsParams(json=twenty_field_schema(uuid.uuid4().hex))
    start = time.perf_counter()
    compiler.compile(params)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=json.loads(json.dumps(params.json))))
    cached_s = time.perf_counter() - start
    return {"compile_20_fields_first_ms": first_s * 1e3, "compile_20_fields_cached_ms": cached_s * 1e3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedllm.cli import add_engine_arguments

    add_workload_arguments(parser, default_workload=True, default_num_prompts=64, default_output_len=None,
                           with_seed=False)
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config_from_args
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.llm import LLM
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.structured import StructuredOutputsParams

    workload = workload_from_args(args)
    print(workload.describe(), file=sys.stderr)
    llm = LLM.from_engine(LLMEngine(engine_config_from_args(args)))
    compile_times = _compile_times(llm.llm_engine.grammar_compiler)
    prompts = [{"prompt_token_ids": p} for p in workload.prompt_token_ids]
    free = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=workload.ignore_eos)
    constrained = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=workload.ignore_eos,
                                 structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA))
    llm.generate(prompts[:4], constrained, use_tqdm=False)  # warm-up: first compile, first masks
    runs = {"unconstrained_before": _timed_generate(llm, prompts, free)}
    clock = MaskClock()
    clock.install()
    try:
        runs["json_schema"] = _timed_generate(llm, prompts, constrained)
    finally:
        clock.uninstall()
    runs["unconstrained_after"] = _timed_generate(llm, prompts, free)
    num_valid_prefixes = sum(t.startswith('{"notes"') or t.lstrip().startswith("{") for t in runs["json_schema"].pop("texts"))
    for entry in runs.values():
        entry.pop("texts", None)
    steps = max(clock.num_steps, 1)
    result = {
        "workload": workload.describe(),
        "runs": runs,
        "ratio_vs_mean_unconstrained": runs["json_schema"]["output_tok_s"] / (
            (runs["unconstrained_before"]["output_tok_s"] + runs["unconstrained_after"]["output_tok_s"]) / 2),
        "mask_fill_ms_per_step": clock.fill_s / steps * 1e3,
        "mask_pack_ms_per_step": clock.pack_s / steps * 1e3,
        "mask_apply_ms_per_step": clock.apply_s / steps * 1e3,
        "accept_ms_per_step": clock.accept_s / steps * 1e3,
        "mask_share_of_constrained_wall": clock.total_s / runs["json_schema"]["wall_s"],
        "num_masked_steps": clock.num_steps,
        "mean_masked_rows": clock.num_rows / steps,
        "num_outputs_starting_as_json": num_valid_prefixes,
        **compile_times,
        "env": report.environment(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=2))
    if args.json:
        report.write_json(args.json, result)
    return 0
