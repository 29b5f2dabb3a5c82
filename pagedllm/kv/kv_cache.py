"""The KV cache tensors: one K and one V pool per layer (plus their scales when
the cache is quantized), and an optional CPU swap pool of the same layout.

The block manager decides which physical blocks hold what; this class only
moves bytes when told to (copy-on-write copies, swap out, swap in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedllm.kv import kv_format
from pagedllm.native import host_memory

KV_LAYOUTS = ("token", "head")
# The "head" layout's storage of keys / values, as an order of the dims of [N, B, KH, D]:
# keys [N, KH, D, B], values [N, KH, B, D] (the native kernels' KV_LAYOUT_HEAD).
_HEAD_ORDER = {False: (0, 2, 3, 1), True: (0, 2, 1, 3)}


def head_storage_shape(shape: tuple[int, ...], values: bool) -> tuple[int, ...]:
    """The shape a "head" layout pool of logical ``shape`` [N, B, KH, D] is allocated in."""
    return tuple(shape[i] for i in _HEAD_ORDER[values])


def head_view(storage: torch.Tensor, values: bool) -> torch.Tensor:
    """A "head" layout pool as allocated -> its [N, B, KH, D] view."""
    order = _HEAD_ORDER[values]
    return storage.permute(*sorted(range(4), key=order.__getitem__))


def in_layout(cache: torch.Tensor, layout: str, values: bool) -> torch.Tensor:
    """A copy of the pool ``cache`` [N, B, KH, D] stored in ``layout`` (the same values)."""
    if layout == "token":
        return cache.clone(memory_format=torch.contiguous_format)
    out = head_view(torch.empty(head_storage_shape(tuple(cache.shape), values), dtype=cache.dtype,
                                device=cache.device), values)
    kv_format.as_bytes(out).copy_(kv_format.as_bytes(cache))
    return out


class KVCache:
    """Owns the per-layer K/V tensors; the runner applies the block manager's instructions through it.

    ``layers[i]`` is ``(k_cache, v_cache)``, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` on ``device`` in
    ``dtype``. When ``dtype`` is an 8-bit KV format's storage dtype
    (:mod:`pagedllm.kv.kv_format`: int8, float8_e4m3fn, float8_e5m2) the
    layer is ``(k_cache, v_cache, k_scale, v_scale)``, the scales
    ``[num_blocks, block_size, num_kv_heads]`` float16.
    ``cpu_layers[i]`` has the same layout with ``num_cpu_blocks`` blocks on the
    host (pinned when the device is CUDA), and is empty when that count is 0.
    ``prefault``: zero-fill the CPU pools now, so that every page is resident
    from the start (see the comment in ``__init__``).
    ``layout``: where a block's elements lie in memory. ``"token"``: K and V
    are contiguous (a slot's heads side by side). ``"head"`` (the native CPU
    kernels' KV_LAYOUT_HEAD): K and V are permuted views of
    ``[num_blocks, num_kv_heads, head_dim, block_size]`` and
    ``[num_blocks, num_kv_heads, block_size, head_dim]``, so each head's part of
    a block is contiguous and its keys are stored dims by tokens. Either way
    the tensors index as above, so torch code reads both; the scales stay
    contiguous.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_cpu_blocks: int = 0,
        prefault: bool = False,
        layout: str = "token",
    ) -> None:
        if layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV cache layout {layout!r}; one of {KV_LAYOUTS}")
        self.device = torch.device(device)
        self.layout = layout
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # On the CPU the pools are left uninitialised unless ``prefault``: the
        # CPU attention paths only ever read slots below a sequence's length,
        # which were written first, and zero-filling gigabytes takes a moment
        # at start-up. The OS then gives the pools memory page by page as
        # blocks are first written, so the resident size climbs by the whole
        # pool over the first minutes of serving (the free queue hands out
        # every block before it reuses one). ``prefault`` zero-fills them
        # instead: the pools are resident from the start, and a machine that
        # cannot hold them fails at start-up, not under load.
        # GPU kernels may load whole blocks and mask afterwards, so device
        # pools start zeroed (cheap there).
        # On the host the pools of every layer are carved from one buffer, and a
        # prefaulted one is placed on 2 MiB pages (pagedllm/native/host_memory.py):
        # decode attention reads scattered blocks, which on 4 KiB pages mostly
        # begin with a page walk. Not without ``prefault``: a huge page first
        # touched in the middle of a step is zeroed (and, in a VM, mapped by the
        # host) there, which cost more than the page walks saved (a W64 run spent
        # 6 s of system time against 2).
        zero = prefault or self.device.type != "cpu"
        self.quantized = kv_format.is_quantized(dtype)
        self.layers = self._pools(shape, num_layers, zero=zero, device=self.device)
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = self.device.type == "cuda"
        # Swapped-in blocks replace whole device blocks, so the pool follows the device's rule.
        self.cpu_layers = self._pools(cpu_shape, num_layers if num_cpu_blocks else 0, zero=zero,
                                      device=torch.device("cpu"), pin_memory=pin)

    def _specs(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One layer's tensors: (k, v), or (k, v, k_scale, v_scale) for a quantized cache."""
        specs = [(shape, self.dtype), (shape, self.dtype)]
        if self.quantized:
            scale_shape = shape[:-1]  # one scale per slot and KV head
            specs += [(scale_shape, kv_format.SCALE_DTYPE), (scale_shape, kv_format.SCALE_DTYPE)]
        return specs

    def _pools(self, shape: tuple[int, ...], num_layers: int, *, zero: bool, device: torch.device,
               pin_memory: bool = False) -> list[tuple[torch.Tensor, ...]]:
        specs = self._storage_specs(shape)
        if device.type == "cpu" and not pin_memory:
            flat = host_memory.host_tensors(specs * num_layers, zero=zero, huge=zero)
        else:
            allocate = torch.zeros if zero else torch.empty
            flat = [allocate(s, dtype=d, device=device, pin_memory=pin_memory)
                    for _ in range(num_layers) for s, d in specs]
        n = len(specs)
        return [self._as_logical(tuple(flat[i * n:(i + 1) * n])) for i in range(num_layers)]

    def _storage_specs(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shapes the pools are allocated in: :meth:`_specs`, with K and V in the layout's order."""
        specs = self._specs(shape)
        if self.layout == "head":
            specs[0] = (head_storage_shape(shape, values=False), specs[0][1])
            specs[1] = (head_storage_shape(shape, values=True), specs[1][1])
        return specs

    def _as_logical(self, layer: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A layer's tensors as allocated -> ``[num_blocks, block_size, num_kv_heads, head_dim]`` views."""
        if self.layout == "token":
            return layer
        k, v, *scales = layer
        return (head_view(k, values=False), head_view(v, values=True), *scales)

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one physical block takes across all layers, K and V together (their scales
        included when ``dtype`` is a quantized format: 2 bytes per slot, head and K or V)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        per_head = head_dim * element_size
        if kv_format.is_quantized(dtype):
            per_head += torch.empty((), dtype=kv_format.SCALE_DTYPE).element_size()
        return 2 * num_layers * block_size * num_kv_heads * per_head

    @staticmethod
    def num_blocks_for_memory(memory_bytes: int, **block_kwargs: Any) -> int:
        """How many whole blocks fit in ``memory_bytes`` (never negative)."""
        per_block = KVCache.bytes_per_block(**block_kwargs)
        return max(0, int(memory_bytes) // per_block)

    def block_tensors(self) -> list[torch.Tensor]:
        """Every device tensor that holds per-block KV state, each indexed by physical block on dim 0.

        Each layer's K and V cache, and for a quantized cache its K and V
        scales after them; block copies, swaps and any backing store move a
        block by moving slice ``[block_id]`` of every tensor in this list, in
        this order.
        """
        return [t for layer in self.layers for t in layer]

    def cpu_block_tensors(self) -> list[torch.Tensor]:
        """The CPU swap pool's tensors, parallel to :meth:`block_tensors` (empty without a pool)."""
        return [t for layer in self.cpu_layers for t in layer]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy every slot of block ``src`` into block ``dst`` in every layer, per ``(src, dst)`` pair.

        Sources are read before any destination is written (one gather and one
        scatter per tensor), so a block may be both a source and a destination.
        """
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)
        for tensor in self.block_tensors():
            tensor = kv_format.as_bytes(tensor)  # CPU float8 has no index_copy_
            tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks into CPU pool blocks: ``(device_block, cpu_block)`` pairs."""
        if not mapping:
            return
        self._require_cpu_pool()
        dev_idx = torch.tensor([d for d, _ in mapping], dtype=torch.int64, device=self.device)
        cpu_idx = torch.tensor([c for _, c in mapping], dtype=torch.int64)
        for dev, cpu in zip(self.block_tensors(), self.cpu_block_tensors(), strict=True):
            dev, cpu = kv_format.as_bytes(dev), kv_format.as_bytes(cpu)
            cpu.index_copy_(0, cpu_idx, dev.index_select(0, dev_idx).cpu())

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy CPU pool blocks back to device blocks: ``(cpu_block, device_block)`` pairs."""
        if not mapping:
            return
        self._require_cpu_pool()
        cpu_idx = torch.tensor([c for c, _ in mapping], dtype=torch.int64)
        dev_idx = torch.tensor([d for _, d in mapping], dtype=torch.int64, device=self.device)
        for dev, cpu in zip(self.block_tensors(), self.cpu_block_tensors(), strict=True):
            dev, cpu = kv_format.as_bytes(dev), kv_format.as_bytes(cpu)
            dev.index_copy_(0, dev_idx, cpu.index_select(0, cpu_idx).to(self.device))

    def _require_cpu_pool(self) -> None:
        if not self.cpu_layers:
            raise RuntimeError("swap requested but the KV cache was built with num_cpu_blocks=0")
