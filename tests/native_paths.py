"""The native kernel builds a test runs once each: every ISA path this CPU can run, and, where
the CPU has AMX-BF16, the avx512_bf16 path's vector kernels as a path of their own
("avx512_bf16-vector": the tiles switched off), so both keep their coverage there."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from pagedllm.native import cpu_ops

ISA_PATHS = cpu_ops.cpu_isa_paths() if cpu_ops.available() else []
AMX = "avx512_bf16" in ISA_PATHS and {"amx_tile", "amx_bf16"} <= cpu_ops.cpu_flags()
VECTOR_ON_AMX = "avx512_bf16-vector"
LIBRARY_PARAMS = [*(ISA_PATHS or ["none"]), *([VECTOR_ON_AMX] if AMX else [])]


def built_library(param: str) -> Iterator:
    """The library for one of LIBRARY_PARAMS (a generator, for a fixture to yield from)."""
    if not cpu_ops.available():
        pytest.skip("no C compiler for the native CPU kernels")
    isa = param.removesuffix("-vector")
    try:
        built = cpu_ops.build_library(isa=isa)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"compiler cannot build the {isa} path: {exc}")
    assert built.isa_name().decode() == isa
    if param == VECTOR_ON_AMX:
        with cpu_ops.attention_amx_set(False, built) as on:
            assert not on
            yield built
    else:
        assert bool(built.attention_amx()) == (AMX and isa == "avx512_bf16")
        yield built


def amx_and_vector_outputs(library, query, k_cache, v_cache, metadata, scale, **scales) -> dict:
    """One paged-attention call of ``library`` (an avx512_bf16 build) with the AMX tiles on and
    one with them off: {True: tiles' output, False: vector kernels' output}. ``scales``:
    k_scale and v_scale for 8-bit caches."""
    num_heads, head_dim = query.shape[-2:]
    tiles = cpu_ops.make_tiles(metadata.seq_lens_host, metadata.query_lens_host,
                               cpu_ops.tile_tokens(num_heads, k_cache.shape[-2], head_dim))
    outs = {}
    for on in (True, False):
        with cpu_ops.attention_amx_set(on, library) as now:
            assert now == on
            outs[on] = cpu_ops.paged_attention(query, k_cache, v_cache, metadata.block_tables, tiles, scale,
                                               library=library, **scales)
    return outs
