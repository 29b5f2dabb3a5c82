"""SIGTERM to a bench: its coroutine is cancelled and unwinds, and a watchdog bounds it all.

Each case runs a small program in its own process (signal handlers are per process) and
sends it a real SIGTERM once the program says it is ready.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from pagedllm.bench.serve import live_group_members

PRELUDE = textwrap.dedent(
    """
    import asyncio, subprocess, sys, time
    from pagedllm.bench import stopping

    def ready():
        print("ready", flush=True)

    stopping.install()
    """
)


def _run(body: str, signals: int = 1, timeout_s: float = 60.0) -> tuple[int, str, float]:
    """Run PRELUDE + body; SIGTERM it ``signals`` times after it prints "ready".
    Returns (exit code, its output, seconds from the first signal to its exit)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == "ready":
            break
    else:
        proc.wait()
        raise AssertionError("the program ended before it was ready:\n" + "".join(lines))
    start = time.monotonic()
    for _ in range(signals):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
    return proc.returncode, "".join(lines) + out, time.monotonic() - start


def test_sigterm_cancels_the_running_coroutine_and_unwinds_it():
    code, out, took = _run(
        """
        async def load():
            try:
                ready()
                await asyncio.sleep(600)
            except asyncio.CancelledError:
                print("cancelled", flush=True)
                raise
            finally:
                print("finally", flush=True)

        try:
            stopping.run_async(load())
        except KeyboardInterrupt as exc:
            print("interrupted:", exc, flush=True)
            sys.exit(130)
        print("returned normally", flush=True)
        """
    )
    assert code == 130, out
    assert "cancelled" in out and "finally" in out and "interrupted: signal 15" in out
    assert "returned normally" not in out
    assert took < 10


def test_a_coroutine_that_swallows_the_cancellation_still_ends_the_bench():
    code, out, _ = _run(
        """
        async def load():
            ready()
            try:
                await asyncio.sleep(600)
            except asyncio.CancelledError:
                return "swallowed"

        try:
            print(stopping.run_async(load()), flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
        """
    )
    assert code == 130, out
    assert "swallowed" not in out and "interrupted" in out


def test_sigterm_outside_a_coroutine_interrupts_at_once():
    code, out, took = _run(
        """
        try:
            ready()
            time.sleep(600)
        except KeyboardInterrupt as exc:
            print("interrupted:", exc, flush=True)
            sys.exit(130)
        """
    )
    assert code == 130 and "interrupted: signal 15" in out, out
    assert took < 10


def test_a_coroutine_started_after_the_signal_does_not_run():
    code, out, _ = _run(
        """
        async def load():
            print("ran", flush=True)

        try:
            ready()
            time.sleep(600)
        except KeyboardInterrupt:
            pass  # a careless caller that goes on to the next phase
        try:
            stopping.run_async(load())
        except KeyboardInterrupt:
            sys.exit(130)
        """
    )
    assert code == 130 and "ran" not in out, out


def _stuck_program(watchdog_s: float) -> str:
    """A bench that ignores every interrupt, with a registered server group (a sleep). It says
    it is ready inside the loop that swallows the interrupts, so a signal that comes at once
    cannot end it before it is stuck."""
    return f"""
        stopping.WATCHDOG_S = {watchdog_s}
        server = subprocess.Popen(["sleep", "600"], start_new_session=True, stdout=subprocess.DEVNULL)
        stopping.register_group(server.pid)
        print("server", server.pid, flush=True)
        said = False
        while True:
            try:
                if not said:
                    said = True
                    ready()
                time.sleep(600)
            except KeyboardInterrupt:
                pass  # stuck: nothing unwinds
        """


def test_the_watchdog_kills_the_servers_and_exits_when_unwinding_hangs():
    code, out, took = _run(_stuck_program(watchdog_s=2.0))
    pid = int(next(line.split()[1] for line in out.splitlines() if line.startswith("server ")))
    assert code == 128 + signal.SIGTERM, out
    assert 1.5 < took < 20
    assert _gone(pid), "the registered server group outlived the bench"


def test_a_second_sigterm_exits_at_once():
    code, out, took = _run(_stuck_program(watchdog_s=600.0), signals=2)
    pid = int(next(line.split()[1] for line in out.splitlines() if line.startswith("server ")))
    assert code == 128 + signal.SIGTERM, out
    assert took < 10
    assert _gone(pid)


# A bench running a peer in its own process group: a shell whose child (a sleep) is a
# grandchild of the bench, as vLLM's engine processes are of its offline script.
PEER = textwrap.dedent("""
    with stopping.process_group(["bash", "-c", "sleep 600 & wait"]) as peer:
        print("group", peer.pid, flush=True)
        time.sleep(0.5)  # the shell has started its child
        THEN
    print("left the block", flush=True)
""")


def _group_of(out: str) -> int:
    return int(next(line.split()[1] for line in out.splitlines() if line.startswith("group ")))


def _gone(pgid: int) -> bool:
    deadline = time.monotonic() + 10
    while live_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not live_group_members(pgid)


def test_sigterm_kills_a_peer_process_group_with_its_children():
    program = "try:\n" + textwrap.indent(PEER.replace("THEN", "ready(); time.sleep(600)"), "    ") + (
        "except KeyboardInterrupt:\n    sys.exit(130)\n"
    )
    code, out, took = _run(program)
    assert code == 130, out
    assert "left the block" not in out and took < 10
    assert _gone(_group_of(out)), "the peer's process group outlived the bench"


def test_a_peer_group_that_outlives_its_leader_is_cleaned_up_after_a_normal_exit():
    # the leader ends, its child does not; the block then ends normally
    code, out, _ = _run(PEER.replace("THEN", "peer.terminate(); peer.wait()") + "ready()\ntime.sleep(600)\n")
    assert "left the block" in out
    assert _gone(_group_of(out)), "a member that outlived the peer's leader was left running"


def test_sigterm_passes_through_a_child_bench_to_the_peer_group_it_started(tmp_path):
    """A bench that runs each backend in a child bench process (``run_child``): SIGTERM to the
    parent reaches the child as SIGTERM, and the child kills the peer group it started."""
    group_file = tmp_path / "group"
    child = PRELUDE + textwrap.dedent(f"""
        with stopping.process_group(["bash", "-c", "sleep 600 & wait"]) as peer:
            open({str(group_file)!r}, "w").write(str(peer.pid))
            time.sleep(600)
        """)
    code, out, took = _run(
        f"""
        import pathlib
        ready_file = pathlib.Path({str(group_file)!r})
        try:
            import threading
            def announce():
                while not ready_file.exists():
                    time.sleep(0.05)
                time.sleep(0.3)
                ready()
            threading.Thread(target=announce, daemon=True).start()
            stopping.run_child([sys.executable, "-c", {child!r}])
        except KeyboardInterrupt:
            sys.exit(130)
        """
    )
    assert code == 130, out
    assert took < 30
    assert _gone(int(group_file.read_text())), "the child bench's peer group outlived the parent"
