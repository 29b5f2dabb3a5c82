"""The native CPU kernels against the PyTorch operators they replace.

Each kernel runs once per ISA path this CPU can run (scalar always; avx2,
avx512 and avx512_bf16 where the CPU has them), each path its own build.
float32 results must agree with PyTorch to rounding; bfloat16 results to one
bfloat16 step (the kernels and PyTorch may sum the mean of squares in a
different order). Attention is checked against the dense float64 oracle.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from attention_reference import make_paged_batch, naive_attention
from native_paths import AMX, ISA_PATHS, LIBRARY_PARAMS, amx_and_vector_outputs, built_library

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.errors import ConfigError
from pagedllm.kv.kv_cache import in_layout
from pagedllm.models.llama import rotate
from pagedllm.native import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the native CPU kernels")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=LIBRARY_PARAMS)
def library(request):
    yield from built_library(request.param)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)
    else:  # one bfloat16 step
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-3)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (7, 100), (300, 64)])  # 100: a masked tail
def test_rms_norm_with_and_without_residual(library, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    delta = torch.randn(rows, width, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    _close(cpu_ops.rms_norm(x.clone(), None, weight, 1e-5, library=library), _torch_rms_norm(x, weight, 1e-5))
    residual = x.clone()
    out = cpu_ops.rms_norm(residual, delta, weight, 1e-5, library=library)
    assert torch.equal(residual, x + delta)  # the add is rounded once, as PyTorch does
    _close(out, _torch_rms_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1536), (70, 40), (3, 17)])
def test_silu_mul(library, dtype, rows, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (4 * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # far tails of the exponential
    gate, up = gate_up.split(width, dim=-1)
    _close(cpu_ops.silu_mul(gate_up, library=library), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_rows(library, dtype):
    gen = torch.Generator().manual_seed(5)
    rows, heads, head_dim, extra = 9, 5, 64, 3
    buffer = torch.randn(rows, (heads + extra) * head_dim, generator=gen).to(dtype)
    x = buffer[:, : heads * head_dim].view(rows, heads, head_dim)  # row stride > heads * head_dim
    positions = torch.tensor([0, 1, 2, 50, 7, 7, 100, 3, 9])
    angles = torch.arange(128).float()[:, None] * (1e-4 ** (torch.arange(0, head_dim, 2) / head_dim))[None]
    cos_table, sin_table = angles.cos(), angles.sin()
    untouched = buffer[:, heads * head_dim :].clone()
    expected = rotate(x.float(), cos_table[positions][:, None], sin_table[positions][:, None]).to(dtype)
    cpu_ops.rotary_(x, positions, cos_table, sin_table, library=library)
    _close(x, expected)
    assert torch.equal(buffer[:, heads * head_dim :], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_padding(library, dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 2, 16
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(5, 3 * kv_heads * head_dim).to(dtype)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(5, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(5, kv_heads, head_dim)
    slots = torch.tensor([3, -1, 22, 0, -1])
    cpu_ops.write_kv(key, value, k_cache, v_cache, slots, library=library)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[t]) and torch.equal(flat_v[slot], value[t])
    assert torch.count_nonzero(flat_k.flatten(1).any(1)) == 3


@pytest.mark.parametrize("width", [49152, 1000, 5])
def test_argmax_logsumexp(library, width):
    gen = torch.Generator().manual_seed(width)
    logits = 10 * torch.randn(6, width, generator=gen)
    logits[1] = 0.0  # all tied: the first index wins, as torch.argmax
    logits[2, width // 2 :] = logits[2].max() + 1  # a tie of the maximum in later lanes
    logits[3, -1] = 1e4  # maximum in the masked tail
    argmax, lse = cpu_ops.argmax_logsumexp(logits, library=library)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_native_and_torch_paths_agree(dtype):
    cache_shape = (8, 16, 3, 64)
    key, value = torch.randn(20, 3, 64).to(dtype), torch.randn(20, 3, 64).to(dtype)
    slots = torch.randperm(128)[:20]
    slots[4] = -1
    caches = []
    for use_native in (True, False):
        k_cache, v_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
        TorchAttentionBackend(use_native=use_native).write_kv(key, value, k_cache, v_cache, slots)
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_rotary_rejects_positions_past_the_table():
    """The native path reads the cos/sin tables by position without bounds checks of
    its own, so the step refuses positions the tables do not have."""
    from pagedllm.models.config import ModelConfig
    from pagedllm.models.llama import rotary_embedding

    config = ModelConfig.from_hf_config(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 100, "max_position_embeddings": 32, "rms_norm_eps": 1e-5}
    )
    rotary = rotary_embedding(config)
    rotary.bind(torch.device("cpu"), torch.float32)
    like = torch.zeros(2, 64)
    with torch.inference_mode():
        rotary.for_step(torch.tensor([0, 31]), like)  # the last position is fine
        with pytest.raises(ValueError, match="rotary positions"):
            rotary.for_step(torch.tensor([3, 32]), like)


# ---------------------------------------------------------------- attention per ISA path

ATTENTION_SPECS = [(0, 37), (50, 1), (333, 1), (15, 1), (20, 17), (0, 1), (7, 9)]  # (context, new tokens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads,head_dim",
    [(16, 9, 3, 64), (8, 8, 2, 128), (32, 4, 4, 32), (16, 6, 1, 48)],
)
def test_paged_attention_matches_oracle(library, dtype, block_size, num_heads, num_kv_heads, head_dim):
    """Prefill chunks (causal), decode rows and prefix-hit chunks in one call, per path.
    Block sizes 8/16/32 put chunk ends inside and at a vector's width."""
    if head_dim % library.vector_width():
        pytest.skip("head_dim not a multiple of this path's vector width (cpu_ops.supports refuses it)")
    batch = make_paged_batch(
        ATTENTION_SPECS, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, seed=block_size + head_dim,
    )
    md = batch.metadata
    TorchAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    per_tile = cpu_ops.tile_tokens(num_heads, num_kv_heads, head_dim)
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, per_tile)
    expected = naive_attention(batch.query.double(), batch)
    for split_heads in (True, False):
        out = cpu_ops.paged_attention(
            batch.query, batch.k_cache, batch.v_cache, md.block_tables, tiles, batch.scale,
            library=library, split_heads=split_heads,
        )
        assert out.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
        assert (out.double() - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("kv_layout", ["token", "head"])
def test_paged_attention_never_reads_unwritten_slots(library, dtype, block_size, kv_layout):
    """The CPU pools are allocated uninitialised: every slot past a sequence's length holds NaN
    here, and on every path and in both pool layouts none of it reaches the output, with chunks
    that end at odd lengths (the bfloat16 pair kernels take value rows two tokens at a time; the
    head layout reads a short chunk's float32 keys in place, its lanes past the end included)."""
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    batch = make_paged_batch(
        ATTENTION_SPECS, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, seed=block_size + 7,
    )
    md = batch.metadata
    k_cache, v_cache = torch.full_like(batch.k_cache, float("nan")), torch.full_like(batch.v_cache, float("nan"))
    for i, (seq_len, q_len) in enumerate(zip(md.seq_lens_host, md.query_lens_host, strict=True)):
        for pos in range(seq_len - q_len):  # the context already written; the new tokens come next
            block, offset = md.block_tables[i, pos // block_size].item(), pos % block_size
            k_cache[block, offset], v_cache[block, offset] = batch.k_cache[block, offset], batch.v_cache[block, offset]
    k_cache, v_cache = in_layout(k_cache, kv_layout, values=False), in_layout(v_cache, kv_layout, values=True)
    batch.k_cache, batch.v_cache = k_cache, v_cache
    TorchAttentionBackend().write_kv(batch.new_key, batch.new_value, k_cache, v_cache, md.slot_mapping)
    expected_layout = cpu_ops.KV_LAYOUT_HEAD if kv_layout == "head" else cpu_ops.KV_LAYOUT_TOKEN
    assert cpu_ops.kv_layout(k_cache, v_cache) == expected_layout
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host,
                               cpu_ops.tile_tokens(num_heads, num_kv_heads, head_dim))
    expected = naive_attention(batch.query.double(), batch)
    for split_heads in (True, False):
        out = cpu_ops.paged_attention(batch.query, k_cache, v_cache, md.block_tables, tiles, batch.scale,
                                      library=library, split_heads=split_heads)
        assert torch.isfinite(out).all()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out.double() - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", [(16, 9, 3, 64), (8, 8, 2, 128), (32, 4, 4, 32)])
@pytest.mark.parametrize("length", [70, 600])
def test_a_rows_attention_is_the_same_bits_in_any_tile(library, dtype, block_size, num_heads, num_kv_heads, head_dim,
                                                       length):
    """A position's output as a decode token, in a prefill tile and in a later prefill chunk
    (a recompute after preemption re-prefills what was decoded) is equal bit for bit. At 600
    tokens rows see up to three key segments (cpu_ops.c SEG_KEYS), merged after one another:
    a decode token's segments as separate work items (split_heads) or on one thread."""
    if head_dim % library.vector_width():
        pytest.skip("head_dim not a multiple of this path's vector width (cpu_ops.supports refuses it)")
    batch = make_paged_batch([(0, length)], block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, seed=3)
    md = batch.metadata
    TorchAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    per_tile = cpu_ops.tile_tokens(num_heads, num_kv_heads, head_dim)

    def attend(first: int, count: int) -> torch.Tensor:  # positions [first, first + count) as one chunk
        tiles = cpu_ops.make_tiles([first + count], [count], per_tile)
        return cpu_ops.paged_attention(batch.query[first : first + count].contiguous(), batch.k_cache,
                                       batch.v_cache, md.block_tables, tiles, batch.scale, library=library)

    whole = attend(0, length)
    later_chunk = attend(23, length - 23)
    assert torch.equal(later_chunk, whole[23:])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (whole.double() - naive_attention(batch.query.double(), batch)).abs().max().item() <= tolerance
    positions = (0, 5, 15, 16, 31, 47, length - 1) + ((255, 256, 257, 300, 511, 512, 513) if length > 512 else ())
    for position in positions:
        assert torch.equal(attend(position, 1)[0], whole[position]), position
        tiles = cpu_ops.make_tiles([position + 1], [1], per_tile)
        split = cpu_ops.paged_attention(batch.query[position : position + 1].contiguous(), batch.k_cache,
                                        batch.v_cache, md.block_tables, tiles, batch.scale, library=library,
                                        split_heads=True)
        assert torch.equal(split[0], whole[position]), position


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (8, 8, 32), (6, 1, 48)])
def test_decode_heads_together_or_one_by_one_give_the_same_bits(library, dtype, num_heads, num_kv_heads, head_dim):
    """A decode tile takes its KV heads together, block by block (one work item per tile),
    or one KV head per work item (split_heads): every row sees the same chunks in the
    same order either way, so the outputs are equal bit for bit, and match the oracle."""
    if head_dim % library.vector_width():
        pytest.skip("head_dim not a multiple of this path's vector width (cpu_ops.supports refuses it)")
    specs = [(context, 1) for context in (333, 64, 1, 17, 130, 95, 240, 3, 48, 200)]
    batch = make_paged_batch(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, seed=head_dim)
    md = batch.metadata
    TorchAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, 1)
    together, one_by_one = (
        cpu_ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, tiles, batch.scale,
                                library=library, split_heads=split)
        for split in (False, True)
    )
    assert torch.equal(together, one_by_one)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (together.double() - naive_attention(batch.query.double(), batch)).abs().max().item() <= tolerance
    # a decode-only call splits its tiles into runs by thread (each thread prefetching its next
    # tile's first blocks): one thread or three, the same bits
    previous = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            again = cpu_ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, md.block_tables, tiles,
                                            batch.scale, library=library)
            assert torch.equal(again, together), threads
    finally:
        torch.set_num_threads(previous)


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX-BF16 tiles")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 32), (24, 1, 64)])
def test_amx_and_vector_attention_agree_and_the_tiles_really_run(num_heads, num_kv_heads, head_dim):
    """bfloat16 attention on AMX tiles (prefill tiles of many rows, decode rows, rows of 17+ query
    heads per KV head that take two passes) against the same path's vector kernels and the
    oracle: within bfloat16's rounding of each other, yet not the same bits (the tiles ran)."""
    library = cpu_ops.build_library(isa="avx512_bf16")
    specs = [(0, 37), (50, 1), (333, 1), (15, 1), (20, 17), (0, 1), (7, 9), (130, 40)]
    batch = make_paged_batch(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=torch.bfloat16, seed=head_dim + num_heads)
    md = batch.metadata
    TorchAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    outs = amx_and_vector_outputs(library, batch.query, batch.k_cache, batch.v_cache, md, batch.scale)
    expected = naive_attention(batch.query.double(), batch)
    for out in outs.values():
        assert (out.double() - expected).abs().max().item() <= 2e-2
    assert (outs[True].double() - outs[False].double()).abs().max().item() <= 2e-2
    assert not torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("setting", ["0", None])
