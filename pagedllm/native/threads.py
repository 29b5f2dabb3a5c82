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

The thread count is libgomp's: one per core of this process's affinity mask
(``os.sched_getaffinity``), i.e. the cores a container or ``taskset`` grants;
``--num-threads`` / ``EngineConfig.num_threads`` overrides it.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("pagedllm")

SPIN_COUNT = "20000"  # libgomp spin iterations before a waiting thread sleeps
_set_here = False  # whether GOMP_SPINCOUNT in os.environ is pagedllm's default, not the user's


def allowed_cpus() -> int:
    """CPUs this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
