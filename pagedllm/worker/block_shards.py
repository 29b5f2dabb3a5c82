"""Whole KV blocks from the tensor-parallel ranks' shards, and back: the disk tier under TP.

Under tensor parallelism each rank holds its KV heads' part of every block
(:func:`pagedllm.distributed.head_shard`). The disk tier keeps one file per
block with every KV head, as a single process would write it: rank 0 owns
the tier (its index, files, writer and reader threads), gathers the other
ranks' parts of a block it saves, and scatters the parts of a block it
loads. So a block is on disk whole or not at all, a corrupt file is a miss
for every rank alike, and no rank can serve a prefix the others lack.

Every rank runs the same memory operations in the same order (they come in
the step rank 0 broadcasts), so the gathers and scatters pair up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedllm.distributed import HeadShard, TensorParallelGroup, head_shard
from pagedllm.kv.kv_format import as_bytes
from pagedllm.kv.tiers import BlockLayout, layout_nbytes, pack_block, tensors_from_raw

KV_HEAD_DIM = 1  # slice [block] of every block tensor is [block_size, KV heads, ...]


class BlockShards:
    """Assembles and splits whole blocks for one rank of a tensor-parallel group."""

    def __init__(self, tp: TensorParallelGroup, local_layout: BlockLayout, num_heads: int, num_kv_heads: int) -> None:
        self.tp = tp
        self.num_kv_heads = num_kv_heads
        self.shards: list[HeadShard] = [head_shard(num_heads, num_kv_heads, tp.size, r) for r in range(tp.size)]
        mine = self.shards[tp.rank].num_kv
        for shape, _ in local_layout:
            if shape[KV_HEAD_DIM] != mine:
                raise ValueError(f"block slice {shape} does not hold this rank's {mine} KV heads")
        self.local_layout = local_layout
        self.layouts = [self._with_heads(local_layout, s.num_kv) for s in self.shards]  # per rank
        self.full_layout = self._with_heads(local_layout, num_kv_heads)
        self._sizes = [layout_nbytes(layout) for layout in self.layouts]

    @staticmethod
    def _with_heads(layout: BlockLayout, heads: int) -> BlockLayout:
        return [((*shape[:KV_HEAD_DIM], heads, *shape[KV_HEAD_DIM + 1 :]), dtype) for shape, dtype in layout]

    def gather(self, raws: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """This rank's parts of some blocks (raw blocks in the local layout) ->
        the whole raw blocks on rank 0 (full layout), None on the others."""
        num = len(raws)
        buffer = self._padded(torch.cat(raws) if raws else torch.empty(0, dtype=torch.uint8), num)
        parts = [torch.empty_like(buffer) for _ in range(self.tp.size)] if self.tp.is_first else None
        dist.gather(buffer, parts, dst=0, group=self.tp.group)
        if not self.tp.is_first:
            return None
        whole = [[torch.empty(shape, dtype=dtype) for shape, dtype in self.full_layout] for _ in range(num)]
        for rank, part in enumerate(parts):
            shard = self.shards[rank]
            heads = slice(shard.kv_start, shard.kv_start + shard.num_kv)
            for block, slices in zip(whole, _unpack(part, self.layouts[rank], num), strict=True):
                for target, piece in zip(block, slices, strict=True):
                    as_bytes(target)[:, heads] = as_bytes(piece)  # a replicated head is written once per rank holding it: same bytes
        return [pack_block(block) for block in whole]

    def scatter(self, raws: list[torch.Tensor] | None, num: int) -> list[torch.Tensor]:
        """Whole raw blocks on rank 0 (``raws``; None on the others) -> this rank's parts, raw blocks."""
        buffer = torch.empty(max(self._sizes) * num, dtype=torch.uint8)
        parts = None
        if self.tp.is_first:
            parts = []
            blocks = [tensors_from_raw(raw, self.full_layout) for raw in raws]
            for shard in self.shards:
                heads = slice(shard.kv_start, shard.kv_start + shard.num_kv)
                parts.append(self._padded(_pack([[as_bytes(t)[:, heads] for t in block] for block in blocks]), num))
        dist.scatter(buffer, parts, src=0, group=self.tp.group)
        size = self._sizes[self.tp.rank]
        return [buffer[i * size : (i + 1) * size] for i in range(num)]

    def _padded(self, packed: torch.Tensor, num: int) -> torch.Tensor:
        size = max(self._sizes) * num  # equal sizes for the collective
        if packed.numel() == size:
            return packed
        out = torch.zeros(size, dtype=torch.uint8)
        out[: packed.numel()] = packed
        return out


def _pack(blocks: list[list[torch.Tensor]]) -> torch.Tensor:
    """Every slice's bytes, block after block, in layout order: one flat uint8 tensor."""
    return torch.cat([pack_block(block) for block in blocks]) if blocks else torch.empty(0, dtype=torch.uint8)


def _unpack(buffer: torch.Tensor, layout: BlockLayout, num: int) -> list[list[torch.Tensor]]:
    """Views of ``num`` packed blocks' slices in ``buffer`` (uint8), block after block."""
    size = layout_nbytes(layout)
    return [tensors_from_raw(buffer[i * size : (i + 1) * size], layout) for i in range(num)]
