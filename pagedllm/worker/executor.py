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
import os
import signal
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.distributed import TensorParallelGroup, init_tensor_parallel
from pagedllm.errors import EngineDeadError
from pagedllm.step import StepInput, StepResult
from pagedllm.worker.worker import Worker, resolve_device

logger = logging.getLogger("pagedllm")

COLLECTIVE_TIMEOUT_S = 20.0  # a peer that neither answers nor closes its connection for this long is dead
_STOP = "stop"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _worker_main(rank: int, size: int, init_method: str, config: EngineConfig, eos_token_ids) -> None:
    """A rank other than 0: build the shard, then run every step rank 0 broadcasts until told to stop."""
    _die_with_parent()
    torch.set_num_threads(config.num_threads or _threads_per_rank(size))
    tp = init_tensor_parallel(rank, size, init_method, resolve_device(config.device), COLLECTIVE_TIMEOUT_S)
    worker = Worker(config, eos_token_ids, tp)
    num_blocks, num_cpu_blocks = _agree_on_num_blocks(worker, tp)
    worker.init_kv_cache(num_blocks, num_cpu_blocks)
    try:
        while True:
            message = _receive(tp)
            if message == _STOP:
                break
            worker.execute(message)
    except (RuntimeError, ConnectionError) as error:  # rank 0 went away
        logger.info("tensor-parallel worker %d stops: %s", rank, error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _agree_on_num_blocks(worker: Worker, tp: TensorParallelGroup) -> tuple[int, int]:
    """Every rank the same block count: the smallest any rank's memory budget holds."""
    counts = torch.tensor(worker.num_kv_blocks_for_config(), dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=tp.control_group)
    return int(counts[0]), int(counts[1])


def _receive(tp: TensorParallelGroup):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.control_group)
    return box[0]


class MultiprocExecutor:
    """Rank 0's worker plus N - 1 worker processes; the engine calls it like a Worker."""

    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...]) -> None:
        size = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        self.processes = [
            context.Process(
                target=_worker_main, args=(rank, size, init_method, config, eos_token_ids),
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
            tp = init_tensor_parallel(0, size, init_method, resolve_device(config.device), COLLECTIVE_TIMEOUT_S)
            self.tp = tp
            self.worker = Worker(config, eos_token_ids, tp)
            num_blocks, num_cpu_blocks = _agree_on_num_blocks(self.worker, tp)
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
            dist.broadcast_object_list([step], src=0, group=self.tp.control_group)
            return self.worker.execute(step)
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
                dist.broadcast_object_list([_STOP], src=0, group=self.tp.control_group)
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
