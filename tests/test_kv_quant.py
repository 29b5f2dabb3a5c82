"""8-bit KV caches (int8, fp8 e4m3, fp8 e5m2): the reference quantizer, the kernels
that write and read the codes, and the KV cache tensors that carry their scales.

Oracles: ``kv_format.quantize_kv`` for what a write stores (the native kernel
must produce the same codes and scales, bit for bit), and the dense float64
attention of tests/attention_reference.py, over ``dequantize_kv`` of those
codes (tight: the kernel's only error is float32 arithmetic and the output's
rounding) and over the unquantized K/V (loose: the format's own error).
Every native kernel runs once per ISA path this CPU can run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from attention_reference import make_paged_batch, naive_attention
from native_paths import AMX, LIBRARY_PARAMS, amx_and_vector_outputs, built_library

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.errors import ConfigError
from pagedllm.kv import kv_format
from pagedllm.kv.kv_cache import KVCache
from pagedllm.native import cpu_ops

CODE_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
QUERY_DTYPES = [torch.float32, torch.bfloat16]
# Max abs error of attention over the dequantized codes against attention over the
# original K/V, for N(0, 1) keys and values (head_dim 64): the formats' own error.
# int8 keeps ~8 bits of the head's absmax, e4m3 3 mantissa bits, e5m2 2.
FORMAT_TOLERANCE = {torch.int8: 0.03, torch.float8_e4m3fn: 0.15, torch.float8_e5m2: 0.3}

needs_native = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the native CPU kernels")


@pytest.fixture(scope="module", params=LIBRARY_PARAMS)
def library(request):
    yield from built_library(request.param)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return kv_format.as_bytes(t)


# ---------------------------------------------------------------- the format and its reference


def test_names_resolve_and_others_are_config_errors():
    assert kv_format.resolve("auto") is None
    assert kv_format.resolve("fp8") == kv_format.resolve("fp8_e4m3")  # vLLM's spelling
    assert kv_format.cache_dtype("int8", torch.bfloat16) == torch.int8
    assert kv_format.cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert kv_format.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ConfigError, match="'int8' or 'fp8_e4m3' or 'fp8_e5m2' or 'fp8'"):
        kv_format.resolve("fp4")


def test_engine_config_accepts_the_formats_and_names_the_choices():
    from pagedllm import EngineConfig

    for name in ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    with pytest.raises(ConfigError, match="kv_cache_dtype='q4_0'.*'int8'"):
        EngineConfig(kv_cache_dtype="q4_0")


def test_cli_flag_takes_the_formats():
    from pagedllm.cli import build_parser, engine_config_from_args

    for command in (["generate", "x"], ["serve"]):
        args = build_parser().parse_args([*command, "--kv-cache-dtype", "fp8_e5m2"])
        assert engine_config_from_args(args).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):  # argparse: "invalid choice", with the choices listed
        build_parser().parse_args(["generate", "x", "--kv-cache-dtype", "fp16"])


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_quantize_kv_follows_the_rule(dtype):
    fmt = kv_format.format_of(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 64, generator=gen) * torch.logspace(-7, 4, 40)[:, None, None]
    x[0, 0] = 0.0  # an all-zero vector still gets the smallest normal scale
    codes, scales = kv_format.quantize_kv(x, dtype)
    assert codes.dtype == dtype and codes.shape == x.shape
    assert scales.dtype == torch.float16 and scales.shape == x.shape[:-1]
    want = (x.abs().amax(-1) / fmt.qmax).to(torch.float16).clamp_min(2**-14)
    assert torch.equal(scales, want)
    assert scales[0, 0].item() == 2**-14 and not codes[0, 0].float().any()
    assert codes.float().abs().max().item() <= fmt.qmax
    # each vector's largest element keeps its magnitude to the format's relative step
    restored = kv_format.dequantize_kv(codes, scales)
    big = x.abs().amax(-1) > 2**-14 * fmt.qmax  # vectors whose scale is not the clamped minimum
    step = {torch.int8: 1 / 127, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}[dtype]
    error = (restored - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)
    assert error[big].max().item() <= step * 1.01


def test_int8_rounds_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]])  # scale 1.0 exactly
    codes, scales = kv_format.quantize_kv(x, torch.int8)
    assert scales.item() == 1.0
    assert codes.tolist() == [[127, 0, 2, 2, 0, -2]]


# ---------------------------------------------------------------- writes


def _edge_rows(dtype: torch.dtype, num_tokens: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Vectors over many magnitudes (fp8 subnormal codes, clamped scales), zeros and ties."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    x *= torch.logspace(-8, 4, num_tokens)[:, None, None]
    x[0] = 0.0
    x[1, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # int8 ties at scale 1
    x[1, 0, 4:] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
def test_native_write_kv_stores_the_reference_codes_and_scales(library, dtype, code_dtype):
    """Bit for bit: the kernel divides and rounds exactly as quantize_kv (no tolerance)."""
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 3, 64
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=code_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, block_size, kv_heads, dtype=torch.float16)
    v_scale = torch.zeros_like(k_scale)
    rows = 14
    qkv = torch.cat([_edge_rows(dtype, rows, kv_heads, head_dim), -_edge_rows(dtype, rows, kv_heads, head_dim)], 1)
    key, value = qkv[:, :kv_heads], qkv[:, kv_heads:]  # strided rows, as the model passes them
    slots = torch.tensor([3, -1, 22, 0, 5, 6, 7, 9, 10, -1, 13, 17, 20, 23])
    cpu_ops.write_kv_quantized(key, value, k_cache, v_cache, slots, k_scale, v_scale, library=library)
    keep = slots >= 0
    for new, codes, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        want_codes, want_scales = kv_format.quantize_kv(new[keep], code_dtype)
        got_codes = _bytes(codes).view(-1, kv_heads, head_dim)[slots[keep]]
        assert torch.equal(got_codes, _bytes(want_codes))
        assert torch.equal(scales.view(-1, kv_heads)[slots[keep]], want_scales)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[keep]] = True
    assert not _bytes(k_cache).view(-1, kv_heads * head_dim)[~written].any()  # padding rows left alone


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_torch_and_native_writes_agree(code_dtype):
    shape = (8, 16, 3, 64)
    key, value = torch.randn(20, 3, 64), torch.randn(20, 3, 64)
    slots = torch.randperm(128)[:20]
    slots[4] = -1
    caches = []
    for use_native in (True, False):
        tensors = (torch.zeros(shape, dtype=code_dtype), torch.zeros(shape, dtype=code_dtype),
                   torch.zeros(shape[:3], dtype=torch.float16), torch.zeros(shape[:3], dtype=torch.float16))
        k_cache, v_cache, k_scale, v_scale = tensors
        TorchAttentionBackend(use_native=use_native).write_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
        caches.append([_bytes(t) for t in tensors])
    for native, torch_path in zip(*caches, strict=True):
        assert torch.equal(native, torch_path)


# ---------------------------------------------------------------- attention

SPECS = [(0, 37), (50, 1), (200, 1), (15, 1), (20, 17), (0, 1), (7, 9)]  # (context, new tokens)


def _quantized_batch(code_dtype, dtype, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seed=0):
    """A paged batch whose context sits in an 8-bit cache, plus the two dense oracles' batches."""
    batch = make_paged_batch(SPECS, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, seed=seed)
    k_codes, k_scale = kv_format.quantize_kv(batch.k_cache, code_dtype)  # context (and garbage) quantized
    v_codes, v_scale = kv_format.quantize_kv(batch.v_cache, code_dtype)
    dequantized = copy.copy(batch)
    dequantized.dense_keys = [kv_format.dequantize_kv(*kv_format.quantize_kv(k, code_dtype)) for k in batch.dense_keys]
    dequantized.dense_values = [kv_format.dequantize_kv(*kv_format.quantize_kv(v, code_dtype))
                                for v in batch.dense_values]
    return batch, (k_codes, v_codes, k_scale, v_scale), dequantized


