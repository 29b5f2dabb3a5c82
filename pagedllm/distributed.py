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
import functools
import math
import os
import platform
import time
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from pagedllm.errors import ConfigError


def shard_range(num_items: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous share of ``num_items``."""
    return num_items * rank // size, num_items * (rank + 1) // size


def balanced_range(num_items: int, item_cost: float, fixed_costs: list[float], rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous share of ``num_items`` that evens out each
    rank's total work: ``fixed_costs[r]`` (work the rank has anyway) plus ``item_cost`` per item.

    A rank whose fixed work already exceeds the average gets fewer items (none
    at worst). Equal fixed costs give an even split, as :func:`shard_range`
    does up to rounding.
    """
    size = len(fixed_costs)
    average = (sum(fixed_costs) + num_items * item_cost) / size

    def boundary(r: int) -> int:  # items held by ranks before r
        if r == size:
            return num_items
        wanted = sum(max(average - cost, 0.0) for cost in fixed_costs[:r]) / item_cost
        return min(num_items, round(wanted))

    return boundary(rank), max(boundary(rank), boundary(rank + 1))


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: query heads ``[q_start, q_start + num_q)``
    and KV heads ``[kv_start, kv_start + num_kv)`` (global indices).

    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``, so each
    rank's query heads map onto its KV heads with the model's group size.

    ``rows``: per local KV head, the share ``(lo, hi)`` of each step's query rows
    (as fractions of the step's attention work, see :func:`split_row`) this
    rank computes that head's attention for; ``(0, 1)`` for a head it owns alone.
    A KV head that straddles two ranks is held (weights, K/V) by both, and each
    computes its attention for part of the rows. Empty: every local head whole.
    """

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int
    rows: tuple[tuple[Fraction, Fraction], ...] = ()

    @property
    def splits_rows(self) -> bool:
        return any(share != (0, 1) for share in self.rows)

    def query_head_work(self, group: int) -> float:
        """Query heads' worth of attention this rank computes per step (shared heads in part)."""
        if not self.rows:
            return float(self.num_q)
        return float(sum((hi - lo) * group for lo, hi in self.rows))


SHARED_HEADS_ENV = "PAGEDLLM_TP_SHARED_HEADS"  # "1" (the default) or "0": whole KV heads per rank


def shares_heads(num_kv_heads: int, size: int) -> bool:
    """Whether ranks split a KV head's rows (:func:`head_shard`): fewer ranks than KV heads, not
    dividing them, unless ``PAGEDLLM_TP_SHARED_HEADS=0`` asks for whole heads per rank."""
    choice = os.environ.get(SHARED_HEADS_ENV, "1")
    if choice not in ("0", "1"):
        raise ConfigError(f"{SHARED_HEADS_ENV}={choice!r}: 1 (split a straddling KV head's rows) or 0")
    return choice == "1" and 1 < size < num_kv_heads and num_kv_heads % size != 0


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Split the KV groups across ranks; past the KV head count, replicate KV heads.

    With ``size <= num_kv_heads`` each rank takes a contiguous run of KV heads
    and all their query heads. Where ``size`` does not divide the KV heads
    (SmolLM2's 3 over 2 ranks), whole heads would leave the ranks' attention
    uneven (1 | 2 heads), and every rank waits for the slowest at each layer's
    sync points. Instead rank ``r`` takes the span ``[r, r + 1) * num_kv_heads /
    size`` of heads: a head cut by a boundary is held by both neighbours, which
    split its query rows by work (``rows``), so each rank computes the same
    attention (1.5 heads each). ``PAGEDLLM_TP_SHARED_HEADS=0`` keeps whole heads.

    With more ranks, ``size`` must be a multiple of ``num_kv_heads``: each KV head
    is replicated on ``size // num_kv_heads`` ranks, which split its query heads.
    """
    group = num_heads // num_kv_heads
    if shares_heads(num_kv_heads, size):
        lo, hi = Fraction(rank * num_kv_heads, size), Fraction((rank + 1) * num_kv_heads, size)
        kv_start, kv_end = math.floor(lo), math.ceil(hi)
        rows = tuple((max(lo - h, Fraction(0)), min(hi - h, Fraction(1))) for h in range(kv_start, kv_end))
        return HeadShard(kv_start * group, (kv_end - kv_start) * group, kv_start, kv_end - kv_start, rows)
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


def split_row(seq_lens: list[int], query_lens: list[int], fraction: Fraction) -> int:
    """The query row that splits a step's attention work at ``fraction`` (0 -> 0, 1 -> all rows).

    Row ``j`` of a sequence whose first new token sees ``f`` keys sees ``f + j``;
    a row's work is its keys plus a block's worth of fixed cost (as the kernel's
    thread split weighs it). Every rank computes the same split from the step's
    lengths, so the ranks agree on who computes which rows of a shared head.
    """
    if fraction <= 0:
        return 0
    total_rows = sum(query_lens)
    if fraction >= 1:
        return total_rows
    fixed = 16

    def work(first: int, count: int) -> int:  # rows first .. first + count - 1 (keys seen)
        return count * (first + fixed) + count * (count - 1) // 2

    total = sum(work(s - q + 1, q) for s, q in zip(seq_lens, query_lens, strict=True))
    target = fraction * total
    done, row = 0, 0
    for seq_len, q_len in zip(seq_lens, query_lens, strict=True):
        first = seq_len - q_len + 1
        whole = work(first, q_len)
        if done + whole < target:
            done, row = done + whole, row + q_len
            continue
        lo, hi = 0, q_len  # the fewest rows of this sequence that reach the target
        while lo < hi:
            mid = (lo + hi) // 2
            if done + work(first, mid) >= target:
                hi = mid
            else:
                lo = mid + 1
        return row + lo
    return total_rows


@dataclass(frozen=True)
class SharedHeadRows:
    """One step's split of the straddling KV heads' query rows (see :func:`head_shard`).

    ``head_rows``: per local KV head, the rows ``[r0, r1)`` this rank computes;
    ``columns``: ``(c0, c1, r0, r1)`` for each local KV head computed for part of the
    rows, its query heads' columns of this rank's attention output; ``overlaps``: the
    split row at each boundary between ranks whose columns overlap (in column order),
    rows before it from the lower rank. The same on every rank for a step.
    """

    head_rows: tuple[tuple[int, int], ...]
    columns: tuple[tuple[int, int, int, int], ...]
    overlaps: tuple[int, ...]

    def zero_unowned(self, x: torch.Tensor) -> torch.Tensor:
        """Zeros, in place, where ``x`` (this rank's ``[rows, num_q * head_dim]`` attention output)
        holds a shared head's rows another rank computes: the kernel leaves them unset."""
        for c0, c1, r0, r1 in self.columns:
            x[:r0, c0:c1] = 0
            x[r1:, c0:c1] = 0
        return x


def step_head_rows(
    shards: list[HeadShard], rank: int, group: int, head_dim: int, seq_lens: list[int], query_lens: list[int]
) -> SharedHeadRows:
    """:class:`SharedHeadRows` of rank ``rank`` for a step with these lengths (``shards``: every rank's)."""
    row_at = functools.cache(lambda fraction: split_row(seq_lens, query_lens, fraction))  # a boundary's row once
    head_rows = tuple((row_at(lo), row_at(hi)) for lo, hi in shards[rank].rows)
    total = sum(query_lens)
    width = group * head_dim
    columns = tuple((i * width, (i + 1) * width, r0, r1) for i, (r0, r1) in enumerate(head_rows)
                    if (r0, r1) != (0, total))
    overlaps = tuple(row_at(a.rows[-1][1]) for a, b in zip(shards, shards[1:])
                     if a.rows and a.kv_start + a.num_kv > b.kv_start)
    return SharedHeadRows(head_rows, columns, overlaps)


def attention_weight_count(heads: HeadShard, hidden_size: int, head_dim: int) -> int:
    """Weights of a rank's q/k/v and o projections: its share of a layer's attention matmul work."""
    qkv_rows = (heads.num_q + 2 * heads.num_kv) * head_dim
    return qkv_rows * hidden_size + hidden_size * heads.num_q * head_dim


@dataclass
class CollectiveCost:
    """Calls of one kind of collective on one rank, the seconds spent inside them and the
    bytes this rank handed in.

    The seconds include waiting for the slowest rank to arrive, so the rank that
    arrives last shows the transfer cost nearly alone, and the difference between
    ranks is load imbalance.
    """

    num_calls: int = 0
    seconds: float = 0.0
    num_bytes: int = 0
    cpu_seconds: float = 0.0  # of this thread (spinning waits count, sleeping ones do not)

    def add(self, seconds: float, num_bytes: int, cpu_seconds: float = 0.0) -> None:
        self.num_calls += 1
        self.seconds += seconds
        self.num_bytes += num_bytes
        self.cpu_seconds += cpu_seconds


@dataclass
class RankTimes:
    """Where one rank's time went since the last reset (seconds, wall clock).

    ``num_steps`` counts the steps run through ``Worker.execute``;
    ``forward_seconds`` is the whole forward pass including the model's
    collectives (``all_reduce`` and ``logits_gather``); ``sample_seconds`` is
    sampling on rank 0 (zero elsewhere); ``step_message`` is the step broadcast
    (on ranks other than 0 it includes the wait for rank 0 to send it, which is
    rank 0's scheduling and detokenization time).
    """

    rank: int = 0
    num_steps: int = 0
    forward_seconds: float = 0.0
    forward_cpu_seconds: float = 0.0  # the forward pass's thread CPU time: unlike wall time, not
    # inflated when other processes take the core, so it shows the ranks' shares of the work
    sample_seconds: float = 0.0
    all_reduce: CollectiveCost = field(default_factory=CollectiveCost)
    logits_gather: CollectiveCost = field(default_factory=CollectiveCost)
    step_message: CollectiveCost = field(default_factory=CollectiveCost)


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
    times: RankTimes = field(default_factory=RankTimes)
    shared_memory: SharedMemoryAllReduce | None = None  # the CPU all-reduce when the ranks share a host

    def __post_init__(self) -> None:
        self.times.rank = self.rank

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, num_items: int) -> tuple[int, int]:
        return shard_range(num_items, self.size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place; the identity for one rank."""
        if self.size > 1:
            start, start_cpu = time.perf_counter(), time.thread_time()
            if self.shared_memory is not None and self.shared_memory.fits(x):
                self.shared_memory.all_reduce(x)
            else:
                torch.distributed.all_reduce(x, group=self.group)
            self.times.all_reduce.add(
                time.perf_counter() - start, x.numel() * x.element_size(), time.thread_time() - start_cpu
            )
        return x

    def all_gather_columns(
        self, x: torch.Tensor, start: int, num_columns: int, overlaps: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """Every rank's ``[rows, width]`` columns ``[start, start + width)`` of a ``[rows,
        num_columns]`` tensor -> the whole tensor on every rank (the ranks' column ranges tile
        it); ``x`` itself for one rank. Exact: values are moved, never added. Through the
        shared-memory slots where the group has them (each rank writes its own columns and
        reads the others': a third of the bytes of a zero-padded all-reduce); else as that
        all-reduce of zero-padded tensors. Counted with the all-reduces.

        Neighbouring ranks' columns may overlap (a shared KV head's, :class:`SharedHeadRows`):
        ``overlaps`` gives, per overlap in column order, the row from which the higher rank's
        values count (the lower rank's before it). The zero-padded all-reduce needs each rank's
        other rows of those columns zero (:meth:`SharedHeadRows.zero_unowned`)."""
        if self.size == 1:
            return x
        if self.shared_memory is not None and self.shared_memory.fits_columns(x):
            began, began_cpu = time.perf_counter(), time.thread_time()
            out = self.shared_memory.all_gather_columns(x, start, num_columns, overlaps)
            self.times.all_reduce.add(
                time.perf_counter() - began, out.numel() * out.element_size(), time.thread_time() - began_cpu
            )
            return out
        full = x.new_zeros((x.shape[0], num_columns))
        full[:, start : start + x.shape[1]] = x
        return self.all_reduce(full)

    def reset_times(self) -> None:
        self.times = RankTimes(rank=self.rank)

    def gather_columns(self, x: torch.Tensor, num_columns: int) -> torch.Tensor | None:
        """``[rows, local]`` shards -> ``[rows, num_columns]`` on the first rank, concatenated in
        rank order; None on the others (only the first rank samples, so only it receives).

        Shards may differ in width by one (see :func:`shard_range`): each is
        padded to the widest for the collective and trimmed after.
        """
        if self.size == 1:
            return x
        start, start_cpu = time.perf_counter(), time.thread_time()
        width = -(-num_columns // self.size)
        padded = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.is_first else None
        torch.distributed.gather(padded.contiguous(), parts, dst=0, group=self.group)
        gathered = None
        if self.is_first:
            pieces = []
            for rank, part in enumerate(parts):
                first, end = shard_range(num_columns, self.size, rank)
                pieces.append(part[:, : end - first])
            gathered = torch.cat(pieces, dim=1)
        self.times.logits_gather.add(
            time.perf_counter() - start, padded.numel() * padded.element_size(), time.thread_time() - start_cpu
        )
        return gathered


class SharedMemoryAllReduce:
    """All-reduce among ranks on one host through a shared-memory segment (CPU tensors only).

    gloo's all-reduce goes through TCP over loopback and several thread
    hand-offs per call (the caller, gloo's worker thread, its socket loop, on
    every rank); the model needs 61 of them per step, 0.2-6.5 ms each as
    measured on a shared 2-core machine (docs/benchmarks.md, "Tensor
    parallelism on the CPU"). Here each rank copies its tensor into its slot,
    publishes a sequence number, waits (spinning, then yielding its core) until
    every rank published it, and sums all slots in rank order, so every rank
    gets the same bits.

    Layout of the segment: one 64-byte line per rank holding its last
    published sequence number (int64), then two sets (even and odd sequence
    numbers) of ``size`` slots of ``slot_bytes`` each. A rank writes set
    ``s % 2`` for call ``s`` only after every rank published ``s - 1``, i.e.
    finished reading call ``s - 2`` from that set. x86's total store order
    makes the slot's bytes visible before the sequence number written after
    them.
    """

    _LINE = 64

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, timeout_s: float) -> None:
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        header = self._LINE * size
        segment = torch.from_file(path, shared=True, size=header + 2 * size * slot_bytes, dtype=torch.uint8)
        self.sequence = segment[:header].view(torch.int64).numpy()[:: self._LINE // 8]  # [size], a view
        self.slots = segment[header:].view(2, size, slot_bytes)  # [parity, rank, bytes]
        # all_gather_columns: each slot's first line holds the sender's (start, width)
        self.columns = [[self.slots[p, r, : self._LINE].view(torch.int64).numpy() for r in range(size)]
                        for p in range(2)]
        self._data: dict = {}  # (dtype, parity, offset) -> every rank's slot from offset, as 1-D views
        self.count = 0  # calls made

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= self.slot_bytes

    def fits_columns(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.is_contiguous()
                and self._LINE + x.numel() * x.element_size() <= self.slot_bytes)

    def all_gather_columns(
        self, x: torch.Tensor, start: int, num_columns: int, overlaps: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """See :meth:`TensorParallelGroup.all_gather_columns` (every rank calls with the same rows,
        dtype, ``num_columns`` and ``overlaps``; its own ``start`` and width)."""
        self.count += 1
        parity, rows, width = self.count % 2, x.shape[0], x.shape[1]
        data = self._views(x.dtype, parity, self._LINE)
        head = self.columns[parity][self.rank]
        head[0], head[1] = start, width
        data[self.rank][: x.numel()].view(x.shape).copy_(x)
        self.sequence[self.rank] = self.count
        self._wait_for_all(self.count)
        spans = [(start, width) if r == self.rank else tuple(int(v) for v in self.columns[parity][r][:2])
                 for r in range(self.size)]
        order = sorted(range(self.size), key=lambda r: spans[r][0])  # column order

        def mismatch() -> RuntimeError:
            return RuntimeError(f"the ranks' columns {spans} (overlaps split at rows {list(overlaps)}) do not "
                                f"tile the {num_columns} of this gather")

        out = x.new_empty((rows, num_columns))
        at, next_overlap = 0, 0
        for r in order:
            first, w = spans[r]
            part = x if r == self.rank else data[r][: rows * w].view(rows, w)
            if first < at and next_overlap < len(overlaps) and first + w > at:
                # shared with the previous rank: its rows before the split stay
                split = overlaps[next_overlap]
                next_overlap += 1
                out[split:, first:at] = part[split:, : at - first]
                out[:, at : first + w] = part[:, at - first :]
            elif first == at and w >= 0:
                out[:, first : first + w] = part
            else:
                raise mismatch()
            at = first + w
        if at != num_columns or next_overlap != len(overlaps):
            raise mismatch()
        return out

    def _views(self, dtype: torch.dtype, parity: int, offset: int) -> list[torch.Tensor]:
        """Every rank's slot of set ``parity`` from byte ``offset`` as a 1-D ``dtype`` tensor, made once:
        slicing and viewing the segment on every call cost more than a decode step's copies."""
        key = (dtype, parity, offset)
        views = self._data.get(key)
        if views is None:
            usable = (self.slot_bytes - offset) // dtype.itemsize * dtype.itemsize
            views = [self.slots[parity, r, offset : offset + usable].view(dtype) for r in range(self.size)]
            self._data[key] = views
        return views

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place (every rank calls with the same shape and dtype)."""
        self.count += 1
        parts = [v[: x.numel()].view(x.shape) for v in self._views(x.dtype, self.count % 2, 0)]
        parts[self.rank].copy_(x)
        self.sequence[self.rank] = self.count
        self._wait_for_all(self.count)
        if self.size == 2:
            x.add_(parts[1 - self.rank])  # a + b == b + a bit for bit: both ranks agree
        else:
            torch.sum(torch.stack(parts), dim=0, out=x)
        return x

    def _wait_for_all(self, count: int) -> None:
        sequence = self.sequence
        spins = 0
        deadline = None
        while sequence.min() < count:
            spins += 1
            if spins < 200:
                continue  # the peer is usually microseconds away
            # a shared machine: let whoever is runnable have this core; past ~20k checks
            # (milliseconds) the peer is descheduled or busy, so sleep between checks
            os.sched_yield() if spins < 20_000 else time.sleep(50e-6)
            if spins % 1024 == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    late = [r for r in range(self.size) if sequence[r] < count]
                    raise RuntimeError(
                        f"tensor-parallel ranks {late} did not reach all-reduce #{count} within "
                        f"{self.timeout_s:.0f} s (a peer died or hangs)"
                    )


SINGLE_PROCESS = TensorParallelGroup()
STARTUP_TIMEOUT_S = 300.0


ALL_REDUCE_ENV = "PAGEDLLM_TP_ALL_REDUCE"  # "gloo" (the default) or "shm" (CPU, opt-in)


def cpu_all_reduce_choice() -> str:
    """How a CPU group all-reduces the model's activations: through torch.distributed's gloo
    (the default), or through the shared-memory slots of :class:`SharedMemoryAllReduce` (opt-in:
    lower latency between ranks on one host, see docs/benchmarks.md)."""
    choice = os.environ.get(ALL_REDUCE_ENV, "gloo")
    if choice not in ("shm", "gloo"):
        raise ConfigError(f"{ALL_REDUCE_ENV}={choice!r}: choose gloo (the default) or shm (shared memory)")
    return choice


def attach_shared_memory(tp: TensorParallelGroup, slot_bytes: int, timeout_s: float) -> None:
    """Give a CPU group the shared-memory all-reduce for tensors up to ``slot_bytes`` (larger ones
    take gloo). Collective: every rank calls it. Rank 0 creates the segment under /dev/shm and
    removes its name once every rank mapped it, so nothing is left behind however the ranks end."""
    import torch.distributed as dist

    if tp.size == 1 or cpu_all_reduce_choice() == "gloo":
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return  # the slots' visibility before the sequence number relies on x86's store order
    box = [None]
    if tp.is_first:
        box[0] = f"/dev/shm/pagedllm-tp-{os.getpid()}-{os.urandom(4).hex()}"
        with open(box[0], "wb") as segment:
            segment.truncate(64 * tp.size + 2 * tp.size * slot_bytes)
    dist.broadcast_object_list(box, src=0, group=tp.control_group)
    tp.shared_memory = SharedMemoryAllReduce(box[0], tp.rank, tp.size, slot_bytes, timeout_s)
    dist.barrier(group=tp.control_group)
    if tp.is_first:
        os.unlink(box[0])


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
