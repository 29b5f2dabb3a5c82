"""The disk tier of the prefix cache: evicted KV blocks kept as files, reused across restarts.

One file per block, named by the hex chained hash, under a directory keyed by
everything the bytes depend on (model identity, dtype, the per-block tensor
layout of the KV format, block size, tensor-parallel rank and size), with a
``manifest.json`` naming that key. A file is

    header  : magic b"PGKV", version u16, flags u16, json length u32,
              payload length u64, crc32 of json + payload u32  (24 bytes)
    json    : the BlockContent (parent hash hex, token ids, extra keys) and
              the byte length of each tensor slice
    payload : slice [block] of every tensor in KVCache.block_tensors(), in order

written to a temporary file and ``os.replace``-d into place, so a reader sees
a whole file or none. A load checks magic, version, length, checksum and the
stored content against the content looked up: anything wrong is a miss (and
the file is deleted), never wrong KV.

Threads: the engine (scheduler) side asks ``lookup`` / ``prefetch`` /
``plan_write`` / ``claim``; the worker side hands over host copies
(``submit_write``) and takes loaded blocks (``take_claimed``). File writes and
deletions run on one writer thread (FIFO, so a delete never overtakes the
write it undoes), reads on NUM_READERS reader threads; none runs on the step path.
``threaded=False`` runs both inline (deterministic tests).

Invariants (:meth:`DiskTier.check_invariants`): ``num_bytes`` is the sum of
the index entries' sizes and at most ``capacity_bytes`` (once writes drain);
every stored entry has its file; loaded and loading hashes are in the index.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.kv.kv_format import as_bytes
from pagedllm.kv.prefix_cache import BlockContent, BlockHash, hash_content
from pagedllm.native import cpu_ops

logger = logging.getLogger("pagedllm")

MAGIC = b"PGKV"
VERSION = 1
_HEADER = struct.Struct("<4sHHIQI")  # magic, version, flags, json length, payload length, crc32
SUFFIX = ".kvb"
MANIFEST = "manifest.json"
# Reader threads: the loads a waiting batch needs are on its critical path while the engine
# idles, and one thread reads about 1.2-1.6 GB/s (copy from the page cache plus the checksum).
NUM_READERS = 2

BlockLayout = list[tuple[tuple[int, ...], torch.dtype]]
"""Shape and dtype of slice [block] of each tensor of KVCache.block_tensors(), in order."""


def block_layout(block_tensors: list[torch.Tensor]) -> BlockLayout:
    return [(tuple(t.shape[1:]), t.dtype) for t in block_tensors]


def layout_nbytes(layout: BlockLayout) -> int:
    """Bytes of one block's KV over every tensor of the layout."""
    return sum(slice_nbytes(shape, dtype) for shape, dtype in layout)


def slice_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * torch.empty((), dtype=dtype).element_size()


class DiskState(enum.Enum):
    ABSENT = "absent"  # not stored, or stored under other content
    STORED = "stored"  # on disk (or being written), not loaded
    LOADING = "loading"  # the reader thread is bringing it into host memory
    READY = "ready"  # a host copy is loaded: a hit now costs no disk read


@dataclass
class _Entry:
    content: BlockContent
    nbytes: int  # file size
    written: bool  # False while its bytes are still on their way to the file


@dataclass
class DiskTierCounters:
    """Totals since start: bytes and seconds of file reads and writes (background threads)."""

    num_read_bytes: int = 0
    num_written_bytes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    num_corrupt_files: int = 0


def tier_key(
    *, model_identity: str, dtype: str, layout: BlockLayout, block_size: int, tp_rank: int, tp_size: int
) -> dict:
    """What a block file's bytes depend on besides its tokens; the directory name hashes it."""
    return {
        "format": VERSION,
        "model": model_identity,
        "dtype": dtype,
        "layout": [[list(shape), str(dtype)] for shape, dtype in layout],
        "block_size": block_size,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }


def model_identity(model_path: str | os.PathLike) -> str:
    """A fingerprint of the weights: names, sizes and the first 64 KiB of each weight file."""
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".json")
    )
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        digest.update(str(file.stat().st_size).encode())
        with open(file, "rb") as f:
            digest.update(f.read(1 << 16))
    return f"{path.name}:{digest.hexdigest()[:16]}"