def _tolerance_vs_dequantized(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", [(16, 9, 3, 64), (32, 8, 2, 128)])
def test_native_attention_over_codes_matches_the_dense_oracles(
    library, dtype, code_dtype, block_size, num_heads, num_kv_heads, head_dim
):
    """Prefill chunks, decode rows and prefix-hit chunks in one call, per ISA path, both work splits."""
    if head_dim % library.vector_width():
        pytest.skip("head_dim not a multiple of this path's vector width")
    batch, (k, v, ks, vs), dequantized = _quantized_batch(
        code_dtype, dtype, block_size, num_heads, num_kv_heads, head_dim, seed=block_size + head_dim
    )
    md = batch.metadata
    cpu_ops.write_kv_quantized(batch.new_key, batch.new_value, k, v, md.slot_mapping, ks, vs, library=library)
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, cpu_ops.tile_tokens(num_heads, num_kv_heads, head_dim))
    over_codes = naive_attention(batch.query.double(), dequantized)
    over_floats = naive_attention(batch.query.double(), batch)
    for split_heads in (True, False):
        out = cpu_ops.paged_attention(batch.query, k, v, md.block_tables, tiles, batch.scale, library=library,
                                      split_heads=split_heads, k_scale=ks, v_scale=vs)
        assert out.dtype == dtype
        assert (out.double() - over_codes).abs().max().item() <= _tolerance_vs_dequantized(dtype)
        assert (out.double() - over_floats).abs().max().item() <= FORMAT_TOLERANCE[code_dtype]


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX-BF16 tiles")
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", [
    (16, 9, 3, 64), (32, 8, 2, 128), (16, 24, 1, 64), (16, 8, 4, 64), (16, 16, 8, 64),
])  # up to 4 KV heads a chunk's scales are picked by a permute, past that one by one
def test_int8_codes_on_the_tiles_agree_with_the_vector_kernels_and_the_tiles_really_run(
    block_size, num_heads, num_kv_heads, head_dim
):
    """bfloat16 queries over int8 codes on the AMX tiles (codes widened to bfloat16 exactly,
    each key's scale on its score, each value's on its softmax weight) against the same path's
    vector kernels and the dense oracle over the dequantized codes: within bfloat16's
    rounding, yet not the same bits (the tiles ran). Rows of 17+ query heads per KV head
    take two passes."""
    library = cpu_ops.build_library(isa="avx512_bf16")
    batch, (k, v, ks, vs), dequantized = _quantized_batch(
        torch.int8, torch.bfloat16, block_size, num_heads, num_kv_heads, head_dim, seed=head_dim + num_heads
    )
    md = batch.metadata
    cpu_ops.write_kv_quantized(batch.new_key, batch.new_value, k, v, md.slot_mapping, ks, vs, library=library)
    outs = amx_and_vector_outputs(library, batch.query, k, v, md, batch.scale, k_scale=ks, v_scale=vs)
    over_codes = naive_attention(batch.query.double(), dequantized)
    for out in outs.values():
        assert (out.double() - over_codes).abs().max().item() <= _tolerance_vs_dequantized(torch.bfloat16)
    assert not torch.equal(outs[True], outs[False])


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles")
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", [
    (16, 9, 3, 64), (8, 8, 2, 128), (16, 8, 8, 64), (32, 12, 2, 64), (16, 6, 1, 96),
])  # a decode row's group: 3, 4, 1, 6, 6 rows (scores as S^T up to 4, as S past that); 96: a padded chunk
def test_int8_on_the_tiles_gives_a_row_the_same_bits_in_any_tile(block_size, num_heads, num_kv_heads, head_dim):
    """int8 scores on the tiles take a decode token's rows as S^T and a prefill tile's as S:
    a position's output as a decode token, in a prefill tile and in a later chunk is equal
    bit for bit, decode heads together or one by one too, and it matches the oracle."""
    library = cpu_ops.build_library(isa="avx512_bf16")
    length = 70
    batch = make_paged_batch([(0, length)], block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=torch.bfloat16, seed=head_dim + num_heads)
    md = batch.metadata
    k, ks = kv_format.quantize_kv(batch.k_cache, torch.int8)
    v, vs = kv_format.quantize_kv(batch.v_cache, torch.int8)
    cpu_ops.write_kv_quantized(batch.new_key, batch.new_value, k, v, md.slot_mapping, ks, vs, library=library)
    per_tile = cpu_ops.tile_tokens(num_heads, num_kv_heads, head_dim)

    def attend(first: int, count: int, split_heads: bool = False) -> torch.Tensor:
        tiles = cpu_ops.make_tiles([first + count], [count], per_tile)
        return cpu_ops.paged_attention(batch.query[first : first + count].contiguous(), k, v, md.block_tables,
                                       tiles, batch.scale, library=library, split_heads=split_heads,
                                       k_scale=ks, v_scale=vs)

    with cpu_ops.attention_amx_set(True, library) as on:
        assert on
        whole = attend(0, length)
        assert torch.equal(attend(23, length - 23), whole[23:])
        for position in (0, 5, 15, 16, 31, 47, length - 1):
            assert torch.equal(attend(position, 1)[0], whole[position]), position
            assert torch.equal(attend(position, 1, split_heads=True)[0], whole[position]), position
    dequantized = copy.copy(batch)
    dequantized.dense_keys = [kv_format.dequantize_kv(*kv_format.quantize_kv(x, torch.int8)) for x in batch.dense_keys]
    dequantized.dense_values = [kv_format.dequantize_kv(*kv_format.quantize_kv(x, torch.int8))
                                for x in batch.dense_values]
    assert (whole.double() - naive_attention(batch.query.double(), dequantized)).abs().max().item() \
        <= _tolerance_vs_dequantized(torch.bfloat16)


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
def test_torch_reference_attention_over_codes_matches_the_dense_oracles(dtype, code_dtype):
    batch, (k, v, ks, vs), dequantized = _quantized_batch(code_dtype, dtype, seed=3)
    md = batch.metadata
    backend = TorchAttentionBackend(use_native=False)
    backend.write_kv(batch.new_key, batch.new_value, k, v, md.slot_mapping, k_scale=ks, v_scale=vs)
    out = backend.forward(batch.query, k, v, md, batch.scale, k_scale=ks, v_scale=vs)
    assert (out.double() - naive_attention(batch.query.double(), dequantized)).abs().max().item() \
        <= _tolerance_vs_dequantized(dtype)
    assert (out.double() - naive_attention(batch.query.double(), batch)).abs().max().item() \
        <= FORMAT_TOLERANCE[code_dtype]


