"""Quantized weight formats against their dequantized reference, and loading them.

Each format's ``dequantize()`` must reproduce the ``gguf`` package's own
dequantization of the same blocks bit for bit (GGUF formats) or the RTN
rounding (int4/int8); ``apply()`` must agree with ``x @ dequantize().T`` to
within the error of quantizing the activations to int8 per 32; the AVX-512
VNNI kernel and the portable C path compute the same integer sums.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from test_gguf_loader import _hf_model, _prefill_logits, _state, _write_gguf

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.config import EngineConfig
from pagedllm.distributed import TensorParallelGroup
from pagedllm.errors import ConfigError
from pagedllm.layers.linear import LinearBase
from pagedllm.models.loader import load_model
from pagedllm.native import quant_ops
from pagedllm.quant import QuantizedWeight, from_gguf_blocks, quantize_rtn
from pagedllm.quant.layers import (
    QuantizedEmbedding,
    QuantizedLinearMethod,
    QuantizedLMHead,
    QuantizedRowParallelMethod,
)

GGUF_TYPES = {"Q4_0": QType.Q4_0, "Q4_1": QType.Q4_1, "Q8_0": QType.Q8_0}
# int8 activations per 32-block: relative error of a dot product a few tenths of a percent
ACTIVATION_RTOL = 0.02

needs_kernels = pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the quantized kernels")


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


def _gguf_weight(name: str, rows: int, cols: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random matrix quantized by the gguf package, repacked; and the package's dequantization."""
    array = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    blocks = gguf.quants.quantize(array, GGUF_TYPES[name])
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, GGUF_TYPES[name]), dtype=np.float32))
    return from_gguf_blocks(name, blocks, cols), reference


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name", sorted(GGUF_TYPES))
@pytest.mark.parametrize("cols", [64, 96, 576])  # 96: one padding block
def test_gguf_blocks_repack_to_the_packages_dequantization(name, cols):
    weight, reference = _gguf_weight(name, 40, cols)
    assert weight.shape == (40, cols)
    assert torch.equal(weight.dequantize(), reference)
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[name]
    padded_cols = -(-cols // 64) * 64
    assert weight.nbytes == 40 * padded_cols // 32 * block_bytes  # the GGUF's bytes, plus padding blocks


@needs_kernels
@pytest.mark.parametrize("name", sorted(GGUF_TYPES))
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 64])
def test_gguf_apply_matches_the_dequantized_reference(name, rows):
    weight, reference = _gguf_weight(name, 70, 96, seed=1)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(2))
    want = x @ reference.T
    got = weight.apply(x)
    assert got.shape == (rows, 70)
    assert _relative_error(got, want) < ACTIVATION_RTOL
    portable = quant_ops.gemm(x, *weight._kernel_args(), isa_override=0)
    torch.testing.assert_close(got, portable, rtol=1e-5, atol=1e-4)


