"""KV cache size from ``gpu_memory_utilization``, the way vLLM sizes its cache.

vLLM gives the engine a share of the device's memory and fills what the
weights and activations leave of it with KV blocks. Here that is

    kv_bytes = utilization * memory_for_engine - used_by_engine - activation_reserve

where, on CUDA, ``memory_for_engine`` is the device's total memory and
``used_by_engine`` what this process's allocator holds (the weights, once
loaded); on the CPU, ``memory_for_engine`` is the RAM not used by other
processes (available RAM plus this process's resident set) and
``used_by_engine`` this process's resident set (weights and runtime).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedllm.errors import ConfigError

GIB = 2**30
_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class MemorySnapshot:
    """Bytes measured once the weights are loaded, before the KV cache exists."""

    memory_for_engine: int  # what the utilization is a share of
    used_by_engine: int  # weights and runtime already held by this process
    free: int  # what can still be allocated


def activation_reserve_bytes(
    *, num_batched_tokens: int, max_num_seqs: int, hidden_size: int, intermediate_size: int, vocab_size: int
) -> int:
    """A bound on one step's activations: a few hidden-sized and MLP-sized rows per
    scheduled token (float32 on the CPU, the widest case) plus fp32 logits per sequence."""
    per_token = (4 * hidden_size + 3 * intermediate_size) * _FLOAT32_BYTES
    return num_batched_tokens * per_token + max_num_seqs * vocab_size * _FLOAT32_BYTES


def measure(device: torch.device) -> MemorySnapshot:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemorySnapshot(total, torch.cuda.memory_reserved(device), free)
    available, resident = _available_host_memory(), _resident_set_bytes()
    return MemorySnapshot(available + resident, resident, available)


def kv_bytes_for_utilization(utilization: float, snapshot: MemorySnapshot, activation_reserve: int) -> int:
    """The KV budget; ConfigError when the share leaves nothing or more than can be allocated."""
    wanted = int(utilization * snapshot.memory_for_engine)
    kv_bytes = wanted - snapshot.used_by_engine - activation_reserve
    if kv_bytes <= 0:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} gives the engine {wanted / GIB:.2f} GiB, but the weights "
            f"and runtime already take {snapshot.used_by_engine / GIB:.2f} GiB and one step's activations "
            f"about {activation_reserve / GIB:.2f} GiB; raise gpu_memory_utilization or set kv_cache_memory_bytes"
        )
    if kv_bytes > snapshot.free - activation_reserve:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} asks for {kv_bytes / GIB:.2f} GiB of KV cache but only "
            f"{snapshot.free / GIB:.2f} GiB is free (other processes hold the rest); lower "
            "gpu_memory_utilization or set kv_cache_memory_bytes"
        )
    return kv_bytes


def _available_host_memory() -> int:
    """MemAvailable from /proc/meminfo (Linux); free physical pages elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _resident_set_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
