"""Tensor-parallel groups: which rank this process is, and the collectives the model needs.

A :class:`TensorParallelGroup` of size 1 is the single-process case: every
collective is the identity and no process group exists. Larger groups wrap a
``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) that every
rank joined with the same ``init_method``.

Shards are contiguous and as even as possible: of ``n`` items, rank ``r`` of
``size`` holds ``[n * r // size, n * (r + 1) // size)`` (sizes differ by at
most one), so uneven counts such as SmolLM2's 3 KV heads over 2 ranks work.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from pagedllm.errors import ConfigError


def shard_range(num_items: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous share of ``num_items``."""
    return num_items * rank // size, num_items * (rank + 1) // size


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: query heads ``[q_start, q_start + num_q)``
    and KV heads ``[kv_start, kv_start + num_kv)`` (global indices).

    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``, so each
    rank's query heads map onto its KV heads with the model's group size.
    """

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Split whole KV groups across ranks; past the KV head count, replicate KV heads.

    With ``size <= num_kv_heads`` each rank takes a contiguous run of KV heads
    and all their query heads. With more ranks, ``size`` must be a multiple of
    ``num_kv_heads``: each KV head is replicated on ``size // num_kv_heads``
    ranks, which split its query heads.
    """
    group = num_heads // num_kv_heads
    if size <= num_kv_heads:
        kv_start, kv_end = shard_range(num_kv_heads, size, rank)
        return HeadShard(kv_start * group, (kv_end - kv_start) * group, kv_start, kv_end - kv_start)
    replicas = size // num_kv_heads
    if size % num_kv_heads or group % replicas:
        raise ConfigError(
            f"tensor_parallel_size={size} cannot split {num_heads} query heads over {num_kv_heads} KV "
            f"heads; use a size <= {num_kv_heads} or a multiple of it that divides the heads evenly"
        )
    kv = rank // replicas
    per_rank = group // replicas
    return HeadShard(kv * group + (rank % replicas) * per_rank, per_rank, kv, 1)


@dataclass
class TensorParallelGroup:
    """This process's place in a tensor-parallel group, and the model's collectives.

    ``group`` is the process group for the model's all-reduces and gathers
    (NCCL on CUDA, gloo on CPU); ``control_group`` is a gloo group for the
    step messages rank 0 broadcasts. Both are None when ``size == 1``.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None
    control_group: object | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, num_items: int) -> tuple[int, int]:
        return shard_range(num_items, self.size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place; the identity for one rank."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor, num_columns: int) -> torch.Tensor:
        """``[rows, local]`` shards -> ``[rows, num_columns]``, concatenated in rank order.

        Shards may differ in width by one (see :func:`shard_range`): each is
        padded to the widest for the collective and trimmed after.
        """
        if self.size == 1:
            return x
        width = -(-num_columns // self.size)
        padded = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        torch.distributed.all_gather(parts, padded.contiguous(), group=self.group)
        pieces = []
        for rank, part in enumerate(parts):
            start, end = shard_range(num_columns, self.size, rank)
            pieces.append(part[:, : end - start])
        return torch.cat(pieces, dim=1)


SINGLE_PROCESS = TensorParallelGroup()
STARTUP_TIMEOUT_S = 300.0


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float
) -> TensorParallelGroup:
    """Join the default process group (NCCL on CUDA, gloo on CPU; its collectives fail after
    ``timeout_s``) plus a gloo group for the step messages."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    # Joining waits for every rank's process to start (imports, on a busy machine: minutes).
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)),
    )
    model_group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    # Ranks other than 0 wait here between steps for as long as the engine idles.
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
    return TensorParallelGroup(rank=rank, size=size, group=model_group, control_group=control)
