"""OpenMP defaults: a brief spin, so neither an idle machine nor a shared one pays much.

torch's CPU kernels and pagedllm's native ones share one OpenMP (libgomp)
thread pool with one thread per allowed core. Between parallel regions
libgomp's threads spin by default (about 300,000 iterations) before they
sleep. When another process runs on one of those cores, a spinning thread
burns the time slices its preempted partner needs, and every region's barrier
waits for that partner: on 2 cores under a heavy load a small throughput run
took 190.7 s with the default and 32.1 s with ``OMP_WAIT_POLICY=PASSIVE``
(docs/profile.md, "Threads"). Passive waiting costs an idle machine a futex
wake per region instead: one request's decode ran at 22.5 tok/s passive and
29.8 tok/s with a spin of 20,000 iterations (30.1 spinning without limit).
So pagedllm sets ``GOMP_SPINCOUNT=20000`` unless the user chose a policy or a
count: on an idle machine it decodes as fast as spinning; under a load of 3x
the cores it cost about 10% against passive waiting, at 8x about 40%
(docs/profile.md has the table). A shared machine should set
``OMP_WAIT_POLICY=PASSIVE``. libgomp reads the variables once, when it starts
(at ``import torch``), so :func:`set_openmp_defaults` runs when ``pagedllm``
is imported; if torch was imported first it can no longer take effect, and it
says so in the log.

The thread count: one per core of this process's affinity mask
(``os.sched_getaffinity``, i.e. the cores a container or ``taskset`` grants) that
no other process keeps busy when the engine starts (:func:`engine_threads`: each
core's busy share over 50 ms of ``/proc/stat``; over half is taken). A core that
another process holds costs far more than its share: the thread placed beside
that process gets half a core, and every parallel region waits for it. With one
spinning process pinned to one of 2 cores, W64 bfloat16 ran at 165 output tok/s
on two threads and at 389 on one (docs/profile.md, "Nineteenth round").
``--num-threads`` / ``EngineConfig.num_threads`` or ``OMP_NUM_THREADS`` overrides
it. The count is only lowered from that default, so later engines of the process keep
it; a neighbour that starts after the engine is not seen (set the count, or
``OMP_WAIT_POLICY=PASSIVE``, on such a machine).
"""

from __future__ import annotations

import logging
import os
import sys
import time

logger = logging.getLogger("pagedllm")

SPIN_COUNT = "20000"  # libgomp spin iterations before a waiting thread sleeps
_set_here = False  # whether GOMP_SPINCOUNT in os.environ is pagedllm's default, not the user's


def allowed_cpu_list() -> list[int]:
    """The CPUs this process may run on (its affinity mask; every CPU where there is none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def allowed_cpus() -> int:
    """How many CPUs this process may run on (:func:`allowed_cpu_list`)."""
    return len(allowed_cpu_list())


def cpu_busy_shares(cpus: list[int], window_s: float = 0.05) -> dict[int, float] | None:
    """Each of ``cpus``' busy share (not idle, not waiting on I/O) over ``window_s`` seconds
    of ``/proc/stat``; None where that file is missing or unreadable."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(window_s)
    second = _cpu_times()
    if second is None:
        return None
    return {cpu: busy_share(first[cpu], second[cpu]) for cpu in cpus if cpu in first and cpu in second}


def busy_share(before: list[int], after: list[int]) -> float:
    """The busy share between two ``/proc/stat`` lines of one CPU (user nice system idle iowait
    irq softirq steal ...); 0 when no time passed."""
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])
    idle = delta[3] + (delta[4] if len(delta) > 4 else 0)
    return 0.0 if total <= 0 else max(0.0, min(1.0, 1.0 - idle / total))


def _cpu_times() -> dict[int, list[int]] | None:
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    times = {}
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            times[int(name[3:])] = [int(v) for v in values]
    return times


BUSY_ABOVE = 0.5  # a core busy more than this share of the window is taken by another process


def engine_threads(shares: dict[int, float] | None = None) -> int:
    """Threads for an engine whose user chose none: this process's cores less those another
    process keeps busy (``shares``: :func:`cpu_busy_shares` over them, measured here when
    None), at least 1. This process is idle while it measures, so what it sees busy is
    someone else's work."""
    cpus = allowed_cpu_list()
    if shares is None:
        shares = cpu_busy_shares(cpus) if len(cpus) > 1 else None
    if not shares:
        return len(cpus) or 1
    taken = sum(1 for cpu in cpus if shares.get(cpu, 0.0) > BUSY_ABOVE)
    return max(1, len(cpus) - taken)


def set_engine_threads() -> int:
    """Lower torch's (and so OpenMP's) thread count to :func:`engine_threads` while it is still
    the default of one per allowed core (a count someone set, ``OMP_NUM_THREADS`` or this
    function's earlier one included, stays); returns the count in force."""
    import torch

    current = torch.get_num_threads()
    if current != allowed_cpus() or "OMP_NUM_THREADS" in os.environ:
        return current
    threads = engine_threads()
    if threads < current:
        logger.info("%d of this process's %d cores are busy with other work: %d threads "
                    "(--num-threads or OMP_NUM_THREADS sets the count)", current - threads, current, threads)
        torch.set_num_threads(threads)
    return threads


def set_openmp_defaults() -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` unless the user set it or
    ``OMP_WAIT_POLICY``; True when it was set in time, before the OpenMP runtime started."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False  # the user's choice
    global _set_here
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    _set_here = True
    if "torch" in sys.modules:
        logger.debug("torch was imported before pagedllm: GOMP_SPINCOUNT=%s may not take effect", SPIN_COUNT)
        return False
    return True


def without_pagedllm_defaults(env: dict[str, str]) -> dict[str, str]:
    """``env`` less the OpenMP settings pagedllm made itself, for a peer engine's process
    (a benchmark's peer runs with its own defaults, or with what the user set)."""
    if _set_here and env.get("GOMP_SPINCOUNT") == SPIN_COUNT:
        env = {k: v for k, v in env.items() if k != "GOMP_SPINCOUNT"}
    return env
