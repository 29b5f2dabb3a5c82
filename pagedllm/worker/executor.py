"""Tensor-parallel execution: N worker processes over torch.distributed, driven from rank 0.

Rank 0's :class:`Worker` lives in the engine's process; ranks 1..N-1 are
started with ``torch.multiprocessing`` (spawn) and join the same process
group (gloo on CPU, NCCL on CUDA, plus a gloo group for control messages).
Each step, rank 0 broadcasts the plain :class:`~pagedllm.step.StepInput`
and every rank runs it on its own shard of the model and of every KV block
(same block tables everywhere); only rank 0 samples.

Failure: before each step the executor checks that every worker process is
alive, and a collective that fails because a peer went away (or stays past
the group's timeout) ends the engine with :class:`EngineDeadError`. Workers
exit when the engine's process goes away (parent-death signal, and the
broken connection), so none is left behind.
"""

from __future__ import annotations

import ctypes
import logging
import pickle
import signal
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.distributed import (
    STARTUP_TIMEOUT_S,
    RankTimes,
    TensorParallelGroup,
    attach_shared_memory,
    init_tensor_parallel,
)
from pagedllm.errors import EngineDeadError
from pagedllm.native.threads import allowed_cpus
from pagedllm.step import StepInput, StepResult
from pagedllm.worker.worker import Worker, resolve_device

logger = logging.getLogger("pagedllm")

COLLECTIVE_TIMEOUT_S = 20.0  # a peer that neither answers nor closes its connection for this long is dead
_STOP = "stop"


@dataclass(frozen=True)
class TimesRequest:
    """Control message: every rank sends its :class:`RankTimes` to rank 0 (then zeroes them if ``reset``)."""

    reset: bool