class DiskTier:
    """Block files under ``root/<key digest>/``, an LRU index of them and the threads that move bytes.

    ``capacity_bytes`` caps the files' total size; the least recently used
    (written or hit) go first. ``max_loaded_blocks`` bounds the host copies
    held for prefetched blocks that no request has claimed yet. Only the
    engine's thread removes a loaded copy (by claiming or bounding them), so a
    block the scheduler found READY can always be claimed.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        key: dict,
        layout: BlockLayout,
        capacity_bytes: int,
        *,
        threaded: bool = True,
        max_loaded_blocks: int = 1024,
    ) -> None:
        self.layout = layout
        self.block_nbytes = layout_nbytes(layout)
        self.capacity_bytes = capacity_bytes
        self.max_loaded_blocks = max_loaded_blocks
        self.threaded = threaded
        self.enabled = True
        self.closed = False
        self.counters = DiskTierCounters()
        self.num_bytes = 0
        self._lock = threading.RLock()
        self._load_done = threading.Condition(self._lock)  # notified as each queued load ends, and by wake()
        self._woken = False
        self._index: OrderedDict[BlockHash, _Entry] = OrderedDict()  # LRU: head is evicted first
        self._loading: set[BlockHash] = set()
        # Host copies are raw blocks (see pack_block): the file's payload, one uint8 tensor each.
        self._loaded: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self._unwritten: dict[BlockHash, torch.Tensor] = {}  # host copies the writer has not saved yet
        self._planned: dict[int, tuple[BlockHash, BlockContent]] = {}  # write ticket -> block
        self._claimed: dict[int, torch.Tensor] = {}  # read ticket -> host copy
        # Read buffers, reused: a fresh one costs the reader its page faults (more than the read).
        # At most max_loaded_blocks of them, made as loads first need them; recycle() returns them.
        self._buffers: dict[int, torch.Tensor] = {}  # data_ptr -> every buffer this tier made
        self._free_buffers: list[torch.Tensor] = []
        self._tickets = itertools.count()
        self._warned = False
        self.directory = Path(root) / hashlib.sha256(
            json.dumps(key, sort_keys=True).encode()
        ).hexdigest()[:20]
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        if not self._open(key):
            return
        self._rebuild_index()
        if threaded:
            readers = [(self._reader_loop, f"pagedllm-kv-disk-reader-{i}") for i in range(NUM_READERS)]
            for target, name in ((self._writer_loop, "pagedllm-kv-disk-writer"), *readers):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    # -- start-up ----------------------------------------------------------------------

    def _open(self, key: dict) -> bool:
        """Create the key directory and its manifest; a mismatching manifest disables the tier."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            manifest = self.directory / MANIFEST
            if manifest.exists():
                stored = json.loads(manifest.read_text())
                if stored != key:
                    self._disable(f"{manifest} describes another model or KV format; not loading it")
                    return False
            else:
                _atomic_write(manifest, json.dumps(key, sort_keys=True).encode())
            probe = self.directory / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except (OSError, ValueError) as error:
            self._disable(f"cannot use {self.directory}: {error}")
            return False
        return True

    def _rebuild_index(self) -> None:
        """Index the files already there (a restart), oldest-used first; bad ones are deleted."""
        entries = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                _unlink(path)
                continue
            if path.suffix != SUFFIX:
                continue
            content = self._read_header(path)
            if content is None:
                self.counters.num_corrupt_files += 1
                _unlink(path)
                continue
            stat = path.stat()
            entries.append((stat.st_mtime, path.stem, content, stat.st_size))
        for _, name, content, nbytes in sorted(entries):
            self._index[bytes.fromhex(name)] = _Entry(content, nbytes, written=True)
            self.num_bytes += nbytes
        self._shrink()
        if entries:
            logger.info("KV disk tier: %d blocks (%d bytes) found in %s", len(self._index),
                        self.num_bytes, self.directory)

    def _check_header(self, f) -> tuple[int, int, int] | None:
        """(json length, payload length, crc32) of an open block file whose header is this
        tier's format and whose size matches it; None otherwise. Raises struct.error when short."""
        magic, version, _, json_len, payload_len, crc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC or version != VERSION or payload_len != self.block_nbytes:
            return None
        if os.fstat(f.fileno()).st_size != _HEADER.size + json_len + payload_len:
            return None
        return json_len, payload_len, crc

    def _read_header(self, path: Path) -> BlockContent | None:
        """The content a file claims to hold, when its header and length are sound and its name matches."""
        try:
            with open(path, "rb") as f:
                header = self._check_header(f)
                if header is None:
                    return None
                content = _content_from_json(f.read(header[0]))
        except (OSError, ValueError, struct.error, KeyError, TypeError):
            return None
        if hash_content(content).hex() != path.stem:
            return None
        return content

    # -- the engine's side ------------------------------------------------------------

    def lookup(self, block_hash: BlockHash, content: BlockContent) -> DiskState:
        """Where the block stands; a colliding hash with other content is ABSENT."""
        with self._lock:
            entry = self._index.get(block_hash)
            if not self.enabled or entry is None or entry.content != content:
                return DiskState.ABSENT
            if block_hash in self._loaded:
                return DiskState.READY
            if block_hash in self._loading:
                return DiskState.LOADING
            return DiskState.STORED

    def prefetch(self, block_hash: BlockHash) -> None:
        """Start bringing a stored block into host memory (no-op unless it is STORED and written)."""
        with self._lock:
            entry = self._index.get(block_hash)
            if not self.enabled or entry is None or block_hash in self._loaded or block_hash in self._loading:
                return
            if not entry.written and block_hash not in self._unwritten:
                return  # its write is planned but the worker has not handed the bytes over yet
            # Unclaimed host copies are bounded here, on the engine's thread, so that a copy
            # the scheduler has just found READY stays until it claims it.
            while self._loaded and len(self._loaded) + len(self._loading) >= self.max_loaded_blocks:
                self._recycle(self._loaded.popitem(last=False)[1])
            self._loading.add(block_hash)
        self._enqueue(self._reads, self._load, block_hash, entry.content)

    def wait_loaded(self, block_hash: BlockHash, timeout: float) -> bool:
        """Block until ``block_hash`` is not loading any more, :meth:`wake` is called (or was,
        since the last wait), or ``timeout`` seconds pass; whether the block is done (loaded,
        or found bad). The engine waits here, instead of polling, when every step it could run
        waits on the disk."""
        with self._load_done:
            self._load_done.wait_for(lambda: self._woken or block_hash not in self._loading, timeout)
            self._woken = False
            return block_hash not in self._loading

    def wake(self) -> None:
        """End a wait_loaded now (from another thread: a new request or an abort has come in)."""
        with self._load_done:
            self._woken = True
            self._load_done.notify_all()

    def claim(self, block_hash: BlockHash) -> int:
        """Reserve a READY block's host copy for a fetch op; returns the ticket the op carries."""
        with self._lock:
            tensors = self._loaded.pop(block_hash)
            ticket = next(self._tickets)
            self._claimed[ticket] = tensors
            self._touch(block_hash)
            return ticket

    def plan_write(self, block_hash: BlockHash, content: BlockContent) -> int | None:
        """A ticket for the worker to hand the block's bytes to, or None: already stored (now MRU) or off."""
        with self._lock:
            if not self.enabled:
                return None
            entry = self._index.get(block_hash)
            if entry is not None and entry.content == content:
                self._touch(block_hash)
                return None
            if entry is not None:
                self._drop(block_hash)  # a colliding hash: the newer content replaces the file
            nbytes = _HEADER.size + len(_content_json(content, self.layout)) + self.block_nbytes
            self._index[block_hash] = _Entry(content, nbytes, written=False)
            self.num_bytes += nbytes
            ticket = next(self._tickets)
            self._planned[ticket] = (block_hash, content)
            self._shrink()
            return ticket

    # -- the worker's side ---------------------------------------------------------------

    def submit_write(self, ticket: int, raw: torch.Tensor) -> None:
        """Hand over a host copy of a planned block (a raw block: see pack_block); the writer thread saves it."""
        if raw.dtype != torch.uint8 or raw.shape != (self.block_nbytes,):
            raise ValueError(f"a raw block is {self.block_nbytes} uint8 bytes, got {raw.dtype} {tuple(raw.shape)}")
        with self._lock:
            block_hash, content = self._planned.pop(ticket)
            entry = self._index.get(block_hash)
            if entry is None or entry.content != content or not self.enabled:
                return  # evicted (or the tier failed) before its bytes arrived
            self._unwritten[block_hash] = raw
        self._enqueue(self._writes, self._write, block_hash, content, raw)

    def take_claimed(self, ticket: int) -> torch.Tensor:
        """The host copy a claim reserved, a raw block (each ticket once); hand it back with
        recycle() once its bytes are copied."""
        with self._lock:
            return self._claimed.pop(ticket)

    def recycle(self, raws: list[torch.Tensor]) -> None:
        """Claimed host copies whose bytes are in the device blocks now: their buffers are read into again."""
        with self._lock:
            for raw in raws:
                self._recycle(raw)

    def _recycle(self, raw: torch.Tensor) -> None:
        if self._buffers.get(raw.data_ptr()) is raw:  # one of the read buffers (not a writer's copy)
            self._free_buffers.append(raw)

    def _buffer(self) -> torch.Tensor:
        """A buffer for one block's payload: a free one, a new one while there are fewer than
        max_loaded_blocks, else a temporary."""
        with self._lock:
            if self._free_buffers:
                return self._free_buffers.pop()
            raw = torch.empty(self.block_nbytes, dtype=torch.uint8)
            if len(self._buffers) < self.max_loaded_blocks:
                self._buffers[raw.data_ptr()] = raw
            return raw

    # -- background work --------------------------------------------------------------------

    def _enqueue(self, jobs: queue.Queue, fn: Callable, *args) -> None:
        if self.threaded:
            jobs.put((fn, args))
        else:
            fn(*args)

    def _writer_loop(self) -> None:
        self._loop(self._writes)

    def _reader_loop(self) -> None:
        self._loop(self._reads)

    @staticmethod
    def _loop(jobs: queue.Queue) -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                fn, args = job
                try:
                    fn(*args)
                except Exception:  # a bug in one job must not end the thread and stall every later one
                    logger.exception("KV disk tier job failed")
            finally:
                jobs.task_done()

    def _write(self, block_hash: BlockHash, content: BlockContent, raw: torch.Tensor) -> None:
        start = time.perf_counter()
        path = self._path(block_hash)
        try:
            json_bytes = _content_json(content, self.layout)
            payload = memoryview(raw.numpy())  # written from the tensor's own memory, no copy
            crc = zlib.crc32(payload, zlib.crc32(json_bytes))
            header = _HEADER.pack(MAGIC, VERSION, 0, len(json_bytes), len(payload), crc)
            _atomic_write(path, header + json_bytes, payload)
        except OSError as error:
            with self._lock:
                self._unwritten.pop(block_hash, None)
            self._disable(f"writing {path} failed: {error}")
            return
        with self._lock:
            self._unwritten.pop(block_hash, None)
            entry = self._index.get(block_hash)
            if entry is not None and entry.content == content:
                entry.written = True
                entry.nbytes = len(header) + len(json_bytes) + len(payload)
            else:
                _unlink(path)  # dropped while it was being written
            self.counters.num_written_bytes += len(payload)
            self.counters.write_seconds += time.perf_counter() - start

    def _delete(self, block_hash: BlockHash) -> None:
        with self._lock:
            if block_hash in self._index:
                return  # written again since the delete was queued
        _unlink(self._path(block_hash))

    def _load(self, block_hash: BlockHash, content: BlockContent) -> None:
        start = time.perf_counter()
        with self._lock:
            pending = self._unwritten.get(block_hash)
        raw = pending if pending is not None else self._read_file(block_hash, content)
        with self._lock:
            self._loading.discard(block_hash)
            self._load_done.notify_all()
            entry = self._index.get(block_hash)
            if raw is None:
                if entry is not None and entry.content == content:
                    self.counters.num_corrupt_files += 1
                    self._drop(block_hash)
                return
            if entry is None or entry.content != content:
                self._recycle(raw)
                return  # evicted while it was read
            self._loaded[block_hash] = raw
            if pending is None:
                self.counters.num_read_bytes += self.block_nbytes
                self.counters.read_seconds += time.perf_counter() - start

    def _read_file(self, block_hash: BlockHash, content: BlockContent) -> torch.Tensor | None:
        """The file's payload (a raw block) when every check passes; None (a miss) otherwise.

        The payload is read straight into the tensor that holds it: one copy of
        the block's bytes, and no per-slice tensor objects on this thread (it
        shares the interpreter with the engine's)."""
        path = self._path(block_hash)
        raw = self._buffer()
        try:
            if self._read_into(path, raw, content):
                return raw
        except (OSError, ValueError, struct.error, KeyError, TypeError):
            pass
        with self._lock:
            self._recycle(raw)
        return None

    def _read_into(self, path: Path, raw: torch.Tensor, content: BlockContent) -> bool:
        """Whether the file at ``path`` is sound, holds ``content``, and its payload is now in ``raw``."""
        with open(path, "rb") as f:
            header = self._check_header(f)  # (its payload length is block_nbytes)
            if header is None:
                return False
            json_len, payload_len, crc = header
            json_bytes = f.read(json_len)
            view = memoryview(raw.numpy())
            if len(json_bytes) != json_len or f.readinto(view) != payload_len:
                return False
        if zlib.crc32(view, zlib.crc32(json_bytes)) != crc or _content_from_json(json_bytes) != content:
            return False
        os.utime(path)  # the file's mtime is its last use, for the LRU order after a restart
        return True

    # -- LRU and failure -----------------------------------------------------------------------

    def _touch(self, block_hash: BlockHash) -> None:
        self._index.move_to_end(block_hash)

    def _drop(self, block_hash: BlockHash) -> None:
        """Forget a block and delete its file (on the writer thread, after any write queued before)."""
        entry = self._index.pop(block_hash)
        self.num_bytes -= entry.nbytes
        loaded = self._loaded.pop(block_hash, None)
        if loaded is not None:
            self._recycle(loaded)
        self._enqueue(self._writes, self._delete, block_hash)

    def _shrink(self) -> None:
        while self.num_bytes > self.capacity_bytes and self._index:
            self._drop(next(iter(self._index)))

    def _disable(self, reason: str) -> None:
        with self._lock:
            self.enabled = False  # host copies already loaded stay valid (and claimable) KV
        if not self._warned:
            self._warned = True
            logger.warning("KV disk tier disabled, serving without it: %s", reason)

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._index) if self.enabled else 0

    def drain(self) -> None:
        """Wait until every queued read and write is done (tests, shutdown)."""
        if self.threaded and self._threads:
            self._reads.join()  # first: a failed read queues the deletion of its file
            self._writes.join()

    def close(self) -> None:
        """Finish queued writes, then stop the threads."""
        self.closed = True
        self.drain()
        if self._threads:
            self._writes.put(None)
            for _ in range(NUM_READERS):
                self._reads.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []

    def check_invariants(self) -> None:
        """Index vs files and byte counts (waits for queued reads and writes first)."""
        self.drain()
        with self._lock:
            assert self.num_bytes == sum(e.nbytes for e in self._index.values()), "disk byte count drifted"
            if not self.enabled:
                return
            assert self.num_bytes <= self.capacity_bytes, (
                f"disk tier holds {self.num_bytes} bytes over its {self.capacity_bytes} cap"
            )
            for block_hash in self._loaded:
                assert block_hash in self._index, "a loaded block is not in the index"
            for block_hash in self._loading:
                assert block_hash in self._index, "a loading block is not in the index"
            free = [id(raw) for raw in self._free_buffers]
            in_use = {id(raw) for raw in (*self._loaded.values(), *self._claimed.values())}
            assert len(set(free)) == len(free), "a read buffer is on the free list twice"
            assert not in_use.intersection(free), "a free read buffer still holds a loaded block"
            assert all(self._buffers.get(raw.data_ptr()) is raw for raw in self._free_buffers), (
                "a buffer the tier did not make is on its free list")
            assert len(self._buffers) <= self.max_loaded_blocks, "more read buffers than the prefetch bound"
            files = {p.stem for p in self.directory.glob("*" + SUFFIX)}
            written = {h.hex() for h, e in self._index.items() if e.written}
            assert written <= files, f"indexed blocks without a file: {sorted(written - files)[:3]}"
            if not self._planned and not self._unwritten:
                assert files <= {h.hex() for h in self._index}, (
                    f"files the index does not know: {sorted(files - set(h.hex() for h in self._index))[:3]}"
                )


