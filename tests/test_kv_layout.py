"""The two physical layouts of the CPU KV pools (cpu_ops.c's KV_LAYOUT_TOKEN and KV_LAYOUT_HEAD).

The oracle for the head layout is the token layout: the same logical cache, written and read by
every native path this CPU runs, by the torch reference path and by the block moves of the
tiers, must give the same bits."""

from __future__ import annotations

import pytest
import torch
from attention_reference import make_paged_batch, naive_attention
from kv_quant_reference import FORMATS
from native_paths import LIBRARY_PARAMS, built_library

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.errors import ConfigError
from pagedllm.kv import tiers
from pagedllm.kv.kv_cache import KVCache, in_layout
from pagedllm.kv.kv_format import as_bytes
from pagedllm.native import cpu_ops

CODES = list(FORMATS.values())


@pytest.fixture(scope="module", params=LIBRARY_PARAMS)
def library(request):
    yield from built_library(request.param)


def head_layout(cache: torch.Tensor, values: bool) -> torch.Tensor:
    """A KV_LAYOUT_HEAD pool (as KVCache builds one) holding ``cache``'s logical contents."""
    return in_layout(cache, "head", values)


def test_kv_cache_builds_the_head_layout_as_permuted_views():
    cache = KVCache(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=3, head_dim=64,
                    dtype=torch.float32, device="cpu", layout="head")
    k, v = cache.layers[0]
    assert k.shape == v.shape == (5, 16, 3, 64)
    assert k.stride() == (3072, 1, 1024, 16) and v.stride() == (3072, 64, 1024, 1)
    assert cpu_ops.kv_layout(k, v) == cpu_ops.KV_LAYOUT_HEAD
    token = KVCache(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=3, head_dim=64,
                    dtype=torch.float32, device="cpu")
    assert cpu_ops.kv_layout(*token.layers[0]) == cpu_ops.KV_LAYOUT_TOKEN
    with pytest.raises(ValueError, match="layout"):
        KVCache(num_layers=1, num_blocks=1, block_size=16, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                device="cpu", layout="blocked")


def test_a_layout_is_recognised_only_when_both_pools_have_it():
    k = torch.zeros(4, 16, 3, 64)
    hk, hv = head_layout(k, values=False), head_layout(k, values=True)
    assert cpu_ops.kv_layout(hk, hv) == cpu_ops.KV_LAYOUT_HEAD
    assert cpu_ops.kv_layout(k, hv) is None and cpu_ops.kv_layout(hk, k) is None
    assert cpu_ops.kv_layout(hv, hk) is None  # keys and values swapped
    assert cpu_ops.kv_layout(k.transpose(2, 3).contiguous().transpose(2, 3), k) is None
    # one KV head: the head layout's values lie as the token layout's, keys do not
    k1 = torch.zeros(4, 16, 1, 64)
    assert cpu_ops.kv_layout(head_layout(k1, values=False), head_layout(k1, values=True)) == cpu_ops.KV_LAYOUT_HEAD


def _batch(specs, dtype, block_size, num_heads, num_kv_heads, head_dim, seed):
    return make_paged_batch(specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype=dtype, seed=seed)