@needs_native
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_backend_sends_quantized_caches_to_the_native_kernel(code_dtype):
    """The backend's native path (write and attention) equals its PyTorch path to float32 rounding."""
    outs = []
    for use_native in (None, False):
        batch, (k, v, ks, vs), _ = _quantized_batch(code_dtype, torch.float32, seed=5)
        md = batch.metadata
        backend = TorchAttentionBackend(use_native=use_native)
        backend.write_kv(batch.new_key, batch.new_value, k, v, md.slot_mapping, k_scale=ks, v_scale=vs)
        outs.append(backend.forward(batch.query, k, v, md, batch.scale, k_scale=ks, v_scale=vs))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the cache tensors


def _quantized_cache(num_cpu_blocks: int = 0, dtype=torch.float8_e4m3fn) -> KVCache:
    cache = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
                    device="cpu", num_cpu_blocks=num_cpu_blocks)
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        for t in layer:
            _bytes(t).copy_(torch.randint(0, 120, _bytes(t).shape, generator=gen).to(_bytes(t).dtype))
    return cache


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_quantized_layers_carry_scales_in_block_tensors(dtype):
    cache = _quantized_cache(num_cpu_blocks=2, dtype=dtype)
    for layers, blocks in ((cache.layers, 6), (cache.cpu_layers, 2)):
        for k, v, ks, vs in layers:
            assert k.dtype == v.dtype == dtype and k.shape == (blocks, 4, 2, 8)
            assert ks.dtype == vs.dtype == torch.float16 and ks.shape == (blocks, 4, 2)
    tensors = cache.block_tensors()
    assert len(tensors) == 8 and tensors[2] is cache.layers[0][2] and tensors[7] is cache.layers[1][3]
    assert len(cache.cpu_block_tensors()) == 8