def test_attention_amx_env_var(setting):
    """PAGEDLLM_ATTENTION_AMX=0 keeps bfloat16 attention on the vector kernels; by default the
    tiles take it exactly where the CPU has them (and the path is avx512_bf16)."""
    env = {k: v for k, v in os.environ.items() if k != cpu_ops.ATTENTION_AMX_ENV}
    if setting is not None:
        env[cpu_ops.ATTENTION_AMX_ENV] = setting
    code = "from pagedllm.native import cpu_ops; print(cpu_ops.attention_amx(), cpu_ops.selected_isa())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    on, isa = done.stdout.split()
    assert on == str(setting is None and AMX and isa == "avx512_bf16")


# ---------------------------------------------------------------- dispatch


def test_cpu_reports_scalar_and_best_path_is_the_default(monkeypatch):
    monkeypatch.delenv(cpu_ops.ISA_ENV, raising=False)
    assert ISA_PATHS[0] == "scalar"
    assert list(ISA_PATHS) == [isa for isa in cpu_ops.ISA_PATHS if isa in ISA_PATHS]  # cheapest first
    assert cpu_ops.requested_isa() == ISA_PATHS[-1]
    flags = cpu_ops.cpu_flags()
    assert ("avx2" in ISA_PATHS) == ({"avx2", "fma", "f16c"} <= flags) or not flags


