"""Dense CPU weights are held once: oneDNN's packed copy replaces the plain tensor at bind.

The plain ``weight`` of every bound linear layer (and of an untied LM head)
is freed once its packed copy exists; moves, casts, reloads, quantization
and ``state_dict()`` get the plain values back from the packed copy, bit
for bit. The oracle is the checkpoint as HF transformers loads it.
"""

from __future__ import annotations

import pytest
import torch
from test_server_fuzz import make_tiny_llama
from transformers import LlamaForCausalLM

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.layers.dispatch import onednn_linear_available
from pagedllm.layers.embedding import ParallelLMHead
from pagedllm.layers.linear import LinearBase, dense_bf16_amx_available
from pagedllm.models.loader import load_model, quantize_model
from pagedllm.quant.bench import weight_bytes

pytestmark = pytest.mark.skipif(
    not onednn_linear_available(torch.float32), reason="this torch build has no packed oneDNN linear"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(directory)
    return directory


@pytest.fixture(scope="module")
def hf_state(tiny_dir) -> dict[str, torch.Tensor]:
    hf = LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32)
    return {k.removeprefix("model."): v for k, v in hf.state_dict().items()}


def load(directory, dtype=torch.float32):
    return load_model(str(directory), dtype=dtype, device=torch.device("cpu"),
                      attn_backend=TorchAttentionBackend()).model


def linears(model) -> list[LinearBase]:
    found = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert found
    return found


def test_each_bound_matrix_is_held_once_with_the_checkpoint_values(tiny_dir, hf_state):
    model = load(tiny_dir)
    for layer in linears(model):
        assert layer.weight.numel() == 0  # the plain copy is gone
        assert layer.matmul.nbytes == layer.output_size * layer.input_size * 4  # one full copy, packed
    for i, layer in enumerate(model.layers):
        assert torch.equal(layer.self_attn.o_proj.dense_weight(), hf_state[f"layers.{i}.self_attn.o_proj.weight"])
        assert torch.equal(layer.mlp.down_proj.dense_weight(), hf_state[f"layers.{i}.mlp.down_proj.weight"])
    state = model.state_dict()
    for name in ("layers.0.mlp.down_proj.weight", "layers.1.self_attn.o_proj.weight", "embed_tokens.weight"):
        assert torch.equal(state[name], hf_state[name]), name
    # this model's LM head is untied: its own matrix is held once too
    head = model.lm_head
    assert isinstance(head, ParallelLMHead) and not head._tied
    assert head.weight.numel() == 0 and torch.equal(head.dense_weight(), hf_state["lm_head.weight"])
    assert torch.equal(state["lm_head.weight"], hf_state["lm_head.weight"])
    # the parameters plus the packed copies: every matrix exactly once
    assert weight_bytes(model) == sum(t.numel() * 4 for t in hf_state.values())


def test_a_cast_restores_the_plain_weights_and_the_next_bind_packs_them_again(tiny_dir):
    model = load(tiny_dir)
    reference = load(tiny_dir, torch.bfloat16)
    model.to(torch.bfloat16)
    o_proj = model.layers[0].self_attn.o_proj
    assert o_proj.weight.numel() > 0 and o_proj.weight.dtype == torch.bfloat16  # back, cast
    model.bind_kernels()
    # bfloat16 is packed where the CPU has a bf16 kernel (AMX tiles, or oneDNN's native bf16);
    # an AVX2 CPU computes it through F.linear, which needs the plain tensor, its only copy
    packs = dense_bf16_amx_available() or onednn_linear_available(torch.bfloat16)
    assert all((layer.weight.numel() == 0) == packs for layer in linears(model))
    x = torch.randn(5, o_proj.input_size, dtype=torch.bfloat16)
    expected = reference.layers[0].self_attn.o_proj(x)
    assert torch.equal(o_proj(x), expected)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_reloading_weights_into_a_bound_model_replaces_them(tiny_dir, hf_state):
    model = load(tiny_dir)
    doubled = {f"model.{name}": 2 * tensor for name, tensor in hf_state.items()}
    model.load_weights(doubled.items())
    gate_up = model.layers[1].mlp.gate_up_proj
    assert gate_up.weight.numel() == 0
    expected = torch.cat([doubled["model.layers.1.mlp.gate_proj.weight"], doubled["model.layers.1.mlp.up_proj.weight"]])
    assert torch.equal(gate_up.dense_weight(), expected)


def test_quantizing_a_bound_model_reads_the_real_weights(tiny_dir, hf_state):
    model = load(tiny_dir)
    quantize_model(model, bits=8, group_size=32)
    packed = model.layers[0].self_attn.o_proj.method.weight
    original = hf_state["layers.0.self_attn.o_proj.weight"]
    error = (packed.dequantize().float() - original).abs().max().item()
    assert 0 < error < original.abs().max().item() / 100  # 8-bit RTN of the values, not of zeros
