"""A SwiGLU's packed gate | up product and silu_mul in one pass (quant_ops.c, quant_linear_glu):
the bits of the product followed by cpu_ops' silu_mul on the rows, on every tiled path this CPU
runs, for rows and lane layouts, both activation levels and every format; and the layer stack
gives the same tokens and logprobs with it (at any size, or where the product would not fit the
L2s) and without it."""

from __future__ import annotations

import ctypes

import pytest
import torch
from test_quant_kernels import FORMATS, _exact_weight
from test_quant_kernels import _single_thread as _single_thread  # noqa: F401  (its autouse fixture)

from pagedllm import LLM, SamplingParams
from pagedllm.native import cpu_ops, quant_ops
from pagedllm.quant.formats import to_lanes

pytestmark = pytest.mark.skipif(
    not (quant_ops.available() and cpu_ops.available()), reason="native kernels do not build here"
)

TILED_PATHS = [isa for isa in (1, 2) if quant_ops.available() and isa in quant_ops.runnable_isas()]


def _silu_mul_f32() -> int:
    return ctypes.cast(cpu_ops._library.silu_mul_f32_serial, ctypes.c_void_p).value


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_fused_pass_gives_the_product_then_silu_mul_bit_for_bit(name, levels):
    """inter 40 (5 groups of 8, 10 of 4) and 64; rows 17 and 40 (whole and partial tiles of 16
    and 8); every tiled path, and the lane layout for 4-bit codes."""
    bits = FORMATS[name][0]
    if bits == 8 and FORMATS[name][1] != 128:
        pytest.skip("the AVX2 tiles take 8-bit codes with zero 128 only")
    for inter in (40, 64):
        weight = _exact_weight(name, 2 * inter, 576, seed=inter)
        layouts = [weight._kernel_args()]
        if bits == 4:
            layouts.append((to_lanes(weight.qweight), *weight._kernel_args()[1:]))
        for rows in (17, 40):
            x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3
            for isa in TILED_PATHS:
                for args in layouts:
                    product = quant_ops.gemm(x, *args, isa_override=isa, tiled=True, levels=levels)
                    want = cpu_ops.silu_mul(product)
                    got = quant_ops.gemm_glu(x, *args, _silu_mul_f32(), isa_override=isa, tiled=True, levels=levels)
                    assert got is not None, (inter, rows, isa)
                    assert torch.equal(got, want), (inter, rows, isa, args[0].dim())


def test_the_fused_pass_refuses_what_it_does_not_serve():
    weight = _exact_weight("Q4_1", 2 * 36, 576, seed=1)  # inter 36: not whole groups of 8
    x = torch.randn(20, 576)
    glu = _silu_mul_f32()
    if 2 in TILED_PATHS:
        assert quant_ops.gemm_glu(x, *weight._kernel_args(), glu, isa_override=2, tiled=True) is None
    if 1 in TILED_PATHS:  # groups of 4 on AVX2: 36 is whole
        got = quant_ops.gemm_glu(x, *weight._kernel_args(), glu, isa_override=1, tiled=True)
        want = cpu_ops.silu_mul(quant_ops.gemm(x, *weight._kernel_args(), isa_override=1, tiled=True))
        assert torch.equal(got, want)
    weight = _exact_weight("Q4_1", 2 * 64, 576, seed=2)
    for isa in TILED_PATHS:  # the per-row kernels' rows: not this path
        assert quant_ops.gemm_glu(x[:2], *weight._kernel_args(), glu, isa_override=isa, tiled=False) is None
    assert quant_ops.gemm_glu(x, *weight._kernel_args(), glu, isa_override=0) is None  # the portable path


def test_the_layer_stack_gives_the_same_tokens_with_and_without_the_fused_pass(tmp_path):
    from tiny_models import save_tiny_llama

    directory = save_tiny_llama(tmp_path / "tiny", vocab_size=512, hidden_size=256, intermediate_size=320,
                                num_hidden_layers=2)
    prompts = [{"prompt_token_ids": list(range(7 + 40 * i, 47 + 61 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    llm = LLM(str(directory), device="cpu", dtype="float32", quantization="int4", quantization_group_size=64,
              block_size=8, max_num_batched_tokens=96, enable_prefix_caching=False)  # each run prefills
    assert llm.llm_engine.worker.model.layer_stack is not None
    fused_calls = quant_ops._library.quant_glu_fused_calls

    def run() -> list:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(tuple(c.token_ids), tuple(tuple(sorted(p.items())) for p in c.logprobs)) for o in outputs
                for c in o.outputs]

    before = fused_calls()
    try:
        by_size = run()  # the default: these products (96 x 640 floats at most) stay in the L2s
        assert fused_calls() == before
        quant_ops._library.quant_set_glu_fusion(2)
        fused = run()
        between = fused_calls()
        quant_ops._library.quant_set_glu_fusion(0)
        plain = run()
    finally:
        quant_ops._library.quant_set_glu_fusion(1)
    assert between - before >= 2 * 2  # the prefill chunks took the fused pass in both layers
    assert fused_calls() == between  # and switched off, none did
    assert fused == plain == by_size


def test_a_bad_fusion_mode_is_a_config_error(monkeypatch):
    from pagedllm.errors import ConfigError

    monkeypatch.setenv(quant_ops.GLU_FUSION_ENV, "yes")
    with pytest.raises(ConfigError, match="PAGEDLLM_QUANT_GLU_FUSION"):
        quant_ops._glu_fusion_mode()
