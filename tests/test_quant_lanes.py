"""The lane layout of 4-bit codes (quant_ops.c, "Lane layout"): the per-row lane kernels'.

A matrix reordered into it must give the bits of the row layout on every path that reads it
(the AVX2 and AVX-512 VNNI per-row and tiled kernels, the portable path, and the AMX path, which
hands it to VNNI's), at both activation levels, with and without row-scale tables; its
dequantized values and embedding rows must not change; and a weight reorders itself only
where the CPU's kernel reads the layout, keeping the row layout for every reader of rows.
"""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import (  # _single_thread: its autouse fixture, one thread here too
    FORMATS,
    _exact_activations,
    _exact_weight,
    _single_thread,  # noqa: F401
)

from pagedllm.errors import ConfigError
from pagedllm.native import quant_ops
from pagedllm.quant import quantize_rtn
from pagedllm.quant.formats import (
    QuantizedWeight,
    from_lanes,
    pack_nibbles,
    to_lanes,
    unpack_nibbles,
)

pytestmark = pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the quantized kernels")

FOUR_BIT = sorted(name for name, spec in FORMATS.items() if spec[0] == 4)
LANE_PATHS = [isa for isa in quant_ops.LANE_COLS if quant_ops.available() and isa in quant_ops.runnable_isas()]


def test_the_lane_layout_holds_each_code_where_the_kernel_reads_it():
    assert torch.get_num_threads() == 1  # the kernels' module fixture applies here
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (24, 192), generator=g, dtype=torch.uint8)
    lanes = to_lanes(pack_nibbles(codes))
    flat = lanes.flatten()
    blocks = 192 // 32
    for n in range(24):
        for k in range(192):
            p, j, b, c, t8 = n // 8, n % 8, k // 32, (k % 32) // 8, k % 8
            byte = int(flat[((p * blocks + b) * 4 + c) * 32 + 4 * j + (t8 % 4)])
            assert (byte & 0x0F if t8 < 4 else byte >> 4) == int(codes[n, k]), (n, k)
    assert torch.equal(unpack_nibbles(from_lanes(lanes)), codes)
    with pytest.raises(AssertionError):
        to_lanes(pack_nibbles(codes[:20]))  # not whole passes of 8


def _lane_args(weight: QuantizedWeight) -> tuple:
    return (to_lanes(weight.qweight), *weight._kernel_args()[1:])


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("name", FOUR_BIT)
def test_every_path_reads_the_lane_layout_with_the_row_layouts_bits(name, levels):
    """Exact inputs (the product is the dequantized one, exactly) and random ones; 40 outputs (5
    passes), widths whose blocks end on a half group (160) or not, up to the default model's
    widest input (1536, whose broadcast activations fill most of L1); every row count of the
    per-row and tiled kernels; with and without row-scale tables."""
    paths = [(isa, tiled) for isa in quant_ops.runnable_isas() for tiled in (None, False, True)]
    for in_features in (160, 576, 800, 1536):
        weight = _exact_weight(name, 40, in_features, seed=in_features)
        lane_args = _lane_args(weight)
        for rows in (1, 2, 3, 5, 8, 9, 17):
            for x in (_exact_activations(rows, in_features, seed=rows),
                      torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))):
                want = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0, levels=levels)
                for isa, tiled in paths:
                    got = quant_ops.gemm(x, *lane_args, isa_override=isa, tiled=tiled, levels=levels)
                    assert torch.equal(got, want), (in_features, rows, isa, tiled)
                for isa in LANE_PATHS:  # the bound call (and the AVX2 kernel's row-scale tables)
                    tables = (quant_ops.row_scale_tables(weight.scales, weight.mins, isa)
                              if isa in quant_ops.ROW_TABLE_COLS else None)
                    got = quant_ops.gemm(x, *lane_args, isa_override=isa, tiled=False, levels=levels,
                                         tables=tables)
                    assert torch.equal(got, want), (in_features, rows, isa, "tables")
                    bound = quant_ops.bind_gemm(*lane_args, levels=levels, isa_override=isa, tables=tables)
                    assert torch.equal(bound(x), want), (in_features, rows, isa, "bound")


