"""Dense bfloat16 matmuls on the AMX-BF16 tiles (quant_ops.c ``gemm_amx_bf16_dense``), or on
VDPBF16PS where the CPU has AVX512-BF16 without AMX (``gemm_dp_bf16_dense``): whichever this
CPU runs (``quant_ops.dense_bf16_kernel()``).

The oracle is the float32 product of the same bfloat16 values, rounded to
bfloat16 once: the kernel's float32 sums differ from it only in their order,
so every output is within one bfloat16 step of it. A row's output must not
depend on the other rows of the call, and the layer must give its weight back
bit for bit. Skipped where the CPU has neither (the layers then run on
oneDNN, which the rest of the suite covers).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers import linear
from pagedllm.native import quant_ops

needs_amx_bf16 = pytest.mark.skipif(
    not quant_ops.dense_bf16_available(), reason="no AMX-BF16 or AVX512-BF16 on this CPU"
)


def _case(rows: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    return x, w, bias


def _within_one_step(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().t()
    if bias is not None:
        exact += bias.double()
    want = exact.to(torch.bfloat16)
    # one bfloat16 step of the exact value (2^-7 relative), and an absolute floor for sums near 0
    step = exact.abs().clamp_min(1e-3) * 2.0**-7
    assert ((got.double() - want.double()).abs() <= step + 1e-12).all()
    assert (got == want).float().mean() > 0.9  # mostly the very rounding of the exact value


def test_pack_round_trips_any_shape():
    for n, k in [(16, 32), (17, 33), (1, 5), (960, 576), (40, 100)]:
        w = torch.randn(n, k).bfloat16()
        packed = quant_ops.dense_bf16_pack(w)
        assert packed.shape == (-(-n // 16), -(-k // 32), 16, 16, 2)
        assert torch.equal(quant_ops.dense_bf16_unpack(packed, n, k), w)
        # the layout the tiles read: packed[g, b, kk, n, j] = w[16 g + n, 32 b + 2 kk + j]
        g, b, kk, nn_, j = 0, min(1, packed.shape[1] - 1), 3, min(5, n - 1), 1
        if 32 * b + 2 * kk + j < k:
            assert packed[g, b, kk, nn_, j] == w[16 * g + nn_, 32 * b + 2 * kk + j]


@needs_amx_bf16
@pytest.mark.parametrize("rows,n,k", [(1, 16, 32), (3, 960, 576), (17, 40, 100), (64, 576, 1536),
                                      (300, 200, 64), (513, 48, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_against_the_rounded_exact_product(rows, n, k, with_bias):
    x, w, bias = _case(rows, n, k)
    bias = bias if with_bias else None
    got = quant_ops.dense_bf16_linear(x, quant_ops.dense_bf16_pack(w), n, bias)
    assert got is not None and got.shape == (rows, n) and got.dtype == torch.bfloat16
    _within_one_step(got, x, w, bias)


@needs_amx_bf16
def test_wide_outputs_at_many_rows_take_the_same_sums():
    # an LM head's width from 512 rows walks row pairs outside the outputs: same bits as one row
    x, w, bias = _case(520, 16400, 64, seed=2)
    packed = quant_ops.dense_bf16_pack(w)
    whole = quant_ops.dense_bf16_linear(x, packed, 16400, bias)
    _within_one_step(whole, x, w, bias)
    for lo, hi in [(0, 1), (511, 520), (100, 164)]:
        assert torch.equal(quant_ops.dense_bf16_linear(x[lo:hi].contiguous(), packed, 16400, bias), whole[lo:hi])


@needs_amx_bf16
def test_no_rows_give_an_empty_result():
    x, w, bias = _case(0, 40, 64)
    got = quant_ops.dense_bf16_linear(x, quant_ops.dense_bf16_pack(w), 40, bias)
    assert got is not None and got.shape == (0, 40)


@needs_amx_bf16
@pytest.mark.parametrize("k", [576, 100])  # rows read in place, and every row copied padded
def test_a_row_gets_the_same_bits_in_any_batch(k):
    x, w, bias = _case(300, 96, k, seed=1)
    packed = quant_ops.dense_bf16_pack(w)
    whole = quant_ops.dense_bf16_linear(x, packed, 96, bias)
    for lo, hi in [(0, 1), (5, 6), (17, 33), (255, 300), (299, 300), (0, 64)]:
        assert torch.equal(quant_ops.dense_bf16_linear(x[lo:hi].contiguous(), packed, 96, bias), whole[lo:hi])


@needs_amx_bf16
def test_layers_take_the_tiles_and_give_their_weight_back(monkeypatch):
    w = torch.randn(96, 64).bfloat16()
    layer = linear.RowParallelLinear(64, 96, bias=False)
    layer.to(torch.bfloat16)
    layer.load_weight("weight", w, 0, "w")
    layer.bind(w.device, w.dtype)
    assert isinstance(layer.matmul, linear.AmxBf16Matmul)
    assert linear.weight_released(layer) and torch.equal(layer.dense_weight(), w)
    assert torch.equal(layer.state_dict()["weight"], w)
    x = torch.randn(2, 3, 64).bfloat16()  # leading dimensions kept
    got = layer(x)
    assert got.shape == (2, 3, 96)
    _within_one_step(got.reshape(6, 96), x.reshape(6, 64), w, None)
    monkeypatch.setenv(linear.DENSE_BF16_AMX_ENV, "0")
    assert not isinstance(linear.dense_matmul(w), linear.AmxBf16Matmul)
    # float32 weights never take the bfloat16 kernel
    monkeypatch.delenv(linear.DENSE_BF16_AMX_ENV)
    assert not isinstance(linear.dense_matmul(w.float()), linear.AmxBf16Matmul)


@needs_amx_bf16
@pytest.mark.parametrize("rows,n,k,with_bias", [(1, 40, 64, False), (64, 960, 576, True), (520, 16400, 64, False)])
def test_float32_outputs_are_the_bfloat16_ones_widened(rows, n, k, with_bias):
    # the last case takes the wide path (outputs of 32 KiB or more from 512 rows)
    x, w, bias = _case(rows, n, k, seed=3)
    bias = bias if with_bias else None
    packed = quant_ops.dense_bf16_pack(w)
    rounded = quant_ops.dense_bf16_linear(x, packed, n, bias)
    widened = quant_ops.dense_bf16_linear(x, packed, n, bias, out_dtype=torch.float32)
    assert widened.dtype == torch.float32 and widened.shape == (rows, n)
    assert torch.equal(widened, rounded.float())


@needs_amx_bf16
def test_a_tied_lm_head_gives_float32_logits_of_its_bfloat16_matmul():
    from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    gen = torch.Generator().manual_seed(4)
    embedding = VocabParallelEmbedding(1000, 64)
    embedding.weight.data = (torch.randn(1000, 64, generator=gen) * 0.05).bfloat16()
    head = ParallelLMHead(1000, 64, tied=embedding)
    head.bind(torch.device("cpu"), torch.bfloat16)
    assert isinstance(head.matmul, linear.AmxBf16Matmul)
    hidden = torch.randn(5, 64, generator=gen).bfloat16()
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (5, 1000)
    assert torch.equal(logits, head.matmul(hidden, embedding.weight, None).float())
    _within_one_step(logits.bfloat16(), hidden, embedding.weight.data, None)


def test_glu_pack_pairs_the_halves_groups_and_round_trips():
    for n, k in [(16, 32), (40, 70), (1536, 576), (17, 64)]:
        w = torch.randn(2 * n, k).bfloat16()
        packed = quant_ops.dense_bf16_pack_glu(w)
        groups = -(-n // 16)
        assert packed.shape == (2 * groups, -(-k // 32), 16, 16, 2)
        assert torch.equal(quant_ops.dense_bf16_unpack_glu(packed, n, k), w)
        # group 2 g holds gate rows 16 g .., group 2 g + 1 the up rows 16 g .. (n + 16 g ..)
        g = groups - 1
        assert torch.equal(packed[2 * g, 0, 0, 0], w[16 * g, :2])
        assert torch.equal(packed[2 * g + 1, 0, 0, 0], w[n + 16 * g, :2])


@needs_amx_bf16
@pytest.mark.parametrize("rows,n,k", [(1, 1536, 576), (3, 40, 70), (64, 1536, 576), (33, 17, 64),
                                      (600, 96, 96), (2048, 64, 576)])
def test_fused_silu_gives_the_bits_of_the_product_then_silu_mul(rows, n, k):
    from pagedllm.native import cpu_ops

    assert cpu_ops.available()
    gen = torch.Generator().manual_seed(rows + n)
    w = (torch.randn(2 * n, k, generator=gen) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[0, :8] = 40.0  # gates far out on both tails of the exponential
    w[:8, :8] *= -1
    two_passes = cpu_ops.silu_mul(quant_ops.dense_bf16_linear(x, quant_ops.dense_bf16_pack(w), 2 * n))
    fused = quant_ops.dense_bf16_silu_mul(x, quant_ops.dense_bf16_pack_glu(w), n)
    assert fused.shape == (rows, n) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, two_passes)


@needs_amx_bf16
def test_a_glu_projection_fuses_its_activation_and_keeps_its_weight():
    from pagedllm.layers import SiluAndMul

    gen = torch.Generator().manual_seed(8)
    n, k = 40, 64
    gate, up = (torch.randn(n, k, generator=gen) * 0.1).bfloat16(), (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    layer = linear.MergedColumnParallelLinear(k, [(0, n), (0, n)], False, linear.SINGLE_PROCESS, glu=True)
    layer.to(torch.bfloat16)
    layer.load_weight("weight", gate, 0, "gate")
    layer.load_weight("weight", up, 1, "up")
    layer.bind(gate.device, gate.dtype)
    assert isinstance(layer.matmul, linear.AmxBf16Matmul) and layer.matmul.glu
    assert torch.equal(layer.dense_weight(), torch.cat([gate, up]))  # the plain order, for state_dict and casts
    act = SiluAndMul()
    act.bind(gate.device, torch.bfloat16)
    x = torch.randn(6, k, generator=gen).bfloat16()
    plain = layer(x)  # the unfused product, back in [gate | up] order
    assert plain.shape == (6, 2 * n)
    _within_one_step(plain, x, torch.cat([gate, up]), None)
    fused = act.after(layer, x)
    assert fused.shape == (6, n) and torch.equal(fused, act(plain))
    assert torch.equal(layer.matmul.silu_mul(x.view(2, 3, k)), fused.view(2, 3, n))  # leading dimensions kept
    # without glu the same layer takes the plain kernel and the two steps
    other = linear.MergedColumnParallelLinear(k, [(0, n), (0, n)], False, linear.SINGLE_PROCESS)
    other.to(torch.bfloat16)
    other.load_weight("weight", gate, 0, "gate")
    other.load_weight("weight", up, 1, "up")
    other.bind(gate.device, gate.dtype)
    assert not other.matmul.glu and torch.equal(act.after(other, x), fused)