@needs_kernels
def test_apply_keeps_bfloat16_and_quantizes_activations_per_block():
    weight, reference = _gguf_weight("Q8_0", 16, 64, seed=3)
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 40] = 1000.0, 0.001  # far apart in magnitude, but in different blocks: both kept
    got = weight.apply(x)
    torch.testing.assert_close(got, x @ reference.T, rtol=1e-3, atol=1e-3)
    assert weight.apply(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_rtn_round_trip_and_apply(bits, group_size):
    w = torch.randn(48, 160, generator=torch.Generator().manual_seed(4))  # 160: padded to 192 / 256
    weight = quantize_rtn(w, bits, group_size)
    assert weight.shape == (48, 160) and weight.group_size == group_size
    back = weight.dequantize()
    # RTN error: at most half a step per weight
    step = (weight.scales.float().repeat_interleave(group_size, dim=1)[:, :160])
    assert ((back - w).abs() <= step / 2 + 1e-3).all()
    assert _relative_error(back, w) < (0.12 if bits == 4 else 0.01)
    if quant_ops.available():
        x = torch.randn(5, 160, generator=torch.Generator().manual_seed(5))
        assert _relative_error(weight.apply(x), x @ back.T) < ACTIVATION_RTOL
        torch.testing.assert_close(
            weight.apply(x), quant_ops.gemm(x, *weight._kernel_args(), isa_override=0), rtol=1e-5, atol=1e-4
        )


def test_rtn_refuses_unsupported_settings():
    with pytest.raises(ConfigError, match="group size 48"):
        quantize_rtn(torch.randn(4, 96), 4, 48)
    with pytest.raises(ConfigError, match="4 or 8 bits"):
        quantize_rtn(torch.randn(4, 96), 3, 32)


def test_embedding_rows_and_row_operations():
    weight, reference = _gguf_weight("Q4_1", 30, 64, seed=6)
    ids = torch.tensor([29, 0, 7, 7])
    assert torch.equal(weight.embed(ids), reference[ids])
    other, other_ref = _gguf_weight("Q4_1", 10, 64, seed=7)
    fused = QuantizedWeight.cat_rows([weight, other])
    assert torch.equal(fused.dequantize(), torch.cat([reference, other_ref]))
    flipped = weight.map_rows(lambda t: t.flip(0))
    assert torch.equal(flipped.dequantize(), reference.flip(0))
    with pytest.raises(ValueError, match="one format"):
        QuantizedWeight.cat_rows([weight, _gguf_weight("Q8_0", 4, 64)[0]])


def test_engine_config_refuses_unknown_quantization():
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="fp4")
    with pytest.raises(ConfigError, match="quantization_group_size"):
        EngineConfig(quantization="int4", quantization_group_size=16)
    assert EngineConfig(quantization="gguf", tensor_parallel_size=2).tensor_parallel_size == 2
    assert EngineConfig(quantization="none", tensor_parallel_size=2).tensor_parallel_size == 2


# ---------------------------------------------------------------- loading a model

QTYPES = {
    "model.embed_tokens.weight": QType.Q8_0,
    "model.layers.0.self_attn.q_proj.weight": QType.Q4_1,
    "model.layers.0.self_attn.k_proj.weight": QType.Q4_1,
    "model.layers.0.self_attn.v_proj.weight": QType.Q4_1,
    "model.layers.0.self_attn.o_proj.weight": QType.Q4_0,
    "model.layers.0.mlp.gate_proj.weight": QType.Q8_0,
    "model.layers.0.mlp.up_proj.weight": QType.Q8_0,
    "model.layers.0.mlp.down_proj.weight": QType.Q4_1,  # 96 columns: a padding block
    "model.layers.1.mlp.up_proj.weight": QType.Q5_0,  # no kernel: dequantized, with a warning
    "model.layers.1.mlp.gate_proj.weight": QType.Q5_0,
}


def _load(path, quantization: str, **options):
    return load_model(
        str(path), dtype=torch.float32, device=torch.device("cpu"), attn_backend=TorchAttentionBackend(),
        quantization=quantization, **options,
    )


def _packed(layer: LinearBase) -> QuantizedWeight | None:
    """The packed matrix a linear layer serves, None for a dense one."""
    return layer.method.weight if isinstance(layer.method, QuantizedLinearMethod) else None


