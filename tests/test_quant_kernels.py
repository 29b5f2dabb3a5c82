"""Every path of the quantized-matmul kernels against the portable C path and the dequantized weight.

The paths (portable C, AVX2 + FMA, AVX-512 VNNI per row and tiled) must compute
the same integer block sums; on inputs where every float operation is exact
(activations that quantize to themselves, power-of-two scales, dyadic mins)
that makes their outputs equal bit for bit, whatever the order of additions.
Every path also follows one float sequence (per block in order: the exact
integer sum times activation scale x weight scale, then the min term, each a
fused multiply-add), so on random inputs too they give the same bits, and a
row's output never depends on how many rows share the call (batch
invariance). On random inputs each path agrees with ``x @ dequantize().T`` to
within the activation error. All of it holds for both activation modes: one
int8 level per 32-block, and two (the residual of the first at a 256 times
finer scale, a 16-bit fixed-point activation), whose error is hundreds of
times smaller. An AVX-512 machine runs all paths, so all are tested here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.errors import ConfigError
from pagedllm.native import quant_ops
from pagedllm.quant import QuantizedWeight, quantize_rtn
from pagedllm.quant.formats import pack_nibbles

pytestmark = pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the quantized kernels")

ACTIVATION_RTOL = {1: 0.02, 2: 1e-4}  # relative error of the product, by activation levels
LEVELS = [1, 2]
# (format, bits, zero, group size, has mins): each zero-point / min case of formats.py
FORMATS = {
    "Q4_0": (4, 8, 32, False), "Q4_1": (4, 0, 32, True), "Q8_0": (8, 128, 32, False),
    "int4-g128": (4, 0, 128, True), "int8-g64": (8, 128, 64, False),
}
ROWS = [1, 3, 4, 9, 16, 17, 40]  # per-row: groups of 4 and tails; tiled: tiles of 16 / 8 and tails; AMX: 16-row tiles


def _paths() -> list[tuple[int, bool | None]]:
    """(isa, gemm's tiled=) for every path this CPU runs: as dispatched, and the vector
    paths' per-row and tiled kernels at every row count."""
    paths = [(isa, None) for isa in quant_ops.runnable_isas()]
    return paths + [(isa, tiled) for isa in quant_ops.runnable_isas() if isa > 0 for tiled in (False, True)]


def _path_id(path: tuple[int, bool]) -> str:
    return quant_ops.ISA_NAMES[path[0]] + {None: "", False: "-rows", True: "-tiled"}[path[1]]


PATHS = _paths() if quant_ops.available() else []


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _exact_weight(name: str, out_features: int, in_features: int, seed: int) -> QuantizedWeight:
    """Random codes (all of 0..15 / 0..255, so 8-bit code 0 = -128 too), power-of-two scales
    1/4..1 and mins in quarters: every product and partial sum below is exact in float32."""
    bits, zero, group, has_mins = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    padded = -(-in_features // max(64, group)) * max(64, group)
    codes = torch.randint(0, 1 << bits, (out_features, padded), generator=g, dtype=torch.uint8)
    codes[:, in_features:] = 0
    groups = padded // group
    scales = (2.0 ** -torch.randint(0, 3, (out_features, groups), generator=g)).half()
    scales[:, -(-in_features // group):] = 0  # padding groups: scale 0
    mins = (torch.randint(-8, 8, (out_features, groups), generator=g) / 4).half() if has_mins else None
    if mins is not None:
        mins[:, -(-in_features // group):] = 0
    qweight = pack_nibbles(codes) if bits == 4 else codes
    return QuantizedWeight(name, bits, zero, group, in_features, qweight, scales, mins)


def _exact_activations(rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Integers in [-15, 15] with one +-127 per 32-block: each block's scale is exactly 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-15, 16, (rows, in_features), generator=g).float()
    for b in range(0, in_features, 32):
        width = min(32, in_features - b)
        where = torch.randint(0, width, (rows,), generator=g)
        sign = torch.randint(0, 2, (rows,), generator=g).float() * 2 - 1
        x[torch.arange(rows), b + where] = 127 * sign
    return x


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("path", PATHS, ids=_path_id)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_path_equals_the_portable_path_bit_for_bit(path, name, levels):
    for rows in ROWS:
        weight = _exact_weight(name, 37, 160, seed=rows)  # 37 outputs: a tail of 5 past 4 tiles of 8
        x = _exact_activations(rows, 160, seed=100 + rows)
        portable = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0, levels=levels)
        got = quant_ops.gemm(x, *weight._kernel_args(), isa_override=path[0], tiled=path[1], levels=levels)
        assert torch.equal(got, portable), rows
        # the activations quantize to themselves, so this is the dequantized product, exactly
        assert torch.equal(portable, x @ weight.dequantize().T), rows


@pytest.mark.parametrize("in_features", [576, 800, 1536])
@pytest.mark.parametrize("path", PATHS, ids=_path_id)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_wide_rows_with_a_partial_last_chunk_of_scales_give_the_portable_bits(path, name, in_features):
    """Rows of 8 to 48 scale groups, a multiple of the vector kernels' 8- or 16-group chunks or not
    (576 / 32 = 18, 800 / 32 = 25, 1536 / 128 = 12): every chunk of each pass's scale transpose,
    the short last one included, against the portable path."""
    weight = _exact_weight(name, 21, in_features, seed=in_features)  # a pass of 16 or 8 and a tail
    for rows in (1, 5):
        x = _exact_activations(rows, in_features, seed=7 + rows)
        portable = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0)
        got = quant_ops.gemm(x, *weight._kernel_args(), isa_override=path[0], tiled=path[1])
        assert torch.equal(got, portable), rows
        assert torch.equal(portable, x @ weight.dequantize().T), rows


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("isa", [isa for isa in quant_ops.runnable_isas() if isa > 0] if PATHS else [])
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_the_tiled_kernels_bands_of_rows_give_the_same_bits(isa, name, levels):
    """Many rows of a long input go through the tiled kernel in bands of row tiles (each
    band's activations sized to stay in L2, 384 KB): 213 rows of 2,048 inputs make two or
    three bands, the last one partial, and the result equals the portable path's."""
    weight = _exact_weight(name, 37, 2048, seed=7)
    x = _exact_activations(213, 2048, seed=8)
    portable = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0, levels=levels)
    got = quant_ops.gemm(x, *weight._kernel_args(), isa_override=isa, tiled=True, levels=levels)
    assert torch.equal(got, portable)
    assert torch.equal(portable, x @ weight.dequantize().T)


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("path", PATHS, ids=_path_id)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_path_matches_the_dequantized_reference(path, name, levels):
    bits, _, group, _ = FORMATS[name]
    w = torch.randn(70, 576, generator=torch.Generator().manual_seed(1))
    weight = quantize_rtn(w, bits, group) if name.startswith("int") else _exact_weight(name, 70, 576, seed=1)
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(2))
    want = x @ weight.dequantize().T
    got = quant_ops.gemm(x, *weight._kernel_args(), isa_override=path[0], tiled=path[1], levels=levels)
    assert ((got - want).norm() / want.norm()).item() < ACTIVATION_RTOL[levels]
    portable = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0, levels=levels)
    assert torch.equal(got, portable)  # one float sequence on every path


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("path", PATHS, ids=_path_id)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_rows_output_does_not_depend_on_the_other_rows_of_the_call(path, name, levels):
    """Batch invariance on random data: each row alone, in pairs and in the whole call (per-row
    kernel below the tiled kernel's row count, tiled from it) gives the same bits."""
    bits, _, group, _ = FORMATS[name]
    w = torch.randn(53, 200, generator=torch.Generator().manual_seed(5))  # 53 outputs: partial passes
    weight = quantize_rtn(w, bits, group) if name.startswith("int") else _exact_weight(name, 53, 200, seed=5)
    x = torch.randn(21, 200, generator=torch.Generator().manual_seed(6)) * 2
    args = weight._kernel_args()
    together = quant_ops.gemm(x, *args, isa_override=path[0], tiled=path[1], levels=levels)
    for i in range(x.shape[0]):
        alone = quant_ops.gemm(x[i : i + 1], *args, isa_override=path[0], tiled=path[1], levels=levels)
        assert torch.equal(alone[0], together[i]), i
    for i in range(0, x.shape[0] - 1, 2):
        pair = quant_ops.gemm(x[i : i + 2], *args, isa_override=path[0], tiled=path[1], levels=levels)
        assert torch.equal(pair, together[i : i + 2]), i
    assert torch.equal(together, quant_ops.gemm(x, *args, isa_override=0, levels=levels))


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("isa", quant_ops.runnable_isas() if quant_ops.available() else [])
@pytest.mark.parametrize("in_features", [64, 96, 576])  # 96: a partial block past the last whole one
def test_activation_quantization_is_the_same_bytes_on_every_path(isa, in_features, levels):
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(3)) * 3
    x[1, :32] = 0  # an all-zero block: scale 0
    padded = -(-in_features // 64) * 64
    portable = quant_ops.quantize_activations(x, padded, isa_override=0, levels=levels)
    got = quant_ops.quantize_activations(x, padded, isa_override=isa, levels=levels)
    assert set(got) == set(portable) == {"xq", "dx", "xsum"} | ({"xq2"} if levels == 2 else set())
    for name, tensor in portable.items():
        assert torch.equal(got[name], tensor), name
    # the codes are round(t) for t = x * 127 / amax per 32-block; the second level round(256 (t - q1))
    blocks = torch.nn.functional.pad(x, (0, padded - in_features)).reshape(5, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    t = torch.where(amax > 0, blocks * torch.where(amax > 0, 127 / amax, torch.zeros(())), torch.zeros(()))
    q1 = torch.round(t)
    assert torch.equal(portable["xq"].reshape(5, -1, 32).float(), q1)
    sum1 = portable["xq"].reshape(5, -1, 32).sum(-1, dtype=torch.int32)
    if levels == 1:
        assert torch.equal(portable["xsum"], sum1)
        assert torch.equal(portable["dx"], (amax / 127).squeeze(-1))
        return
    q2 = torch.round((t - q1) * 256).clamp(-127, 127)
    assert torch.equal(portable["xq2"].reshape(5, -1, 32).float(), q2)
    assert torch.equal(portable["xsum"], 256 * sum1 + portable["xq2"].reshape(5, -1, 32).sum(-1, dtype=torch.int32))
    assert torch.equal(portable["dx"], (amax / 127 / 256).squeeze(-1))
    # x ~ dx (256 q1 + q2) to within a step of the finer level (half a step but where the clamp bites)
    rebuilt = portable["dx"][..., None] * (256 * q1 + q2)
    assert ((rebuilt - blocks).abs() <= portable["dx"][..., None] * 1.001).all()


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("isa", [i for i in quant_ops.runnable_isas() if i > 0] if quant_ops.available() else [])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_row_counts_above_reach_the_tiled_kernel_as_dispatched(isa, bits, levels):
    tiled = [r for r in ROWS if r >= quant_ops.tiled_min_rows(bits, isa, levels)]
    assert 1 not in tiled and len(tiled) >= 3  # a tile and a partial one, as gemm dispatches them
    assert quant_ops.tiled_min_rows(bits, 0, levels) is None
    # twice the integer work per tile: two levels tile from no fewer rows than one
    assert quant_ops.tiled_min_rows(bits, min(isa, 2), 2) >= quant_ops.tiled_min_rows(bits, min(isa, 2), 1)


def test_a_path_the_cpu_lacks_or_an_unknown_name_is_refused(monkeypatch):
    weight = quantize_rtn(torch.randn(8, 64), 4, 32)
    with pytest.raises(ValueError, match="not one this CPU runs"):
        quant_ops.gemm(torch.randn(1, 64), *weight._kernel_args(), isa_override=max(quant_ops.ISA_NAMES) + 1)
    with pytest.raises(ValueError, match="activation levels must be 1 or 2"):
        quant_ops.gemm(torch.randn(1, 64), *weight._kernel_args(), levels=3)
    monkeypatch.setenv(quant_ops.ISA_ENV, "avx2")
    assert quant_ops.requested_isa(2) == 1
    monkeypatch.setenv(quant_ops.ISA_ENV, "AVX512-VNNI")
    with pytest.raises(ConfigError, match="this CPU runs only portable, avx2"):
        quant_ops.requested_isa(1)
    monkeypatch.setenv(quant_ops.ISA_ENV, "sse2")
    with pytest.raises(ConfigError, match="'sse2' is not a quantized-kernel path"):
        quant_ops.requested_isa(2)
    monkeypatch.setenv(quant_ops.ISA_ENV, "auto")
    assert quant_ops.requested_isa(1) == 1


def test_the_environment_variable_picks_the_path_at_load():
    code = ("from pagedllm.native import quant_ops; assert quant_ops.available(); "
            "print(quant_ops.ISA_NAMES[quant_ops.isa()])")
    env = {**os.environ, quant_ops.ISA_ENV: "portable", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "portable"


def test_kernel_bench_times_each_asked_path(capsys):
    from pagedllm.quant import kernel_bench

    paths = ",".join(quant_ops.ISA_NAMES[isa] for isa in quant_ops.runnable_isas())
    assert kernel_bench.main(["--rows", "1,9", "--shapes", "64x128", "--paths", paths]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 1 | 64x128 |") and lines[3].startswith("| 9 | 64x128 |")
    cells = lines[3].strip("|").split("|")
    assert len(cells) == 2 + 1 + 2 * len(quant_ops.runnable_isas()) + 2
    assert all(float(c) > 0 for c in cells[2:])
    with pytest.raises(ConfigError, match="not a kernel path"):
        kernel_bench.main(["--paths", "portable-rows"])
    with pytest.raises(ConfigError, match="--threads 1"):
        kernel_bench.main(["--clock", "cpu", "--threads", "2"])
    assert kernel_bench.main(["--rows", "4", "--shapes", "64x128", "--clock", "cpu", "--paths", "portable"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[2].startswith("| 4 | 64x128 |")


@pytest.mark.parametrize("levels", LEVELS)
def test_every_path_gives_the_same_bits_on_two_threads(levels):
    weight = _exact_weight("Q4_1", 301, 576, seed=7)  # 301 x 576 x 40: large enough to run in parallel
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(8))
    portable = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0, levels=levels)
    torch.set_num_threads(2)
    try:
        for isa, tiled in PATHS:
            got = quant_ops.gemm(x, *weight._kernel_args(), isa_override=isa, tiled=tiled, levels=levels)
            assert torch.equal(got, portable), (isa, tiled)
    finally:
        torch.set_num_threads(1)


AMX = 3  # the AVX-512 VNNI + AMX-INT8 path


@pytest.mark.skipif(not quant_ops.available() or AMX not in quant_ops.runnable_isas(),
                    reason="this CPU has no AMX tiles (or the kernel refuses them)")
@pytest.mark.parametrize("levels", LEVELS)
def test_the_amx_kernel_and_onednns_amx_matmuls_share_threads(levels):
    """Both configure the tile registers on the same OpenMP threads; each must leave them so
    that the other's next call still computes its own result (a tile left unconfigured
    would raise SIGILL, a wrong configuration would give wrong sums)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        weight = quantize_rtn(torch.randn(200, 576, generator=torch.Generator().manual_seed(7)), 4, 32)
        args = weight._kernel_args()
        x = torch.randn(40, 576, generator=torch.Generator().manual_seed(8))
        a, b = torch.randn(64, 576).bfloat16(), torch.randn(300, 576).bfloat16()
        want_q = quant_ops.gemm(x, *args, isa_override=0, levels=levels)
        want_d = torch.nn.functional.linear(a, b)
        for _ in range(50):
            assert torch.equal(quant_ops.gemm(x, *args, isa_override=AMX, tiled=True, levels=levels), want_q)
            assert torch.equal(torch.nn.functional.linear(a, b), want_d)
    finally:
        torch.set_num_threads(previous)


needs_amx_bf16 = pytest.mark.skipif(not quant_ops.amx_bf16_available(), reason="this CPU has no AMX-BF16 tiles")


@needs_amx_bf16
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 64), (17, 37, 160), (64, 48, 576), (70, 21, 96)])
def test_the_amx_bf16_kernel_multiplies_by_the_dequantized_bfloat16_weights(name, rows, out_features, in_features):
    """On exact inputs (every product and partial sum exact in float32) the kernel's output is
    bit for bit x times dequantize() cast to bfloat16, rounded to bfloat16 once: the panel holds
    exactly the dense bfloat16 model's weights, in the right places, whatever the row count,
    padding (160 and 96 inputs pad to 192 and 128) or output count."""
    weight = _exact_weight(name, out_features, in_features, seed=rows + out_features)
    x = _exact_activations(rows, in_features, seed=in_features).bfloat16()
    got = quant_ops.gemm_bf16(x, *weight._kernel_args())
    dense = weight.dequantize().bfloat16()
    want = (x.float() @ dense.float().T).bfloat16()
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert torch.equal(got, want)


@needs_amx_bf16
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_amx_bf16_kernel_matches_the_dense_bfloat16_matmul_on_random_inputs(name):
    bits, _, group, _ = FORMATS[name]
    weight = quantize_rtn(torch.randn(100, 576, generator=torch.Generator().manual_seed(1)), bits, group)
    x = torch.randn(80, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = quant_ops.gemm_bf16(x, *weight._kernel_args()).double()
    want = x.double() @ weight.dequantize().bfloat16().double().T  # float64: only the kernel rounds
    # float32 sums in another order, then one rounding to bfloat16 (8 bits): within 2^-8 relative
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-3).all()


@needs_amx_bf16
def test_bfloat16_activations_take_the_amx_bf16_kernel_from_its_row_count(monkeypatch):
    weight = quantize_rtn(torch.randn(64, 192, generator=torch.Generator().manual_seed(3)), 4, 32)
    many = torch.randn(quant_ops.AMX_BF16_MIN_ROWS, 192, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert torch.equal(weight.apply(many), quant_ops.gemm_bf16(many, *weight._kernel_args()))
    few = many[: quant_ops.AMX_BF16_MIN_ROWS - 1]
    assert torch.equal(weight.apply(few), quant_ops.gemm(few.float(), *weight._kernel_args()).bfloat16())
    monkeypatch.setenv("PAGEDLLM_QUANT_BF16_AMX", "0")
    assert not quant_ops.amx_bf16_available()
    assert torch.equal(weight.apply(many), quant_ops.gemm(many.float(), *weight._kernel_args()).bfloat16())


TABLE_PATHS = [isa for isa in quant_ops.ROW_TABLE_COLS if isa in quant_ops.runnable_isas()] if PATHS else []


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("isa", TABLE_PATHS)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_per_row_kernel_reading_row_scale_tables_gives_the_same_bits(isa, name, levels):
    """Row-scale tables replace the per-pass transpose of the scales and mins: the same values
    in pass order, so the same bits as the transposing kernel and the portable path, on
    random inputs, for widths whose scales fill whole chunks or not, and output counts with a
    short last pass."""
    bits = FORMATS[name][0]
    for out_features, in_features in ((37, 160), (8, 576), (21, 800), (64, 1536)):
        weight = _exact_weight(name, out_features, in_features, seed=out_features)
        tables = quant_ops.row_scale_tables(weight.scales, weight.mins, isa)
        cols = quant_ops.ROW_TABLE_COLS[isa]
        # the layout: entry (pass, group, lane) is scales[pass * cols + lane, group], zeros past N
        groups = weight.scales.shape[1]
        assert tables[0].shape == (-(-out_features // cols), groups, cols)
        for table, source in zip(tables, (weight.scales, weight.mins), strict=True):
            if source is None:
                assert table is None
                continue
            for n in range(tables[0].shape[0] * cols):
                want = source[n] if n < out_features else torch.zeros(groups, dtype=torch.float16)
                assert torch.equal(table[n // cols, :, n % cols], want), n
        for rows in (1, 2, 3, 5):
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
            portable = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0, levels=levels)
            plain = quant_ops.gemm(x, *weight._kernel_args(), isa_override=isa, tiled=False, levels=levels)
            read = quant_ops.gemm(x, *weight._kernel_args(), isa_override=isa, tiled=False, levels=levels,
                                  tables=tables)
            bound = quant_ops.bind_gemm(*weight._kernel_args(), levels=levels, isa_override=isa, tables=tables)
            assert torch.equal(plain, portable), (out_features, in_features, rows)
            assert torch.equal(read, portable), (out_features, in_features, rows)
            if rows < quant_ops.tiled_min_rows(bits, isa, levels):
                assert torch.equal(bound(x), portable), (out_features, in_features, rows)


def test_row_scale_tables_of_another_shape_are_refused():
    weight = quantize_rtn(torch.randn(16, 128), 4, 32)
    other = quantize_rtn(torch.randn(24, 128), 4, 32)
    for isa in TABLE_PATHS:
        tables = quant_ops.row_scale_tables(other.scales, other.mins, isa)
        with pytest.raises(ValueError, match="do not fit scales"):
            quant_ops.gemm(torch.randn(1, 128), *weight._kernel_args(), isa_override=isa, tables=tables)
        # a path whose kernel reads no tables ignores them
        assert torch.equal(quant_ops.gemm(torch.randn(1, 128).zero_(), *weight._kernel_args(), isa_override=0,
                                          tables=tables), torch.zeros(1, 16))


def test_a_weight_makes_its_row_tables_once_where_its_kernel_reads_them(monkeypatch):
    weight = quantize_rtn(torch.randn(40, 576), 4, 32)
    assert weight.table_nbytes == 0
    x = torch.randn(1, 576)
    want = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0)
    monkeypatch.setenv(quant_ops.ROW_TABLES_ENV, "0")
    assert weight.row_tables() is None
    assert torch.equal(weight.apply(x), want) and weight.table_nbytes == 0
    monkeypatch.setenv(quant_ops.ROW_TABLES_ENV, "1")
    tables = weight.row_tables()
    if quant_ops.isa() not in quant_ops.ROW_TABLE_COLS:
        assert tables is None and weight.table_nbytes == 0
    else:  # as many bytes again as the scales and mins, the last pass padded (40 outputs: 5 passes of 8, 3 of 16)
        cols = quant_ops.ROW_TABLE_COLS[quant_ops.isa()]
        padded = (40 + cols - 1) // cols * cols
        assert weight.row_tables() is tables
        assert weight.table_nbytes == (weight.scales.nbytes + weight.mins.nbytes) * padded // 40
        assert weight.rows(0, 8).table_nbytes == 0  # a shard makes its own
    assert torch.equal(weight.apply(x), want)
    monkeypatch.setenv(quant_ops.ROW_TABLES_ENV, "yes")
    with pytest.raises(ConfigError, match="PAGEDLLM_QUANT_ROW_TABLES must be 0 or 1"):
        weight.row_tables()