SHAPES = [(16, 9, 3, 64), (8, 8, 2, 128), (32, 4, 4, 32), (4, 6, 1, 48), (12, 4, 2, 16)]
SPECS = [(0, 37), (50, 1), (333, 1), (15, 1), (20, 17), (0, 1), (7, 9)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", SHAPES)
def test_float_caches_give_the_same_bits_in_both_layouts(library, dtype, block_size, num_heads, num_kv_heads,
                                                         head_dim):
    """Writes and attention of every tile kind (prefill, decode, a prefix hit), whole and short chunks."""
    if head_dim % library.vector_width():
        pytest.skip("head_dim not a multiple of this path's vector width (cpu_ops.supports refuses it)")
    batch = _batch(SPECS, dtype, block_size, num_heads, num_kv_heads, head_dim, seed=block_size)
    md = batch.metadata
    hk, hv = head_layout(batch.k_cache, values=False), head_layout(batch.v_cache, values=True)
    cpu_ops.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping, library=library)
    cpu_ops.write_kv(batch.new_key, batch.new_value, hk, hv, md.slot_mapping, library=library)
    assert torch.equal(hk, batch.k_cache) and torch.equal(hv, batch.v_cache)
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host,
                               cpu_ops.tile_tokens(num_heads, num_kv_heads, head_dim))
    for split_heads in (True, False):
        token, head = (
            cpu_ops.paged_attention(batch.query, k, v, md.block_tables, tiles, batch.scale, library=library,
                                    split_heads=split_heads)
            for k, v in ((batch.k_cache, batch.v_cache), (hk, hv))
        )
        assert torch.equal(head, token), split_heads
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (head.double() - naive_attention(batch.query.double(), batch)).abs().max().item() <= tolerance


