"""The native sources build on the compilers users have, not only on this machine's.

GCC 14 and Clang 16 turn some old warnings into errors (an implicit function
declaration among them); build_cache refuses the same on every compiler, so a
source that a newer compiler would reject fails here too, and a failed build
says what the compiler said.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from pagedllm.native import build_cache, cpu_ops, quant_ops

COMPILER = cpu_ops._compiler()
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler")


@needs_compiler
def test_a_rejected_source_raises_build_error_with_the_compilers_words(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    source = "int f(void) { return undeclared_function(3); }\n"  # a warning only, without the strict flags
    with pytest.raises(build_cache.BuildError, match="undeclared_function") as caught:
        build_cache.compiled("probe", source, COMPILER, ["-O0", "-fPIC", "-shared", "-std=c11"])
    assert isinstance(caught.value, OSError)  # what the kernel loaders catch to fall back
    assert not list(tmp_path.glob("probe-*.so"))  # nothing half-built left in the cache


@needs_compiler
def test_a_clean_source_builds_and_loads(tmp_path, monkeypatch):
    import ctypes

    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    path = build_cache.compiled("probe", "int twice(int x) { return 2 * x; }\n", COMPILER,
                                ["-O1", "-fPIC", "-shared", "-std=c11"])
    assert ctypes.CDLL(str(path)).twice(21) == 42


def _syntax_check(source: str, flags: list[str]) -> subprocess.CompletedProcess:
    flags = [f for f in flags if f not in ("-shared", "-O3")]
    return subprocess.run([COMPILER, *flags, *build_cache.STRICT_FLAGS, "-fsyntax-only", "-x", "c", "-"],
                          input=source, capture_output=True, text=True, timeout=300)


@needs_compiler
@pytest.mark.parametrize("isa", cpu_ops.ISA_PATHS)
def test_every_cpu_kernel_path_passes_the_strict_flags(isa):
    """Every ISA path, the ones this CPU cannot run included (an AVX2 machine checks the AVX-512
    and AMX code its users' compilers will see)."""
    done = _syntax_check(build_cache.native_source(cpu_ops._SOURCE_PATH), cpu_ops.compile_flags(isa))
    assert done.returncode == 0, done.stderr[-2000:]


@needs_compiler
def test_the_quantized_kernels_pass_the_strict_flags():
    done = _syntax_check(build_cache.native_source(quant_ops._SOURCE_PATH), list(quant_ops.COMPILE_FLAGS))
    assert done.returncode == 0, done.stderr[-2000:]


CROSS_ARM = shutil.which("aarch64-linux-gnu-gcc")


@pytest.mark.skipif(CROSS_ARM is None, reason="no aarch64 cross compiler (apt install gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("name", ["cpu_ops", "quant_ops"])
def test_the_portable_kernels_build_for_arm(name):
    """An ARM machine builds the scalar attention path and the portable quantized kernels: no x86
    header or intrinsic may leak out of its guards."""
    module = cpu_ops if name == "cpu_ops" else quant_ops
    flags = cpu_ops.compile_flags("scalar") if name == "cpu_ops" else list(quant_ops.COMPILE_FLAGS)
    flags = [f for f in flags if f not in ("-shared", "-O3")]
    done = subprocess.run([CROSS_ARM, *flags, *build_cache.STRICT_FLAGS, "-Wall", "-fsyntax-only", "-x", "c", "-"],
                          input=build_cache.native_source(module._SOURCE_PATH), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr[-2000:]