@needs_kernels
def test_gguf_tensors_load_packed_and_match_the_dequantized_model(tmp_path, caplog):
    path = tmp_path / "tiny-q.gguf"
    _write_gguf(path, _state(_hf_model()), QTYPES)
    dense = _load(path, "none")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        packed = _load(path, "gguf")
    assert any("Q5_0" in r.getMessage() and "dequantized" in r.getMessage() for r in caplog.records)
    layer0, layer1 = packed.model.layers[0], packed.model.layers[1]
    assert _packed(layer0.self_attn.qkv_proj).format_name == "Q4_1"
    assert _packed(layer0.mlp.gate_up_proj).format_name == "Q8_0"
    assert _packed(layer0.self_attn.o_proj).format_name == "Q4_0"
    assert _packed(layer1.mlp.gate_up_proj) is None  # Q5_0: dense
    embed, head = packed.model.embed_tokens, packed.model.lm_head
    assert isinstance(embed, QuantizedEmbedding) and isinstance(head, QuantizedLMHead)
    assert embed.quantized is head.quantized  # tied: one packed matrix
    assert layer0.self_attn.qkv_proj.weight.numel() == 0  # no dense copy kept
    # the packed rows (q/k un-permuted, q|k|v fused) are the dense model's rows
    torch.testing.assert_close(
        _packed(layer0.self_attn.qkv_proj).dequantize(), dense.model.layers[0].self_attn.qkv_proj.dense_weight(),
        rtol=0, atol=0,
    )
    tokens = list(range(3, 60))
    want, got = _prefill_logits(dense, tokens), _prefill_logits(packed, tokens)
    assert _relative_error(got, want) < ACTIVATION_RTOL
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_rtn_quantizes_every_linear_layer_embedding_and_head(tmp_path, quantization):
    path = tmp_path / "tiny-f32.gguf"
    _write_gguf(path, _state(_hf_model()), {})
    dense = _load(path, "none")
    packed = _load(path, quantization, quantization_group_size=64)
    linears = [m for m in packed.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(_packed(m) is not None and _packed(m).format_name == quantization for m in linears)
    assert isinstance(packed.model.lm_head, QuantizedLMHead)
    assert packed.model.lm_head.quantized.format_name == quantization
    tokens = list(range(3, 60))
    want, got = _prefill_logits(dense, tokens), _prefill_logits(packed, tokens)
    assert _relative_error(got, want) < (0.02 if quantization == "int8" else 0.3)


@needs_kernels
def test_each_rank_serves_its_shard_of_the_packed_matrices(tmp_path):
    """Under TP=2 every packed matrix is this rank's part of the full one, the same bytes:
    column-parallel layers hold the dense model's shard on that rank; the row-parallel ones
    hold output rows over every input column (QuantizedRowParallelMethod)."""
    path = tmp_path / "tiny-q.gguf"
    _write_gguf(path, _state(_hf_model()), QTYPES)
    whole = _load(path, "none").model.layers[0]
    for rank in range(2):
        tp = TensorParallelGroup(rank=rank, size=2)
        dense, packed = _load(path, "none", tp=tp).model, _load(path, "gguf", tp=tp).model
        layer, want = packed.layers[0], dense.layers[0]
        for got, ref in [(layer.self_attn.qkv_proj, want.self_attn.qkv_proj),
                         (layer.mlp.gate_up_proj, want.mlp.gate_up_proj)]:
            assert isinstance(got.method, QuantizedLinearMethod)
            assert torch.equal(_packed(got).dequantize(), ref.dense_weight())
        for got, ref in [(layer.self_attn.o_proj, whole.self_attn.o_proj), (layer.mlp.down_proj, whole.mlp.down_proj)]:
            start, end = tp.shard(got.output_size)
            assert isinstance(got.method, QuantizedRowParallelMethod) and got.method.out_start == start
            assert torch.equal(_packed(got).dequantize(), ref.dense_weight()[start:end])
        embed = packed.embed_tokens
        assert isinstance(embed, QuantizedEmbedding) and embed.quantized is packed.lm_head.quantized
        assert (embed.vocab_start, embed.vocab_end) == (dense.embed_tokens.vocab_start, dense.embed_tokens.vocab_end)
        assert torch.equal(embed.quantized.dequantize(), dense.embed_tokens.weight)


def test_rtn_quantization_with_tensor_parallelism_is_refused(tmp_path):
    path = tmp_path / "tiny-f32.gguf"
    _write_gguf(path, _state(_hf_model()), {})
    with pytest.raises(ConfigError, match="int8.*tensor parallelism"):
        _load(path, "int8", tp=TensorParallelGroup(rank=0, size=2))
    with pytest.raises(ConfigError, match="int4.*tensor_parallel_size"):
        EngineConfig(quantization="int4", tensor_parallel_size=2)


def test_gguf_quantization_needs_a_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ConfigError, match="needs a .gguf model"):
        _load(tmp_path, "gguf")
