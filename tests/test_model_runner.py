"""The worker carries out the scheduler's memory operations in the order they were decided."""

from __future__ import annotations

import torch

from pagedllm.engine.scheduler import MemoryOpKind, SchedulerOutput
from pagedllm.kv.kv_cache import KVCache
from pagedllm.worker.worker import apply_memory_ops


def test_swap_in_then_out_of_the_same_block_keeps_the_data():
    cache = KVCache(num_layers=2, num_blocks=4, block_size=8, num_kv_heads=1, head_dim=4,
                    dtype=torch.float32, device="cpu", num_cpu_blocks=4)
    for k, v in cache.cpu_layers:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    saved = [k[0].clone() for k, _ in cache.cpu_layers]
    out = SchedulerOutput()
    out.add_memory_op(MemoryOpKind.SWAP_IN, [(0, 2)])  # cpu 0 -> device 2
    out.add_memory_op(MemoryOpKind.COPY, [(2, 3)])  # device 2 -> device 3
    out.add_memory_op(MemoryOpKind.SWAP_OUT, [(2, 1)])  # device 2 -> cpu 1
    apply_memory_ops(cache, out.memory_ops)
    for (k_dev, _), (k_cpu, _), want in zip(cache.layers, cache.cpu_layers, saved):
        assert torch.equal(k_dev[2], want) and torch.equal(k_dev[3], want)
        assert torch.equal(k_cpu[1], want)
