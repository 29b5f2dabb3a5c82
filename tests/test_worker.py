"""The Worker on its own: what it prepares at start-up, before the first step."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as QType
from test_gguf_loader import _hf_model, _state, _write_gguf

from pagedllm.config import EngineConfig
from pagedllm.native import quant_ops
from pagedllm.worker.worker import Worker


@pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the quantized kernels")
def test_the_quantized_kernels_are_built_at_start_up_not_in_the_first_forward(tmp_path, monkeypatch):
    path = tmp_path / "tiny-q.gguf"
    qtypes = {f"model.layers.0.mlp.{name}_proj.weight": QType.Q8_0 for name in ("gate", "up")}  # one fused layer
    _write_gguf(path, _state(_hf_model()), qtypes)
    monkeypatch.setattr(quant_ops, "_tried", False)  # as in a fresh process
    monkeypatch.setattr(quant_ops, "_library", None)
    config = EngineConfig(model=str(path), quantization="gguf", device="cpu", dtype="float32", num_kv_blocks=4)
    worker = Worker(config, eos_token_ids=())
    assert quant_ops._tried and quant_ops._library is not None  # no step has run yet
    assert worker.batch.seqs == {}
