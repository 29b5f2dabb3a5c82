"""work_share.h (the kernels' work sharing) and the native sources' local includes.

The header is compiled into a small OpenMP program: teams of several sizes take the items of
shares of several widths and rounds while one thread is held back, and every item must be
taken exactly once, the held-back thread's share partly by the others (stealing), and each
thread's own items in their static order."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pagedllm.native import build_cache, cpu_ops, quant_ops

NATIVE = Path(cpu_ops.__file__).parent
COMPILER = shutil.which("gcc") or shutil.which("cc")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler")

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "work_share.h"

static void pause_us(long us) {
    struct timespec t = {0, us * 1000};
    nanosleep(&t, 0);
}

/* argv: threads units rounds slow_thread [bounds...]; prints "taken unit round thread own" */
int main(int argc, char **argv) {
    const int threads = atoi(argv[1]);
    const int64_t units = atoll(argv[2]), rounds = atoll(argv[3]);
    const int slow = atoi(argv[4]);
    WorkShare ws;
    if (argc > 5) {
        int64_t *bounds = calloc((size_t)argc, sizeof(int64_t));
        for (int i = 5; i < argc; i++) bounds[i - 5] = atoll(argv[i]);
        work_share_init_bounds(&ws, bounds, argc - 6, rounds);
    } else {
        omp_set_num_threads(threads);
        work_share_init(&ws, units, work_share_threads(units), rounds);
    }
    const int64_t total = units * rounds;
    int *owner = calloc((size_t)total, sizeof(int)), *count = calloc((size_t)total, sizeof(int));
    int *own = calloc((size_t)total, sizeof(int));
    int64_t *at = calloc((size_t)threads, sizeof(int64_t));
    int64_t *seq = calloc((size_t)(threads * total), sizeof(int64_t));
#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num(), nth = omp_get_num_threads();
        WorkItem it;
        while (work_share_next(&ws, me, nth, &it)) {
            const int64_t k = it.round * units + it.unit;
            if (me == slow) pause_us(2000);
#pragma omp atomic
            count[k]++;
            owner[k] = me;
            own[k] = it.own;
            if (it.own) seq[me * total + at[me]++] = k;
        }
    }
    for (int64_t k = 0; k < total; k++)
        printf("taken %lld %lld %d %d %d\n", (long long)(k % units), (long long)(k / units), owner[k], own[k], count[k]);
    for (int t = 0; t < threads; t++) {
        printf("order %d", t);
        for (int64_t i = 0; i < at[t]; i++) printf(" %lld", (long long)seq[t * total + i]);
        printf("\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    if COMPILER is None:
        pytest.skip("no C compiler")
    directory = tmp_path_factory.mktemp("work_share")
    source = directory / "share.c"
    source.write_text(PROGRAM)
    binary = directory / "share"
    subprocess.run([COMPILER, "-O2", "-fopenmp", "-I", str(NATIVE), str(source), "-o", str(binary)],
                   check=True, capture_output=True, text=True, timeout=120)
    return binary


def _run(program, threads, units, rounds, slow, bounds=None):
    args = [str(program), str(threads), str(units), str(rounds), str(slow), *(str(b) for b in bounds or [])]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout.splitlines()
    taken = [tuple(int(v) for v in line.split()[1:]) for line in out if line.startswith("taken")]
    orders = {int(line.split()[1]): [int(v) for v in line.split()[2:]] for line in out if line.startswith("order")}
    return taken, orders


@needs_compiler
@pytest.mark.parametrize("threads,units,rounds", [(2, 18, 1), (2, 96, 3), (3, 7, 2), (4, 60, 1), (2, 1, 4)])
def test_every_item_is_taken_once_and_a_slow_thread_is_helped(program, threads, units, rounds):
    taken, orders = _run(program, threads, units, rounds, slow=1 if threads > 1 else -1)
    assert len(taken) == units * rounds
    assert all(count == 1 for *_, count in taken)
    shares = min(threads, units)
    for thread in range(threads):
        lo, hi = units * thread // shares, units * (thread + 1) // shares
        if shares < threads:  # threads past the last share take from it too: no share is one thread's
            continue
        # a thread's own items are its static share, round after round, in order
        mine = [r * units + u for r in range(rounds) for u in range(lo, hi)]
        assert orders[thread] == mine[: len(orders[thread])]
    slow_lo, slow_hi = units * 1 // shares, units * 2 // shares
    slow_items = [(u, r) for u, r, owner, _, _ in taken if slow_lo <= u < slow_hi]
    if threads > 1 and shares > 1 and (slow_hi - slow_lo) * rounds >= 4:
        # the held-back thread (2 ms per item) cannot have done its whole share itself
        assert any(owner != 1 for u, r, owner, _, _ in taken if slow_lo <= u < slow_hi), slow_items
        stolen = [(u, r) for u, r, owner, own, _ in taken if slow_lo <= u < slow_hi and owner != 1]
        assert all(own == 0 for u, r, owner, own, _ in taken if (u, r) in stolen)


@needs_compiler
def test_a_smaller_team_takes_the_shares_of_missing_threads(program):
    """Shares set up for 5 threads, a team of 2: every item still taken exactly once."""
    taken, _ = _run(program, 2, 23, 2, slow=-1, bounds=[0, 4, 9, 14, 20, 23])
    assert sorted((u, r) for u, r, *_ in taken) == sorted((u, r) for r in range(2) for u in range(23))
    assert all(count == 1 for *_, count in taken)


@needs_compiler
def test_more_shares_than_the_header_keeps(program):
    """70 shares given (WORK_SHARE_MAX is 64): the ones past the last kept join it, nothing is lost."""
    taken, _ = _run(program, 2, 140, 2, slow=-1, bounds=list(range(0, 142, 2)))
    assert sorted((u, r) for u, r, *_ in taken) == sorted((u, r) for r in range(2) for u in range(140))
    assert all(count == 1 for *_, count in taken)


@needs_compiler
def test_uneven_bounds_and_empty_shares(program):
    taken, orders = _run(program, 3, 10, 1, slow=-1, bounds=[0, 0, 9, 10])
    assert sorted(u for u, *_ in taken) == list(range(10))
    assert all(count == 1 for *_, count in taken)


def test_native_source_inlines_local_includes_once(tmp_path):
    (tmp_path / "a.h").write_text("#define A 1\n")
    (tmp_path / "main.c").write_text('#include <stdio.h>\n#include "a.h"\n#include "a.h"\nint x = A;\n')
    text = build_cache.native_source(tmp_path / "main.c")
    assert text.count("#define A 1") == 1
    assert "#include <stdio.h>" in text and '#include "a.h"' not in text
    assert '#line 1 "a.h"' in text and '#line 3 "main.c"' in text and '#line 4 "main.c"' in text


def test_the_kernel_sources_carry_the_header_into_their_build_key():
    """The text compiled (and hashed into the library's name) holds work_share.h's lines, so a
    change to the header rebuilds both libraries."""
    header = (NATIVE / "work_share.h").read_text()
    marker = "static inline int work_share_next("
    assert marker in header
    for module in (cpu_ops, quant_ops):
        text = build_cache.native_source(module._SOURCE_PATH)
        assert marker in text and '#include "work_share.h"' not in text


@needs_compiler
def test_a_native_source_error_names_the_original_file_and_line(tmp_path):
    (tmp_path / "b.h").write_text("int ok;\nint broken = ;\n")
    (tmp_path / "main.c").write_text('#include "b.h"\nint y;\n')
    done = subprocess.run([COMPILER, "-fsyntax-only", "-x", "c", "-"], input=build_cache.native_source(tmp_path / "main.c"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "b.h:2" in done.stderr