def test_copy_and_swap_move_codes_and_scales():
    cache = _quantized_cache(num_cpu_blocks=3)
    before = [_bytes(t).clone() for t in cache.block_tensors()]
    cache.copy_blocks([(1, 4), (0, 1)])  # 1 is read before it is written
    for t, t0 in zip(cache.block_tensors(), before, strict=True):
        t = _bytes(t)
        assert torch.equal(t[4], t0[1]) and torch.equal(t[1], t0[0]) and torch.equal(t[5], t0[5])
    original = [_bytes(t).clone() for t in cache.block_tensors()]
    cache.swap_out([(5, 0), (2, 2)])
    for t in cache.block_tensors():
        _bytes(t).zero_()
    cache.swap_in([(0, 1), (2, 3)])
    for t, t0 in zip(cache.block_tensors(), original, strict=True):
        t = _bytes(t)
        assert torch.equal(t[1], t0[5]) and torch.equal(t[3], t0[2]) and not t[0].any()


def test_bytes_per_block_counts_codes_and_scales():
    kw = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
    per_bf16 = KVCache.bytes_per_block(**kw, dtype=torch.bfloat16)
    for dtype in CODE_DTYPES:
        per_code = KVCache.bytes_per_block(**kw, dtype=dtype)
        assert per_code == 2 * 30 * 16 * 3 * (64 + 2)  # 64 one-byte codes and a float16 scale per head
        memory = 1000 * per_bf16
        ratio_bf16 = KVCache.num_blocks_for_memory(memory, **kw, dtype=dtype) / 1000
        ratio_fp32 = KVCache.num_blocks_for_memory(memory * 2, **kw, dtype=dtype) / 1000
        assert 1.93 <= ratio_bf16 <= 1.94 and 3.87 <= ratio_fp32 <= 3.88  # 128/66 and 256/66
    cache = KVCache(num_layers=2, num_blocks=5, block_size=8, num_kv_heads=2, head_dim=64, dtype=torch.int8,
                    device="cpu")
    allocated = sum(t.numel() * t.element_size() for t in cache.block_tensors())
    assert allocated == 5 * KVCache.bytes_per_block(num_layers=2, block_size=8, num_kv_heads=2, head_dim=64,
                                                    dtype=torch.int8)


