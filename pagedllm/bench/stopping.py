"""How a bench stops when it is told to (SIGTERM from ``kill`` or ``timeout``).

The benches start servers in their own sessions (``serve.ServerProcess``), so a signal
to the bench does not reach them; the bench must stop them itself. On SIGTERM:

- inside :func:`run_async` the running coroutine's task is cancelled, as asyncio's
  own runner does for Ctrl-C, so that its ``async with`` blocks close their
  connections, and the bench then unwinds with ``KeyboardInterrupt``;
- elsewhere ``KeyboardInterrupt`` is raised at once;
- either way the ``with ServerProcess`` blocks stop their servers on the way out,
  with a short grace (:func:`stop_grace`), :func:`process_group` blocks kill the
  peers they started (vLLM's offline run and its engine processes), and a child
  bench run by :func:`run_child` is passed the SIGTERM before it is killed;
- a watchdog bounds the whole thing: whatever still runs ``WATCHDOG_S`` after the
  signal is killed, every server group still registered as well, and the bench
  exits with 128 + the signal's number. A second SIGTERM does that at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

# Seconds from the first SIGTERM until the bench gives up unwinding and exits.
WATCHDOG_S = 60.0
# While terminating, seconds a stopping server gets between SIGTERM and SIGKILL.
TERMINATING_STOP_GRACE_S = 20.0

_lock = threading.Lock()
_groups: set[int] = set()
_main_task: asyncio.Task | None = None
_signal_number: int | None = None


def terminating() -> bool:
    """True once the bench has been told to stop."""
    return _signal_number is not None


def stop_grace(normal_s: float) -> float:
    """The grace a stopping server gets: ``normal_s``, shortened while terminating."""
    return min(normal_s, TERMINATING_STOP_GRACE_S) if terminating() else normal_s


def register_group(pgid: int) -> None:
    """A process group (a server's, a peer's) for the watchdog to kill if the bench hangs."""
    with _lock:
        _groups.add(pgid)


def unregister_group(pgid: int) -> None:
    with _lock:
        _groups.discard(pgid)


@contextmanager
def process_group(cmd: list[str], **popen_kwargs) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(cmd)`` in a session of its own (a peer such as vLLM's offline run, with
    the worker processes it starts), registered for the watchdog. Leaving the block kills
    whatever of the group still runs: at once when the block raises (KeyboardInterrupt from
    SIGTERM or Ctrl-C included), and, after a normal exit, the members that outlived the leader."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    register_group(proc.pid)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        unregister_group(proc.pid)


def run_child(cmd: list[str], **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a child that is itself a bench
    (one backend's run in its own process). If this bench is stopped meanwhile, the child gets
    SIGTERM first, so that it stops what it started (a peer's process group, a server), and
    SIGKILL only if it has not ended ``TERMINATING_STOP_GRACE_S`` later; ``subprocess.run``
    would kill it at once and orphan those."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs) as proc:
        try:
            out, err = proc.communicate()
        except BaseException:
            proc.terminate()
            try:
                proc.communicate(timeout=TERMINATING_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` whose task SIGTERM cancels; the bench then unwinds with
    ``KeyboardInterrupt`` (also when the coroutine swallowed the cancellation)."""

    async def main() -> T:
        global _main_task
        _main_task = asyncio.current_task()
        try:
            if terminating():  # the signal came between two runs
                raise asyncio.CancelledError
            return await coro
        finally:
            _main_task = None

    try:
        result = asyncio.run(main())
    except asyncio.CancelledError:
        if terminating():
            raise KeyboardInterrupt(f"signal {_signal_number}") from None
        raise
    finally:
        coro.close()  # never awaited when the signal came first; a no-op otherwise
    if terminating():
        raise KeyboardInterrupt(f"signal {_signal_number}")
    return result


def install() -> None:
    """Route SIGTERM as described above (main thread only; elsewhere signals cannot be set)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame) -> None:
    global _signal_number
    if _signal_number is not None:  # told twice: stop now
        _give_up()
    _signal_number = signum
    watchdog = threading.Timer(WATCHDOG_S, _give_up)
    watchdog.daemon = True
    watchdog.start()
    task = _main_task
    if task is not None and not task.done():
        # The handler runs between two bytecodes of the loop's own thread; cancel() only
        # schedules, and the no-op callback wakes a loop that is waiting in select().
        task.cancel()
        task.get_loop().call_soon_threadsafe(lambda: None)
        return
    raise KeyboardInterrupt(f"signal {signum}")


def _give_up() -> None:
    with _lock:
        groups = list(_groups)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    os._exit(128 + (_signal_number or signal.SIGTERM))
