"""Where a batch-1 decode step's host time goes: each engine, worker, model and kernel-wrapper
function on the step's path timed with perf_counter in place (one process, the default model in
float32, one request of 128 prompt tokens decoding 256 tokens, 4 requests timed after a warm-up).

    python benchmarks/step_phases.py   # microseconds per token of each, and OVERHEAD: the step
                                       # less the native layer stack and the LM head

For A/Bs alternate processes (PYTHONPATH of a worktree against this checkout): the VM's memory
latency moves every figure, the interpreter's most (its code and data come back from DRAM after
each token's weight stream).
"""

from __future__ import annotations

import collections
import functools
import gc
import time

import pagedllm.attention.torch_backend as torch_backend
import pagedllm.engine.llm_engine as llm_engine
import pagedllm.engine.output_processor as output_processor
import pagedllm.engine.scheduler as scheduler
import pagedllm.engine.step_builder as step_builder
import pagedllm.native.cpu_ops as cpu_ops
import pagedllm.quant.stack as stack
import pagedllm.sampling.sampler as sampler
import pagedllm.worker.input_batch as input_batch
import pagedllm.worker.worker as worker
from pagedllm import LLM, SamplingParams

TOKENS = 4 * 256
total: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(owner, name: str, label: str | None = None) -> None:
    function = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', '')}.{name}"

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            total[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, wrapper)


def timed_module(module, label: str) -> None:
    def before(_module, _args):
        total[label + " start"] = time.perf_counter()

    def after(_module, _args, _out):
        total[label] += time.perf_counter() - total[label + " start"]
        calls[label] += 1

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def main() -> None:
    for owner, name in [
        (worker, "build_model_inputs"), (worker, "apply_memory_ops"), (worker, "_select_rows"),
        (worker, "_grammar_mask"), (worker.Worker, "_sample_on_host"), (worker.Worker, "execute"),
        (worker.Worker, "_forward"), (worker.Worker, "_jobs"), (worker.Worker, "_sampling_rows"),
        (stack.LayerStack, "run"), (stack.LayerStack, "_bind_caches"), (stack.LayerStack, "_grow_scratch"),
        (stack, "check_positions"), (torch_backend.TorchAttentionBackend, "native_work"),
        (cpu_ops, "make_tiles"), (llm_engine.LLMEngine, "step"), (llm_engine.LLMEngine, "_outputs"),
        (scheduler.Scheduler, "schedule"), (scheduler.Scheduler, "on_step_computed"),
        (output_processor.OutputProcessor, "process"), (step_builder.StepBuilder, "build"),
        (input_batch.InputBatch, "update"), (input_batch.InputBatch, "chunks"), (sampler.Sampler, "__call__"),
    ]:
        timed(owner, name)
    llm = LLM(dtype="float32")
    model = next(o for o in gc.get_objects() if type(o).__name__ == "LlamaForCausalLM")
    timed(model.layer_stack, "_run", "stack._run (native)")
    for module, label in [(model.embed_tokens, "embed"), (model.lm_head, "lm_head"), (model.norm, "norm"),
                          (model, "model")]:
        timed_module(module, label)
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    total.clear()
    calls.clear()
    start = time.perf_counter()
    for _ in range(TOKENS // 256):
        llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(f"wall per token us {elapsed / TOKENS * 1e6:.1f}")
    overhead = total["LLMEngine.step"] - total["stack._run (native)"] - total["lm_head"]
    print(f"OVERHEAD {overhead / TOKENS * 1e6:.1f} us/token")
    for label in sorted(calls, key=lambda k: -total[k]):
        print(f"{label:45s} {total[label] / TOKENS * 1e6:8.1f} us/token x{calls[label]}")


if __name__ == "__main__":
    main()