@dataclass(frozen=True)
class MemoryOpsRequest:
    """Control message: every rank applies these memory operations (outside a step)."""

    ops: list


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(size: int) -> int:
    """Each rank's share of the cores this process may run on (a container's or ``taskset``'s
    mask, not the machine's count: more threads than cores would contend at every barrier)."""
    return max(1, allowed_cpus() // size)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _worker_main(rank: int, size: int, init_method: str, config: EngineConfig, eos_token_ids, started) -> None:
    """A rank other than 0: build the shard, then run every step rank 0 broadcasts until told to stop."""
    started.set()  # the process got past importing the main module (see _wait_until_started)
    _die_with_parent()
    torch.set_num_threads(config.num_threads or _threads_per_rank(size))
    tp = init_tensor_parallel(rank, size, init_method, resolve_device(config.device), COLLECTIVE_TIMEOUT_S)
    worker = Worker(config, eos_token_ids, tp)
    num_blocks, num_cpu_blocks = _agree_on_num_blocks(worker, tp)
    _attach_shared_memory(worker, tp)
    worker.init_kv_cache(num_blocks, num_cpu_blocks)
    channel = StepChannel(tp)
    try:
        while True:
            message = channel.receive()
            if message == _STOP:
                break
            if isinstance(message, TimesRequest):
                _gather_times(tp, message.reset)
                continue
            if isinstance(message, MemoryOpsRequest):
                worker.apply_memory_ops(message.ops)
                continue
            worker.execute(message)
    except (RuntimeError, ConnectionError) as error:  # rank 0 went away
        logger.info("tensor-parallel worker %d stops: %s", rank, error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _attach_shared_memory(worker: Worker, tp: TensorParallelGroup) -> None:
    """On the CPU, the shared-memory all-reduce, sized for a full step's ``[tokens, hidden]``;
    with packed GGUF weights for ``[tokens, intermediate]`` too, the down projection's gathered
    input (pagedllm.quant.layers.QuantizedRowParallelMethod)."""
    if worker.device.type != "cpu":
        return
    config, model = worker.config, worker.model_config
    tokens = config.step_token_budget
    width = model.hidden_size
    if config.quantization == "gguf":
        width = max(width, model.intermediate_size, model.num_heads * model.head_dim)
    slot_bytes = tokens * width * worker.dtype.itemsize
    attach_shared_memory(tp, slot_bytes, COLLECTIVE_TIMEOUT_S)


def _agree_on_num_blocks(worker: Worker, tp: TensorParallelGroup) -> tuple[int, int]:
    """Every rank the same block count: the smallest any rank's memory budget holds."""
    counts = torch.tensor(worker.num_kv_blocks_for_config(), dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=tp.control_group)
    return int(counts[0]), int(counts[1])


class StepChannel:
    """Rank 0 -> every other rank: pickled control messages over the gloo control group.

    One broadcast of a fixed frame carries the message's length and, when it
    fits (a decode step's message does, whatever the context length), the
    whole pickle; a longer message's remainder follows in a second broadcast of
    just its size. (``broadcast_object_list`` always takes two collectives: the
    sizes, then the bytes.) Time and bytes go to the rank's ``step_message``
    cost; on a receiving rank the time includes the wait for rank 0.
    """

    FRAME_BYTES = 64 * 1024
    _HEADER_BYTES = 8  # the pickle's length, little-endian

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp = tp
        self.frame = torch.zeros(self.FRAME_BYTES, dtype=torch.uint8)  # [FRAME_BYTES]

    def send(self, message) -> None:
        start = time.perf_counter()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = self.frame.numpy()
        view[: self._HEADER_BYTES] = np.frombuffer(len(data).to_bytes(self._HEADER_BYTES, "little"), np.uint8)
        head = min(len(data), self.FRAME_BYTES - self._HEADER_BYTES)
        view[self._HEADER_BYTES : self._HEADER_BYTES + head] = np.frombuffer(data, np.uint8, count=head)
        dist.broadcast(self.frame, src=0, group=self.tp.control_group)
        if head < len(data):
            rest = torch.from_numpy(np.frombuffer(data, np.uint8, offset=head).copy())
            dist.broadcast(rest, src=0, group=self.tp.control_group)
        self.tp.times.step_message.add(time.perf_counter() - start, len(data))

    def receive(self):
        start = time.perf_counter()
        dist.broadcast(self.frame, src=0, group=self.tp.control_group)
        view = self.frame.numpy()
        size = int.from_bytes(view[: self._HEADER_BYTES].tobytes(), "little")
        head = min(size, self.FRAME_BYTES - self._HEADER_BYTES)
        data = view[self._HEADER_BYTES : self._HEADER_BYTES + head].tobytes()
        if head < size:
            rest = torch.empty(size - head, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.tp.control_group)
            data += rest.numpy().tobytes()
        self.tp.times.step_message.add(time.perf_counter() - start, size)
        return pickle.loads(data)


def _gather_times(tp: TensorParallelGroup, reset: bool) -> list[RankTimes] | None:
    """Every rank's times on rank 0 (None elsewhere), in rank order."""
    gathered = [None] * tp.size if tp.is_first else None
    dist.gather_object(tp.times, gathered, dst=0, group=tp.control_group)
    if reset:
        tp.reset_times()
    return gathered


def _wait_until_started(processes: list, started: list, timeout_s: float) -> None:
    """Return once every worker process has reached :func:`_worker_main`; raise EngineDeadError
    at once where one exits first (or after ``timeout_s``), rather than after rank 0's rendezvous
    timeout."""
    deadline = time.monotonic() + timeout_s
    for process, event in zip(processes, started, strict=True):
        while not event.wait(0.1):
            if not process.is_alive():
                raise EngineDeadError(
                    f"tensor-parallel worker {process.name} exited (code {process.exitcode}) before it started. "
                    "Each rank is a process started with multiprocessing's 'spawn', which imports the main "
                    "module again: a script that builds an engine with tensor_parallel_size > 1 must do so "
                    "under `if __name__ == \"__main__\":` (and the error above, if any, says what else failed)"
                )
            if time.monotonic() > deadline:
                raise EngineDeadError(f"tensor-parallel worker {process.name} did not start within {timeout_s:.0f} s")


class MultiprocExecutor:
    """Rank 0's worker plus N - 1 worker processes; the engine calls it like a Worker."""

    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...]) -> None:
        size = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        started = [context.Event() for _ in range(1, size)]
        self.processes = [
            context.Process(
                target=_worker_main, args=(rank, size, init_method, config, eos_token_ids, started[rank - 1]),
                name=f"pagedllm-tp{rank}", daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in self.processes:
            process.start()
        torch.set_num_threads(config.num_threads or _threads_per_rank(size))
        self._dead: str | None = None
        self.tp: TensorParallelGroup | None = None
        try:
            _wait_until_started(self.processes, started, STARTUP_TIMEOUT_S)
            tp = init_tensor_parallel(0, size, init_method, resolve_device(config.device), COLLECTIVE_TIMEOUT_S)
            self.tp = tp
            self.channel = StepChannel(tp)
            self.worker = Worker(config, eos_token_ids, tp)
            num_blocks, num_cpu_blocks = _agree_on_num_blocks(self.worker, tp)
            _attach_shared_memory(self.worker, tp)
        except Exception:
            self.shutdown()
            raise
        self.worker.init_kv_cache(num_blocks, num_cpu_blocks)

    # ---- the Worker's interface, as the engine uses it -----------------------

    @property
    def device(self) -> torch.device:
        return self.worker.device

    def uses_cuda_graphs(self) -> bool:
        return False  # every rank would have to capture and replay in step; not done yet

    def execute(self, step: StepInput) -> StepResult:
        self._check_alive()
        try:
            self.channel.send(step)
            return self.worker.execute(step)
        except (RuntimeError, ConnectionError) as error:
            self._fail(f"a tensor-parallel worker failed (a collective broke off): {error}")

    def rank_times(self, reset: bool = False) -> list[RankTimes]:
        """Where each rank's time went since the last reset, in rank order (and zero them if ``reset``)."""
        self._check_alive()
        try:
            self.channel.send(TimesRequest(reset))
            return _gather_times(self.tp, reset)
        except (RuntimeError, ConnectionError) as error:
            self._fail(f"a tensor-parallel worker failed (a collective broke off): {error}")

    def apply_memory_ops(self, ops: list) -> None:
        """Memory operations outside a step (the disk tier's save at shutdown), on every rank."""
        self._check_alive()
        try:
            self.channel.send(MemoryOpsRequest(ops))
            self.worker.apply_memory_ops(ops)
        except (RuntimeError, ConnectionError) as error:
            self._fail(f"a tensor-parallel worker failed (a collective broke off): {error}")

    def launch(self, step: StepInput) -> None:
        raise NotImplementedError("overlapped steps with tensor_parallel_size > 1")

    def collect(self) -> StepResult:
        raise NotImplementedError("overlapped steps with tensor_parallel_size > 1")

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        for process in self.processes:
            if not process.is_alive():
                self._fail(f"tensor-parallel worker {process.name} exited (code {process.exitcode})")

    def _fail(self, message: str):
        self._dead = message
        self.shutdown()
        raise EngineDeadError(message)

    def shutdown(self) -> None:
        """Stop every worker process (politely when the group still works, by force after 5 s)."""
        if self._dead is None and self.tp is not None and dist.is_initialized():
            try:
                self.channel.send(_STOP)
            except (RuntimeError, ConnectionError):
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError):
                pass
