"""Resident memory of the default model with dense weights, after load and after one request.

    python benchmarks/dense_weight_rss.py float32|bfloat16

Prints one JSON line: the process's resident size (VmRSS) after ``LLM()``
and after a 16-token greedy request, its peak, ``weight_bytes`` of the
loaded model (parameters plus oneDNN's packed copies plus quantized
matrices) and the text. Run it once per checkout, from outside the
checkouts (PYTHONPATH=checkout), to compare two versions.
"""

from __future__ import annotations

import json
import resource
import sys

import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm.quant.bench import weight_bytes


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    llm = LLM(dtype=dtype, num_kv_blocks=64)
    after_load = rss_mib()
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    print(json.dumps({
        "pagedllm": pagedllm.__file__, "dtype": dtype,
        "rss_after_load_mib": round(after_load), "rss_after_generate_mib": round(rss_mib()),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "weight_mb": round(weight_bytes(llm.llm_engine.worker.model) / 1e6, 1),
        "text": out[0].outputs[0].text,
    }))


if __name__ == "__main__":
    main()
