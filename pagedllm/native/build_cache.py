"""Compile a native library once per source, compiler and flags, into the cache directory.

The file name is keyed on everything that decides the build. Builders of the same key,
in this process or in others (parallel test workers, a server and a bench started
together), take an exclusive lock on the key first: the second waits for the first's
file instead of compiling the same source beside it, which on a small machine doubled
each build's time. The file still appears atomically (``os.replace``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

COMPILE_TIMEOUT_S = 600  # a full build of cpu_ops.c takes about 80 s of one core at -O3

# What GCC 14 and Clang 16 refuse by default, refused here on every compiler, so that an older
# compiler (the tests') fails a source a newer one (a user's) would fail, instead of warning.
STRICT_FLAGS = (
    "-Werror=implicit-function-declaration",
    "-Werror=implicit-int",
    "-Werror=int-conversion",
    "-Werror=incompatible-pointer-types",
)


class BuildError(OSError):
    """The compiler rejected a native source; the message ends with its last diagnostics."""


def compiled(name: str, source: str, compiler: str, flags: list[str], key_extra: tuple[str, ...] = ()) -> Path:
    """The shared library built from ``source`` (C text) with ``compiler`` and ``flags``."""
    from pagedllm.models.paths import cache_dir

    flags = [*flags, *STRICT_FLAGS]
    key = hashlib.sha256("\0".join([source, compiler, *flags, *key_extra]).encode()).hexdigest()[:16]
    directory = cache_dir()  # ~/.cache/pagedllm, or $PAGEDLLM_CACHE
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{name}-{key}.so"
    if target.exists():
        return target
    with open(directory / f"{name}-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # built by whoever held the lock before
            return target
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            source_file = Path(tmp) / f"{name}.c"
            source_file.write_text(source)
            built = Path(tmp) / f"{name}.so"
            done = subprocess.run([compiler, *flags, str(source_file), "-o", str(built), "-lm"],
                                  capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
                raise BuildError(f"{compiler} could not build {name} (exit {done.returncode}): "
                                 + " | ".join(errors[-3:]))
            os.replace(built, target)  # atomic: readers never see a partial file
    return target


def native_source(path: Path) -> str:
    """The C text of ``path`` with each ``#include "name"`` of a file beside it put in its
    place (once per file), so that the text handed to :func:`compiled`, and the key of its
    build, holds every line that goes into the library. ``#line`` directives keep the
    compiler's messages pointing at the original files."""
    seen: set[str] = set()

    def expand(file: Path) -> list[str]:
        out = [f'#line 1 "{file.name}"']
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            words = line.split()
            if len(words) == 2 and words[0] == "#include" and words[1].startswith('"'):
                name = words[1].strip('"')
                if name not in seen:
                    seen.add(name)
                    out += expand(file.with_name(name))
                out.append(f'#line {number + 1} "{file.name}"')
                continue
            out.append(line)
        return out

    return "\n".join(expand(path)) + "\n"