# ---------------------------------------------------------------- the accuracy report


def test_divergence_reads_both_gaps_at_the_first_differing_step():
    from pagedllm.kv.accuracy import FormatResult, GreedyRun, divergence, format_row

    want = GreedyRun([5, 6, 7], [{5: -0.1}, {6: -0.2, 9: -1.7}, {7: -0.3}])
    got = GreedyRun([5, 9, 4], [{5: -0.1}, {9: -0.6, 6: -0.9}, {4: -0.2, 8: -3.0}])
    d = divergence(2, want, got)
    assert (d.prompt_index, d.position, d.exact) == (2, 1, True)
    assert d.reference_gap == pytest.approx(1.5) and d.quantized_gap == pytest.approx(0.3)
    got_far = GreedyRun([5, 9], [{5: -0.1}, {9: -0.6, 3: -4.0}])  # 6 is not among the reported candidates
    far = divergence(0, GreedyRun([5, 6], want.logprobs[:2]), got_far)
    assert not far.exact and far.quantized_gap == pytest.approx(3.4)  # a lower bound: to the last candidate
    row = format_row(FormatResult("int8", 4, 3, [d]))
    assert row == "| int8 | 3/4 | 1.500 | #2 at token 1 (ref 1.500, q 0.300) |"


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_native_fp8_rounding_matches_torch_on_every_code_and_midpoint(library, code_dtype):
    """Scale 1 (each vector's first element is QMAX), then every finite positive and
    negative code value, the midpoints between neighbours (ties go to even) and points
    just off them, subnormals included."""
    qmax = kv_format.format_of(code_dtype).qmax
    values = torch.arange(256, dtype=torch.uint8).view(code_dtype).float()
    values = values[values.isfinite() & (values >= 0)].unique().sort().values.double()  # 0 .. QMAX
    mids = (values[1:] + values[:-1]) / 2
    points = torch.cat([values, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)]).float()
    points = torch.cat([points, -points])
    head_dim = 32
    rows = -(-points.numel() // (head_dim - 1))
    x = torch.zeros(rows * (head_dim - 1))
    x[: points.numel()] = points
    x = torch.cat([torch.full((rows, 1), qmax), x.view(rows, head_dim - 1)], 1).view(rows, 1, head_dim)
    cache = torch.zeros(rows, 1, 1, head_dim, dtype=code_dtype)
    scale = torch.zeros(rows, 1, 1, dtype=torch.float16)
    slots = torch.arange(rows)
    cpu_ops.write_kv_quantized(x, x, cache, cache.clone(), slots, scale, scale.clone(), library=library)
    assert (scale == 1.0).all()
    assert torch.equal(_bytes(cache).view(rows, 1, head_dim), _bytes(x.to(code_dtype)))


@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_native_attention_decodes_every_code(library, code_dtype, query_dtype):
    """A context of one token returns its value vector exactly (bfloat16 queries: rounded once,
    to the output's dtype): all 256 byte patterns (non-finite ones replaced by 0) as values,
    read back through every ISA path (and on the AMX tiles, for int8)."""
    head_dim, num_seqs = 64, 4
    codes = torch.arange(256, dtype=torch.uint8).view(code_dtype)
    if code_dtype != torch.int8:
        codes = torch.where(codes.float().isfinite(), codes.view(torch.uint8), 0).to(torch.uint8).view(code_dtype)
    v_cache = codes.view(num_seqs, 1, 1, head_dim)  # one block of one slot per sequence
    k_cache = torch.zeros_like(v_cache)
    scale = torch.tensor([0.5, 1.0, 2.0**-14, 3.0], dtype=torch.float16).view(num_seqs, 1, 1)
    tables = torch.arange(num_seqs, dtype=torch.int32).view(num_seqs, 1)
    tiles = cpu_ops.make_tiles([1] * num_seqs, [1] * num_seqs, 1)
    query = torch.randn(num_seqs, 2, head_dim).to(query_dtype)
    out = cpu_ops.paged_attention(query, k_cache, v_cache, tables, tiles, 0.125, library=library,
                                  k_scale=scale, v_scale=scale)
    want = kv_format.dequantize_kv(v_cache, scale).view(num_seqs, 1, head_dim).expand(num_seqs, 2, head_dim)
    assert torch.equal(out, want.to(query_dtype))


@needs_native
def test_kernel_bench_times_every_format_on_the_asked_paths(capsys):
    from pagedllm.kv import kernel_bench

    isas = list(cpu_ops.cpu_isa_paths())[-1:]
    assert kernel_bench.main(["--batch", "2", "--context", "20", "--isa", *isas, "--rounds", "1", "--calls", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {isas[0]} |")]
    # float32 and bfloat16 caches with their own query dtype, each 8-bit format with both
    assert len(rows) == 2 + 2 * len(kv_format.FORMATS)
    assert all(float(row.split("|")[4]) > 0 for row in rows)