# -- encoding -------------------------------------------------------------------------------


def _content_json(content: BlockContent, layout: BlockLayout) -> bytes:
    return json.dumps({
        "parent": None if content.parent_hash is None else content.parent_hash.hex(),
        "tokens": list(content.token_ids),
        "extra": list(content.extra_keys),
        "slices": [slice_nbytes(shape, dtype) for shape, dtype in layout],
    }).encode()


def _content_from_json(data: bytes) -> BlockContent:
    obj = json.loads(data)
    parent = None if obj["parent"] is None else bytes.fromhex(obj["parent"])
    return BlockContent(parent, tuple(int(t) for t in obj["tokens"]), tuple(obj["extra"]))


def pack_block(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A raw block: the bytes of one block's slices (layout order) in one flat uint8 CPU tensor.

    The disk tier's unit: a file's payload, a loaded copy, a copy handed to the writer."""
    pieces = [as_bytes(t).contiguous().reshape(-1).view(torch.uint8).cpu() for t in tensors]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def tensors_from_raw(raw: torch.Tensor, layout: BlockLayout) -> list[torch.Tensor]:
    """Views of a raw block's bytes (uint8, the slices one after another) as its tensors."""
    tensors, offset = [], 0
    for shape, dtype in layout:
        n = slice_nbytes(shape, dtype)
        tensors.append(raw[offset : offset + n].view(dtype).reshape(shape))
        offset += n
    return tensors


def _atomic_write(path: Path, *parts: bytes | memoryview) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for data in parts:
                f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


# -- moving one block's slices ------------------------------------------------------------


def _block_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor``'s bytes as [blocks, bytes per block] (a view)."""
    return tensor.view(torch.uint8).view(tensor.shape[0], -1)


def _gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Blocks ``index`` of ``tensor`` as [n, bytes per block], each block's bytes in its logical
    order (a KV_LAYOUT_HEAD pool's permuted views included)."""
    if tensor.is_contiguous():
        return _block_rows(tensor).index_select(0, index)
    picked = as_bytes(tensor).index_select(0, index).contiguous()
    return picked.view(torch.uint8).view(index.shape[0], -1)


def read_blocks(block_tensors: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """Host copies of the blocks ``block_ids``: one raw block each (see pack_block).

    On the CPU one native call copies them all (the engine's thread waits on
    these copies); elsewhere, or without the kernels, one gather per tensor and
    one concatenation (the reference path)."""
    if not block_ids:
        return []
    if block_tensors[0].device.type == "cpu":
        raws = list(torch.empty(len(block_ids), layout_nbytes(block_layout(block_tensors)), dtype=torch.uint8))
        if cpu_ops.can_move_blocks(block_tensors, raws):
            cpu_ops.move_blocks(block_tensors, block_ids, raws, into_tensors=False)
            return raws
    return read_blocks_reference(block_tensors, block_ids)


def read_blocks_reference(block_tensors: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """read_blocks in torch ops."""
    if not block_ids:
        return []
    index = torch.tensor(block_ids, dtype=torch.int64, device=block_tensors[0].device)
    gathered = torch.cat([_gather_rows(t, index) for t in block_tensors], dim=1).cpu()
    return list(gathered.unbind(0))


def write_blocks(block_tensors: list[torch.Tensor], block_ids: list[int], raws: list[torch.Tensor]) -> None:
    """Store raw block ``raws[i]`` into block ``block_ids[i]`` of every tensor (the inverse of read_blocks).

    On the CPU one native call (about 4x faster than the torch ops on a
    Sapphire Rapids core, and it runs on the engine's thread before the step)."""
    if block_ids and block_tensors[0].device.type == "cpu" and cpu_ops.can_move_blocks(block_tensors, raws):
        cpu_ops.move_blocks(block_tensors, block_ids, raws, into_tensors=True)
        return
    write_blocks_reference(block_tensors, block_ids, raws)


def write_blocks_reference(block_tensors: list[torch.Tensor], block_ids: list[int], raws: list[torch.Tensor]) -> None:
    """write_blocks in torch ops."""
    if not block_ids:
        return
    sizes = [t[0].numel() * t.element_size() for t in block_tensors]
    parts = [raw.split(sizes) for raw in raws]  # one call per block: views of its slices
    index = torch.tensor(block_ids, dtype=torch.int64, device=block_tensors[0].device)
    for k, tensor in enumerate(block_tensors):
        stacked = torch.stack([part[k] for part in parts]).to(tensor.device)
        if tensor.is_contiguous():
            _block_rows(tensor).index_copy_(0, index, stacked)
        else:  # a permuted view: the raw bytes are its blocks in logical order
            target = as_bytes(tensor)
            target.index_copy_(0, index, stacked.view(target.dtype).view(len(block_ids), *tensor.shape[1:]))
