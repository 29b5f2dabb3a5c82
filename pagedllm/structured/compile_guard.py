"""Bounds on what compiling one grammar may cost, enforced in a child process.

xgrammar compiles most schemas in milliseconds, but some small inputs take
minutes: a JSON schema whose ``pattern`` repeats a group a few thousand
times (``"^[a-z]{50000}$"`` ran past a minute; ``"(ab|cd){3000}"`` takes 5 s)
and the compile cannot be interrupted once it runs. A server would lose a
core and a worker thread to each such request.

So a new grammar is first compiled in a child process, which is killed when
it runs past ``timeout_s`` or needs more than ``memory_bytes`` beyond its
start-up size; only a grammar that compiled within both is then compiled in
the server's own process (the compiled grammar itself is not sent back: its
serialized form grows much faster than the grammar, 35 MB for an object of
300 properties). The trial doubles the compile time of a grammar the first
time it is seen (cached grammars skip both), a few milliseconds for common
schemas. The child starts on the first grammar (about 3 s and about 200 MB
of private memory: xgrammar imports torch), is restarted after a kill, and
is stopped when no new grammar came for IDLE_STOP_S (its memory freed).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the child's imports, on a loaded machine
IDLE_STOP_S = 300.0  # a child with no grammar to check this long is stopped (its memory freed)


@dataclass(frozen=True)
class CompileLimits:
    """``timeout_s``: the most one grammar may take to compile; ``memory_bytes``: the most
    memory its compile may take beyond the compiling process's size."""

    timeout_s: float
    memory_bytes: int


class GrammarTooCostly(Exception):
    """The grammar's trial compile went past a limit; the message says which."""


class CompileGuard:
    """Trial compiles in one child process, one at a time (thread-safe)."""

    def __init__(self, tokenizer_info_json: str, limits: CompileLimits, idle_stop_s: float | None = None) -> None:
        self.limits = limits
        self.idle_stop_s = IDLE_STOP_S if idle_stop_s is None else idle_stop_s
        self._num_checks = 0  # the idle stop's timer checks no check came after it was set
        self._idle_timer: threading.Timer | None = None
        self._info_json = tokenizer_info_json
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self.num_killed = 0  # children killed past a limit (not those stopped when idle)
        self._unavailable = False  # the child could not start: not tried again

    def check(self, kind: str, text: str, any_whitespace: bool) -> None:
        """Returns when the grammar compiles within the limits, or fails to compile at all
        (the caller's own compile then reports why); GrammarTooCostly otherwise."""
        with self._lock:
            self._num_checks += 1
            try:
                self._check(kind, text, any_whitespace)
            finally:
                if self._idle_timer is not None:
                    self._idle_timer.cancel()
                self._idle_timer = None
                if self._process is not None:
                    self._idle_timer = threading.Timer(self.idle_stop_s, self._stop_if_idle, (self._num_checks,))
                    self._idle_timer.daemon = True
                    self._idle_timer.start()

    def _stop_if_idle(self, num_checks: int) -> None:
        with self._lock:
            if self._num_checks == num_checks:  # no check since this timer was set
                self._kill(runaway=False)

    def _check(self, kind: str, text: str, any_whitespace: bool) -> None:
        for _ in range(2):  # a child that died since (its parent thread ended) is started again
            if not self._start():
                return  # no child (logged): compile unguarded rather than refuse every grammar
            try:
                self._send.send((kind, text, any_whitespace))
                break
            except OSError:
                self._kill()
        else:
            return
        if not self._recv.poll(self.limits.timeout_s):
            self._kill()
            raise GrammarTooCostly(f"it took longer than {self.limits.timeout_s:g} s to compile "
                                   "(the server's --grammar-compile-timeout)")
        try:
            status = self._recv.recv()
        except (EOFError, OSError):
            status = "died"
        if status in ("memory", "died"):
            self._kill()
            raise GrammarTooCostly(f"compiling it needs more than {self.limits.memory_bytes} bytes of memory "
                                   "(the server's --grammar-compile-memory)")

    def _start(self) -> bool:
        if self._process is not None and self._process.poll() is None:
            return True
        self._kill()
        if self._unavailable:
            return False
        self._unavailable = True  # until the child answers
        # A plain child process (not multiprocessing's spawn, which would import the server's
        # __main__ again) talking over two pipes with multiprocessing's Connection framing.
        from_parent, to_child = os.pipe()  # (read end, write end)
        from_child, to_parent = os.pipe()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.structured.compile_guard", str(from_parent), str(to_parent),
                 str(self.limits.memory_bytes)],
                pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
            )
        except OSError as exc:
            for fd in (to_child, from_parent, to_parent, from_child):
                os.close(fd)
            logger.error("grammar compile guard: cannot start its process (%s); compiling without limits", exc)
            return False
        os.close(from_parent)
        os.close(to_parent)
        self._process = process
        self._send = Connection(to_child, readable=False)
        self._recv = Connection(from_child, writable=False)
        try:
            self._send.send(self._info_json)
            ready = self._recv.poll(START_TIMEOUT_S) and self._recv.recv() == "ready"
        except (EOFError, OSError) as exc:
            logger.debug("grammar compile guard: %r", exc)
            ready = False
        if not ready:
            logger.error("grammar compile guard: its process did not start; compiling without limits")
            self._kill()
            return False
        self._unavailable = False
        return True

    def _kill(self, runaway: bool = True) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                self.num_killed += runaway
                self._process.kill()
            self._process.wait(5)
            self._send.close()
            self._recv.close()
        self._process = self._send = self._recv = None

    def close(self) -> None:
        with self._lock:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._kill(runaway=False)


def _serve(receive: Connection, send: Connection, memory_bytes: int) -> None:
    """The child: takes the tokenizer info (xgrammar's JSON), answers "ready", then compiles each
    (kind, text, any_whitespace) it is sent and answers "ok", "error" (the grammar does not
    compile) or "memory" (it ran out of its allowance)."""
    import resource
    import signal

    try:  # Linux: die with the server, even mid-compile
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    import xgrammar as xgr

    from pagedllm.structured.grammar import compile_spec
    from pagedllm.structured.params import GrammarSpec

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(receive.recv()), max_threads=1,
                                   cache_enabled=False)
    try:
        with open("/proc/self/statm") as f:  # the address space in use now, in pages
            size = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (size + memory_bytes, resource.RLIM_INFINITY))
    except (OSError, ValueError):
        pass  # no /proc (not Linux): the time limit still holds
    send.send("ready")
    while True:
        try:
            kind, text, any_whitespace = receive.recv()
        except (EOFError, OSError):
            return  # the server is gone
        try:
            compile_spec(compiler, GrammarSpec(kind, text, any_whitespace))
            status = "ok"
        except MemoryError:
            status = "memory"
        except Exception as exc:  # noqa: BLE001 (xgrammar's C++ errors arrive as RuntimeError)
            status = "memory" if "bad_alloc" in str(exc) else "error"
        send.send(status)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
           int(sys.argv[3]))
