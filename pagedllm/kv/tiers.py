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
write it undoes), reads on one reader thread; neither runs on the step path.
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

logger = logging.getLogger("pagedllm")

MAGIC = b"PGKV"
VERSION = 1
_HEADER = struct.Struct("<4sHHIQI")  # magic, version, flags, json length, payload length, crc32
SUFFIX = ".kvb"
MANIFEST = "manifest.json"

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
        self._index: OrderedDict[BlockHash, _Entry] = OrderedDict()  # LRU: head is evicted first
        self._loading: set[BlockHash] = set()
        self._loaded: OrderedDict[BlockHash, list[torch.Tensor]] = OrderedDict()
        self._unwritten: dict[BlockHash, list[torch.Tensor]] = {}  # host copies the writer has not saved yet
        self._planned: dict[int, tuple[BlockHash, BlockContent]] = {}  # write ticket -> block
        self._claimed: dict[int, list[torch.Tensor]] = {}  # read ticket -> host copy
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
            for target, name in ((self._writer_loop, "pagedllm-kv-disk-writer"),
                                 (self._reader_loop, "pagedllm-kv-disk-reader")):
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
                self._loaded.popitem(last=False)
            self._loading.add(block_hash)
        self._enqueue(self._reads, self._load, block_hash, entry.content)

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

    def submit_write(self, ticket: int, tensors: list[torch.Tensor]) -> None:
        """Hand over host copies of a planned block's slices; the writer thread saves them."""
        with self._lock:
            block_hash, content = self._planned.pop(ticket)
            entry = self._index.get(block_hash)
            if entry is None or entry.content != content or not self.enabled:
                return  # evicted (or the tier failed) before its bytes arrived
            self._unwritten[block_hash] = tensors
        self._enqueue(self._writes, self._write, block_hash, content, tensors)

    def take_claimed(self, ticket: int) -> list[torch.Tensor]:
        """The host copy a claim reserved (each ticket once)."""
        with self._lock:
            return self._claimed.pop(ticket)

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

    def _write(self, block_hash: BlockHash, content: BlockContent, tensors: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        path = self._path(block_hash)
        try:
            json_bytes = _content_json(content, self.layout)
            payload = b"".join(_tensor_bytes(t) for t in tensors)
            crc = zlib.crc32(payload, zlib.crc32(json_bytes))
            header = _HEADER.pack(MAGIC, VERSION, 0, len(json_bytes), len(payload), crc)
            _atomic_write(path, header + json_bytes + payload)
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
        tensors = pending if pending is not None else self._read_file(block_hash, content)
        with self._lock:
            self._loading.discard(block_hash)
            entry = self._index.get(block_hash)
            if tensors is None:
                if entry is not None and entry.content == content:
                    self.counters.num_corrupt_files += 1
                    self._drop(block_hash)
                return
            if entry is None or entry.content != content:
                return  # evicted while it was read
            self._loaded[block_hash] = tensors
            if pending is None:
                self.counters.num_read_bytes += self.block_nbytes
                self.counters.read_seconds += time.perf_counter() - start

    def _read_file(self, block_hash: BlockHash, content: BlockContent) -> list[torch.Tensor] | None:
        """The file's tensors when every check passes; None (a miss) otherwise.

        The payload is read straight into the tensor that holds it (one copy of
        the block's bytes, where reading the file whole and slicing it made four)."""
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                header = self._check_header(f)
                if header is None:
                    return None
                json_len, payload_len, crc = header
                json_bytes = f.read(json_len)
                raw = torch.empty(payload_len, dtype=torch.uint8)
                view = memoryview(raw.numpy())
                if len(json_bytes) != json_len or f.readinto(view) != payload_len:
                    return None
            if zlib.crc32(view, zlib.crc32(json_bytes)) != crc:
                return None
            if _content_from_json(json_bytes) != content:
                return None
            os.utime(path)  # the file's mtime is its last use, for the LRU order after a restart
        except (OSError, ValueError, struct.error, KeyError, TypeError):
            return None
        return tensors_from_raw(raw, self.layout)

    # -- LRU and failure -----------------------------------------------------------------------

    def _touch(self, block_hash: BlockHash) -> None:
        self._index.move_to_end(block_hash)

    def _drop(self, block_hash: BlockHash) -> None:
        """Forget a block and delete its file (on the writer thread, after any write queued before)."""
        entry = self._index.pop(block_hash)
        self.num_bytes -= entry.nbytes
        self._loaded.pop(block_hash, None)
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
        for jobs in (self._writes, self._reads):
            if self._threads:
                jobs.put(None)
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


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def tensors_from_raw(raw: torch.Tensor, layout: BlockLayout) -> list[torch.Tensor]:
    """Views of a block's bytes (uint8, the slices one after another) as its tensors."""
    tensors, offset = [], 0
    for shape, dtype in layout:
        n = slice_nbytes(shape, dtype)
        tensors.append(raw[offset : offset + n].view(dtype).reshape(shape))
        offset += n
    return tensors


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
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


def read_blocks(block_tensors: list[torch.Tensor], block_ids: list[int]) -> list[list[torch.Tensor]]:
    """Host copies of slice [b] of every tensor, per block b: ``result[i][k]`` is tensor k's slice of block_ids[i]."""
    if not block_ids:
        return []
    index = torch.tensor(block_ids, dtype=torch.int64, device=block_tensors[0].device)
    # CPU float8 (8-bit KV) has no index_copy_: move every tensor's bytes as uint8
    gathered = [as_bytes(t).index_select(0, index).cpu().view(t.dtype) for t in block_tensors]  # [n, *slice]
    return [[g[i] for g in gathered] for i in range(len(block_ids))]


def write_blocks(
    block_tensors: list[torch.Tensor], block_ids: list[int], blocks: list[list[torch.Tensor]]
) -> None:
    """Store ``blocks[i][k]`` into slice [block_ids[i]] of tensor k (the inverse of read_blocks)."""
    if not block_ids:
        return
    index = torch.tensor(block_ids, dtype=torch.int64, device=block_tensors[0].device)
    for k, tensor in enumerate(block_tensors):
        rows = torch.stack([as_bytes(block[k]) for block in blocks]).to(tensor.device)
        as_bytes(tensor).index_copy_(0, index, rows)