@pytest.mark.parametrize("code_dtype", CODES, ids=list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", [(16, 9, 3, 64), (4, 8, 2, 32)])
def test_8bit_caches_give_the_same_bits_in_both_layouts(library, code_dtype, dtype, block_size, num_heads,
                                                        num_kv_heads, head_dim):
    if head_dim % library.vector_width():
        pytest.skip("head_dim not a multiple of this path's vector width (cpu_ops.supports refuses it)")
    batch = _batch(SPECS, dtype, block_size, num_heads, num_kv_heads, head_dim, seed=7)
    md = batch.metadata
    gen = torch.Generator().manual_seed(1)
    shape = batch.k_cache.shape
    k = torch.randint(-100, 100, shape, generator=gen, dtype=torch.int8).view(code_dtype)  # garbage first
    v = torch.randint(-100, 100, shape, generator=gen, dtype=torch.int8).view(code_dtype)
    ks, vs = (torch.rand(shape[:3], generator=gen).to(torch.float16) for _ in range(2))
    # every slot written (random codes could be NaNs), in a shuffled order, with padding rows
    hk, hv, hks, hvs = head_layout(k, values=False), head_layout(v, values=True), ks.clone(), vs.clone()
    slots = torch.cat([torch.randperm(shape[0] * shape[1], generator=gen), torch.tensor([-1, -1])])
    keys = torch.randn(slots.shape[0], num_kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(slots.shape[0], num_kv_heads, head_dim, generator=gen).to(dtype)
    cpu_ops.write_kv_quantized(keys, values, k, v, slots, ks, vs, library=library)
    cpu_ops.write_kv_quantized(keys, values, hk, hv, slots, hks, hvs, library=library)
    assert torch.equal(as_bytes(hk), as_bytes(k)) and torch.equal(as_bytes(hv), as_bytes(v))
    assert torch.equal(hks, ks) and torch.equal(hvs, vs)
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host,
                               cpu_ops.tile_tokens(num_heads, num_kv_heads, head_dim))
    for split_heads in (True, False):
        token, head = (
            cpu_ops.paged_attention(batch.query, kc, vc, md.block_tables, tiles, batch.scale, library=library,
                                    split_heads=split_heads, k_scale=a, v_scale=b)
            for kc, vc, a, b in ((k, v, ks, vs), (hk, hv, hks, hvs))
        )
        assert torch.equal(head, token), split_heads


@pytest.mark.parametrize("code_dtype", [None, torch.int8], ids=["float32", "int8"])
def test_the_torch_reference_path_reads_and_writes_the_head_layout(code_dtype):
    batch = _batch(SPECS, torch.float32, 16, 9, 3, 64, seed=11)
    md = batch.metadata
    backend = TorchAttentionBackend(use_native=False)
    caches = []
    for layout in ("token", "head"):
        k, v = batch.k_cache.clone(), batch.v_cache.clone()
        scales = {}
        if code_dtype is not None:
            k, v = torch.zeros(k.shape, dtype=code_dtype), torch.zeros(v.shape, dtype=code_dtype)
            scales = {"k_scale": torch.ones(k.shape[:3], dtype=torch.float16),
                      "v_scale": torch.ones(k.shape[:3], dtype=torch.float16)}
        if layout == "head":
            k, v = head_layout(k, values=False), head_layout(v, values=True)
        backend.write_kv(batch.new_key, batch.new_value, k, v, md.slot_mapping, **scales)
        caches.append((k, v, backend.forward(batch.query, k, v, md, batch.scale, **scales)))
    (tk, tv, token), (hk, hv, head) = caches
    assert torch.equal(as_bytes(hk), as_bytes(tk)) and torch.equal(as_bytes(hv), as_bytes(tv))
    assert torch.equal(head, token)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_block_moves_carry_logical_bytes_whatever_the_layout(dtype):
    """A raw block (the tiers' unit) holds each slice in token-major order, so a disk tier's files
    read the same into a pool of either layout; native moves equal the reference ones."""
    shape = dict(num_layers=2, num_blocks=6, block_size=8, num_kv_heads=3, head_dim=16, dtype=dtype, device="cpu")
    token, head = KVCache(**shape), KVCache(**shape, layout="head")
    gen = torch.Generator().manual_seed(5)
    for a, b in zip(token.block_tensors(), head.block_tensors(), strict=True):
        fill = torch.randint(-100, 100, a.shape, generator=gen).to(a.dtype)
        a.copy_(fill)
        b.copy_(fill)
    ids = [4, 0, 2]
    raws = tiers.read_blocks(head.block_tensors(), ids)
    assert all(torch.equal(r, e) for r, e in zip(raws, tiers.read_blocks(token.block_tensors(), ids), strict=True))
    assert all(torch.equal(r, e) for r, e in
               zip(raws, tiers.read_blocks_reference(head.block_tensors(), ids), strict=True))
    assert torch.equal(raws[0], tiers.pack_block([t[4] for t in head.block_tensors()]))
    # written back elsewhere, natively and by the reference path: the blocks' logical contents move
    for write in (tiers.write_blocks, tiers.write_blocks_reference):
        for t in head.block_tensors():
            as_bytes(t)[[1, 3, 5]] = 0
        write(head.block_tensors(), [1, 3, 5], raws)
        for src, dst in zip(ids, [1, 3, 5], strict=True):
            for t in head.block_tensors():
                assert torch.equal(as_bytes(t[dst]), as_bytes(t[src])), write.__name__
    # copy-on-write copies and swaps move logical blocks as well
    head.copy_blocks([(0, 1)])
    assert all(torch.equal(as_bytes(t[1]), as_bytes(t[0])) for t in head.block_tensors())


def test_layout_env_var(monkeypatch):
    monkeypatch.setenv(cpu_ops.KV_LAYOUT_ENV, "token")
    assert cpu_ops.preferred_kv_layout() == "token"
    monkeypatch.setenv(cpu_ops.KV_LAYOUT_ENV, "HEAD")
    assert cpu_ops.preferred_kv_layout(native=False) == "head"
    monkeypatch.setenv(cpu_ops.KV_LAYOUT_ENV, "columns")
    with pytest.raises(ConfigError, match="PAGEDLLM_KV_LAYOUT"):
        cpu_ops.preferred_kv_layout()
    monkeypatch.delenv(cpu_ops.KV_LAYOUT_ENV)
    expected = "head" if cpu_ops.selected_isa() in cpu_ops.HEAD_LAYOUT_PATHS else "token"
    assert cpu_ops.preferred_kv_layout() == expected
    assert cpu_ops.preferred_kv_layout(native=False) == "token"
    assert TorchAttentionBackend().kv_layout(torch.device("cpu")) == expected
    # caches of other dtypes keep the token layout (their conversions bound them)
    for dtype in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        assert cpu_ops.preferred_kv_layout(dtype=dtype) == "token"
        assert TorchAttentionBackend().kv_layout(torch.device("cpu"), dtype) == "token"
    assert TorchAttentionBackend(use_native=False).kv_layout(torch.device("cpu")) == "token"