@pytest.mark.parametrize("isa", ISA_PATHS)
def test_env_var_forces_the_loaded_path(isa):
    """A fresh process with PAGEDLLM_CPU_ISA set loads that path and computes with it."""
    code = (
        "import torch; from pagedllm.native import cpu_ops; assert cpu_ops.available(); "
        "x = torch.randn(3, 100); a, _ = cpu_ops.argmax_logsumexp(x); "
        "assert torch.equal(a, x.argmax(-1)); print(cpu_ops.selected_isa(), cpu_ops.vectorized())"
    )
    env = {**os.environ, cpu_ops.ISA_ENV: isa}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [isa, str(isa != "scalar")]


@pytest.mark.parametrize("isa", ISA_PATHS)
def test_a_forced_machine_class_forces_the_packed_matmuls_too(isa):
    """pagedllm@ISA's environment (isa_environment): a CPU class without AVX-512 gets that
    class's packed-matmul path as well, so the whole run is what such a CPU runs; the AVX-512
    classes leave the matmuls their best path."""
    from pagedllm.native import quant_ops

    code = (
        "from pagedllm.native import cpu_ops, quant_ops; assert cpu_ops.available(); "
        "print(cpu_ops.selected_isa(), quant_ops.available() and quant_ops.ISA_NAMES[quant_ops.isa()])"
    )
    env = {key: value for key, value in os.environ.items() if key != quant_ops.ISA_ENV}
    env.update(cpu_ops.isa_environment(isa))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    selected, matmuls = done.stdout.split()
    assert selected == isa
    if quant_ops.available():
        best = quant_ops.ISA_NAMES[quant_ops.runnable_isas()[-1]]
        assert matmuls == {"scalar": "portable", "avx2": "avx2"}.get(isa, best)


