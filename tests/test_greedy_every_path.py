"""Greedy output equals HF transformers' on every native kernel path this CPU runs (fp32).

Each path of :data:`pagedllm.native.cpu_ops.ISA_PATHS` that the CPU can run (scalar, avx2,
avx512, avx512_bf16) is forced in a fresh process the way a user forces it
(``PAGEDLLM_CPU_ISA``, with the packed matmuls' matching path: ``cpu_ops.isa_environment``),
which runs the default model, dense float32, with its native attention, norms, rotary and
KV writes on that path, through a real ``LLM``; its tokens must be HF's greedy tokens, and
the process must report the path it was asked for. The packed default (``gguf``) on each path
is checked against the dequantized weights' logits elsewhere (tests/test_quant_*.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.native import cpu_ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the native kernels"),
]

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
MAX_NEW = 16

CHILD = """
import json, sys
from pagedllm import LLM, SamplingParams
from pagedllm.native import cpu_ops
prompts, max_new = json.loads(sys.argv[1])
llm = LLM(dtype="float32", quantization="none", kv_cache_memory=64 * 2**20, max_model_len=256)
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=False)
tokenizer = llm.get_tokenizer()
print(json.dumps({
    "isa": cpu_ops.selected_isa(),
    "vectorized": cpu_ops.vectorized(),
    "prompt_ids": [tokenizer.encode(p) for p in prompts],
    "tokens": [o.outputs[0].token_ids for o in outs],
}))
"""


@pytest.mark.parametrize("isa", cpu_ops.cpu_isa_paths() if cpu_ops.available() else [])
def test_greedy_output_equals_hf_on_the_forced_path(isa, hf_reference):
    env = {**os.environ, **cpu_ops.isa_environment(isa)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([PROMPTS, MAX_NEW])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["isa"] == isa and result["vectorized"] == (isa != "scalar")
    for prompt_ids, tokens in zip(result["prompt_ids"], result["tokens"], strict=True):
        assert len(tokens) == MAX_NEW or tokens[-1] == hf_reference.eos_token_id
        assert tokens == hf_reference.greedy(tuple(prompt_ids), MAX_NEW), (isa, prompt_ids)