@pytest.mark.parametrize("name", FOUR_BIT)
def test_embedding_rows_read_from_the_lane_layout_are_the_dequantized_rows(name):
    weight = _exact_weight(name, 32, 576, seed=3)
    ids = torch.tensor([0, 7, 8, 31, 7, 19])
    want = weight.dequantize()[ids]
    got = quant_ops.dequantize_rows(ids, *_lane_args(weight), weight.in_features)
    assert torch.equal(got, want)


def test_codes_that_are_neither_rows_nor_the_lane_layout_are_refused():
    x = torch.randn(1, 64)
    q8 = quantize_rtn(torch.randn(16, 64), 8, 32)
    q8_as_lanes = (q8.qweight.view(2, 2, 256), *q8._kernel_args()[1:])  # 8-bit codes have no lane layout
    with pytest.raises(ValueError, match="neither rows"):
        quant_ops.gemm(x, *q8_as_lanes)
    q4 = quantize_rtn(torch.randn(16, 64), 4, 32)
    wrong = (q4.qweight.view(4, 4, 32), *q4._kernel_args()[1:])  # 3-D, but not [N / 8, Kp / 32, 128]
    for call in (lambda: quant_ops.bind_gemm(*wrong), lambda: quant_ops.dequantize_rows(torch.tensor([0]), *wrong, 64)):
        with pytest.raises(ValueError, match="neither rows"):
            call()


def test_a_weight_reorders_its_codes_once_where_its_kernel_reads_them(monkeypatch):
    source = torch.randn(40, 576)
    weight = quantize_rtn(source, 4, 32)
    plain, reference = weight.qweight.clone(), weight.dequantize()
    x = torch.randn(3, 576)
    want = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0)
    monkeypatch.setenv(quant_ops.LANES_ENV, "0")
    assert not weight.native_codes() and torch.equal(weight.apply(x), want) and not weight.lanes
    monkeypatch.setenv(quant_ops.LANES_ENV, "1")
    wanted = quant_ops.isa() in quant_ops.LANE_COLS
    assert weight.native_codes() is wanted and weight.lanes is wanted
    assert torch.equal(weight.qweight, to_lanes(plain) if wanted else plain)
    assert weight.shape == (40, 576) and weight.out_features == 40
    assert weight.nbytes == plain.nbytes + weight.scales.nbytes + weight.mins.nbytes  # reordered, not copied
    assert torch.equal(weight.apply(x), want)
    # a caller handing the weight's arguments to the kernels gets the same product on any path
    for isa in quant_ops.runnable_isas():
        assert torch.equal(quant_ops.gemm(x, *weight._kernel_args(), isa_override=isa), want), isa
    for one in (weight.apply, weight.matmul(torch.device("cpu"))):
        assert torch.equal(one(x[:1]), want[:1])
    # every reader of rows sees the row layout
    assert torch.equal(weight.plain_qweight(), plain)
    assert torch.equal(weight.dequantize(), reference)
    assert torch.equal(weight.embed(torch.tensor([5, 39])), reference[[5, 39]])
    shard = weight.rows(8, 24)
    assert not shard.lanes and torch.equal(shard.qweight, plain[8:24])
    fused = QuantizedWeight.cat_rows([weight, shard])
    assert torch.equal(fused.qweight, torch.cat([plain, plain[8:24]]))
    # a weight whose outputs are not whole passes keeps the row layout
    odd = quantize_rtn(torch.randn(12, 576), 4, 32)
    assert not odd.native_codes()
    monkeypatch.setenv(quant_ops.LANES_ENV, "yes")
    with pytest.raises(ConfigError, match="PAGEDLLM_QUANT_LANES must be 0 or 1"):
        quantize_rtn(source, 4, 32).native_codes()