def test_unknown_or_unsupported_path_is_a_config_error(monkeypatch):
    monkeypatch.setenv(cpu_ops.ISA_ENV, "sse9")
    with pytest.raises(ConfigError, match="not a kernel path.*scalar, avx2, avx512, avx512_bf16"):
        cpu_ops.requested_isa()
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma", "f16c"}))
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(cpu_ops.ISA_ENV, "avx512")
    with pytest.raises(ConfigError, match="lacks avx512bw, avx512dq, avx512f, avx512vl; it runs scalar, avx2"):
        cpu_ops.requested_isa()
    monkeypatch.setenv(cpu_ops.ISA_ENV, "AVX2")  # case does not matter
    assert cpu_ops.requested_isa() == "avx2"


def test_using_isa_swaps_the_loaded_kernels_and_restores_them():
    before = cpu_ops.selected_isa()
    with cpu_ops.using_isa("scalar") as library:
        assert cpu_ops.selected_isa() == "scalar" and not cpu_ops.vectorized()
        assert library.vector_width() == 1
    assert cpu_ops.selected_isa() == before


# ---------------------------------------------------------------- dtype by what the CPU does


def test_native_matmul_probe_follows_onednn():
    from pagedllm.native import cpu_dtype

    assert cpu_dtype.native_matmul(torch.float32)
    assert cpu_dtype.native_matmul(torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_emulated_bfloat16_is_announced_and_auto_stays_float32(monkeypatch):
    """On a CPU without native bf16 matmuls, asking for bf16 warns with the reason and
    the fix; auto and float32 stay silent and resolve to float32."""
    import warnings

    from pagedllm.engine.llm_engine import resolve_dtype
    from pagedllm.native import cpu_dtype

    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_dtype, "native_matmul", lambda dtype: dtype == torch.float32)
    with pytest.warns(RuntimeWarning, match=r"no native bfloat16 matmul.*20x slower.*dtype='float32'"):
        assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.warns(RuntimeWarning, match="no native float16 matmul"):
        resolve_dtype("float16", cpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_dtype("auto", cpu) == torch.float32
        assert resolve_dtype("float32", cpu) == torch.float32
        # packed weights: the matmuls run the integer kernels, nothing to warn about
        assert resolve_dtype("bfloat16", cpu, dense=False) == torch.bfloat16
    monkeypatch.setattr(cpu_dtype, "native_matmul", lambda dtype: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_dtype("bfloat16", cpu) == torch.bfloat16  # native: no warning


def test_benchmark_environment_names_the_machine_class():
    from pagedllm.bench import report

    env = report.environment()
    assert env["native_isa"] == cpu_ops.requested_isa()
    assert env["native_isa_paths"] == list(ISA_PATHS)
    assert env["cpu_model"] and isinstance(env["cpu_isa_flags"], list)
    if "avx2" in ISA_PATHS:
        assert {"avx2", "fma"} <= set(env["cpu_isa_flags"])
    assert env["bf16_matmul_native"] == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    from pagedllm.native import quant_ops

    if quant_ops.available():  # the packed matmuls' path, which PAGEDLLM_QUANT_ISA forces apart
        assert env["quant_isa"] == quant_ops.ISA_NAMES[quant_ops.isa()]
    else:
        assert env["quant_isa"] is None


# ---------------------------------------------------------------- threads


@pytest.mark.parametrize("user_env", [{}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "300000"}])
def test_importing_pagedllm_sets_a_brief_openmp_spin_unless_the_user_chose(user_env):
    from pagedllm.native.threads import SPIN_COUNT

    code = (
        "import os, pagedllm, torch; from pagedllm.bench.peers import vllm_env; peer = vllm_env(); "
        "print(*(os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')), "
        "*(peer.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(user_env)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    policy, spin, peer_policy, peer_spin = done.stdout.split()
    if user_env:  # the user's choice, for pagedllm and its peers alike
        expected = (user_env.get("OMP_WAIT_POLICY", "None"), user_env.get("GOMP_SPINCOUNT", "None"))
        assert (policy, spin) == (peer_policy, peer_spin) == expected
    else:
        assert (policy, spin) == ("None", SPIN_COUNT)
        assert (peer_policy, peer_spin) == ("None", "None")  # the peer keeps its own default


def test_bench_compare_names_a_forced_path_or_says_what_is_allowed():
    import argparse

    from pagedllm.bench import throughput

    args = argparse.Namespace(compare="pagedllm@avx3", hf_batch_size=8, peer_python=None, warmup=False)
    with pytest.raises(ConfigError, match=r"pagedllm@ISA with ISA one of \['scalar', 'avx2', 'avx512', 'avx512_bf16'\]"):
        throughput.compare(args, workload=None)
    args.compare = "vllm@avx2"  # only pagedllm's kernels can be forced
    with pytest.raises(ConfigError, match="vllm@avx2"):
        throughput.compare(args, workload=None)
