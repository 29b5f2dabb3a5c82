"""Every use of torch's private oneDNN ops goes through one probe and falls back to public APIs.

A torch build may lack ``torch.ops.mkldnn._*`` ops or refuse them; the layers,
the dtype check, the benchmark report and the quantized kernel benchmark must
then take their public fallback (``F.linear``, the CPU flags) instead of crashing.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from pagedllm.bench import report
from pagedllm.layers import dispatch, linear
from pagedllm.native import cpu_dtype, quant_ops
from pagedllm.quant import kernel_bench


def _missing_op(name: str):
    raise AttributeError(f"torch.ops.mkldnn has no {name} in this build")


def _refusing_op(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{name}: not supported on this build")

    return refuse


@pytest.fixture(params=["probe-missing", "probe-raises", "namespace-empty"])
def no_private_mkldnn(request, monkeypatch):
    """A torch whose private oneDNN ops are missing, raise, or whose whole namespace is empty."""
    monkeypatch.setattr(dispatch, "_onednn_probe", {})
    cpu_dtype.native_matmul.cache_clear()
    if request.param == "probe-missing":
        monkeypatch.setattr(dispatch, "private_mkldnn_op", _missing_op)
    elif request.param == "probe-raises":
        monkeypatch.setattr(dispatch, "private_mkldnn_op", _refusing_op)
    else:
        monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())
    yield request.param
    cpu_dtype.native_matmul.cache_clear()


def test_dense_linear_falls_back_to_f_linear(no_private_mkldnn):
    assert not dispatch.onednn_linear_available(torch.float32)
    gen = torch.Generator().manual_seed(1)
    weight, x, bias = torch.randn(24, 32, generator=gen), torch.randn(5, 32, generator=gen), torch.randn(24)
    matmul = linear.dense_matmul(weight)
    assert isinstance(matmul, linear._TorchMatmul)
    torch.testing.assert_close(matmul(x, weight, bias), F.linear(x, weight, bias), rtol=0, atol=0)


def test_native_dtype_answers_from_the_cpu_flags(no_private_mkldnn):
    for dtype in (torch.bfloat16, torch.float16):
        assert cpu_dtype.native_matmul(dtype) == dispatch.native_dtype_from_cpu_flags(dtype)
    assert cpu_dtype.native_matmul(torch.float32)
    assert report.machine_class()["bf16_matmul_native"] == dispatch.native_dtype_from_cpu_flags(torch.bfloat16)


def test_quant_kernel_bench_times_the_fallback(no_private_mkldnn):
    portable = [("portable", min(quant_ops.runnable_isas()), None)]
    cells = kernel_bench.row(2, 64, 64, portable).strip("| ").split("|")
    assert len(cells) == 2 + 1 + 2 + 2 and all(float(c) > 0 for c in cells[2:])
    assert "dense fp32 (F.linear)" in kernel_bench.header(portable)


def test_fallback_agrees_with_onednn_where_both_answer():
    """On a build with the private query, the flags-based fallback names the same bf16 answer."""
    query = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if query is None or not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN bf16 query to compare with")
    assert dispatch.native_dtype_from_cpu_flags(torch.bfloat16) == bool(query())
    assert dispatch.onednn_native_dtype(torch.bfloat16) == bool(query())
