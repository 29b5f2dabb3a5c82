"""The native attention kernel on long-context prefill chunks and a W64-like decode step.

    python benchmarks/attention_chunks.py --contexts 8192,32768

Per context C: the last 2,048-token chunk of a C-token prompt (SmolLM2-135M's
shape: 9 query / 3 KV heads, head_dim 64, float32, 16-token blocks), one
layer, causal; the figure is GFLOP/s (4 x head_dim flops per query head per
visible key). Decode: 64 sequences of context 340, one token each, 30
layers, ms per layer. A 2048 x 2048 float32 matmul's rate is printed beside
them. Best of a few runs each; run it once per checkout to compare two
versions of the kernel (``PYTHONPATH=checkout python ...``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from attention_kernel import BLOCK, HEAD_DIM, HEADS, KV_HEADS, best_of, matmul_gflops, run_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attention_reference import make_paged_batch  # noqa: E402

from pagedllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagedllm.native import cpu_ops  # noqa: E402

CHUNK = 2048


def native(batch):
    """The native kernel's call on ``batch``, its new K/V written first, run once (warm)."""
    md = batch.metadata
    TorchAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    call = run_kernel(batch, use_native=True)
    call()
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    assert cpu_ops.available(), "the native kernels did not build"
    out = {"kernel_source": str(Path(cpu_ops.__file__).parent), "isa": cpu_ops.requested_isa(),
           "matmul_gflops_fp32": matmul_gflops(torch.float32, 5)}
    for context in (int(c) for c in args.contexts.split(",")):
        batch = make_paged_batch([(context - CHUNK, CHUNK)], block_size=BLOCK, num_heads=HEADS,
                                 num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32, seed=1)
        seconds = best_of(native(batch), args.repeats)
        flops = 4 * HEAD_DIM * HEADS * (CHUNK * (context - CHUNK) + CHUNK * (CHUNK + 1) / 2)
        out[f"prefill_chunk_{context}_ms"] = seconds * 1e3
        out[f"prefill_chunk_{context}_gflops"] = flops / seconds / 1e9
        del batch
    calls = [native(make_paged_batch([(339, 1)] * 64, block_size=BLOCK, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                     head_dim=HEAD_DIM, dtype=torch.float32, seed=layer)) for layer in range(30)]

    def all_layers():
        for call in calls:
            call()

    out["decode_64x340_ms_per_layer"] = best_of(all_layers, 5) / len(calls) * 1e3
    print(json.dumps(out))


if __name__ == "__main__":
    main()
