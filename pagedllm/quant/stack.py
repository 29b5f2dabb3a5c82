"""Every decoder layer of a model in one native call.

With packed weights a batch-1 decode step of the default model spends about a
third of its time in the interpreter between kernels: some 330 module calls
and kernel wrappers per step, each a few microseconds, around matmuls that
stream the weights. Where every kernel of every layer is a native CPU one,
:class:`LayerStack` hands the whole stack to ``quant_run_layers`` in
pagedllm/native/quant_ops.c, which calls the same kernels in the same order
with the same arguments, so its output equals the modules' bit for bit
(tests/test_layer_stack.py). Three kinds of model qualify (one rank, native
norms, rotary, K/V writes and attention):
- float32 activations with packed q/k/v, o, gate/up and down matrices
  (float32 or 8-bit KV caches);
- bfloat16 activations with packed matrices on a CPU without AMX-BF16 (an AVX2
  machine, where a bfloat16 GGUF is served packed): each matmul widens its
  input to float32 and rounds its output to bfloat16, as the modules do;
- bfloat16 activations with dense bfloat16 matrices on the AMX-BF16 tiles
  (:class:`pagedllm.layers.linear.AmxBf16Matmul`; bfloat16 KV caches): on a
  2-core Sapphire Rapids the interpreter's share of a W64 decode step was
  about a fifth, with the second thread idle meanwhile.
The model keeps its modules: they run wherever the stack does not apply
(another attention path this step, tensor parallelism, other weights), and
``PAGEDLLM_LAYER_STACK=0`` turns the stack off for comparison.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import Tensor, nn

from pagedllm.kv import kv_format
from pagedllm.layers.dispatch import KernelPath
from pagedllm.layers.linear import AmxBf16Matmul
from pagedllm.layers.rotary import check_positions
from pagedllm.native import cpu_ops, host_memory, quant_ops
from pagedllm.quant.formats import QuantizedWeight
from pagedllm.quant.layers import QuantizedLinearMethod

ENV = "PAGEDLLM_LAYER_STACK"

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Linear(ctypes.Structure):
    _fields_ = [("q", _p), ("d", _p), ("m", _p), ("dt", _p), ("mt", _p), ("bias", _p), ("N", _i64), ("K", _i64), ("Kp", _i64),
                ("bits", _i64), ("r", _i64), ("zero", _i64), ("tiled_min_rows", _i64), ("levels", _i64),
                ("w16", _p), ("glu", _i64), ("lanes", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("k_cache", _p), ("v_cache", _p), ("k_scale", _p), ("v_scale", _p)]


class _Stack(ctypes.Structure):
    _fields_ = [("rms_norm", _p), ("rotary", _p), ("write_kv", _p), ("attention", _p), ("silu_mul", _p),
                ("isa", _i64), ("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64),
                ("num_kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64), ("block_size", _i64),
                ("kv8", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layers", _p),
                ("hadamard", _p), ("rotate", _i64), ("elem", _i64), ("hadamard16", _p), ("kv_layout", _i64),
                ("silu_mul_serial", _p)]


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _packed(layer: nn.Module) -> QuantizedWeight | None:
    method = getattr(layer, "method", None)
    return method.weight if isinstance(method, QuantizedLinearMethod) else None


def _linear(layer: nn.Module, weight: QuantizedWeight, isa: int) -> _Linear:
    bias = layer.bias
    tables = weight.row_tables() if isa == quant_ops.isa() else None  # made for the CPU's own path
    lanes = weight.native_codes() if isa == quant_ops.isa() else weight.lanes  # and qweight in that layout
    dt, mt = (None, None) if tables is None else (t if t is None else t.data_ptr() for t in tables)
    return _Linear(
        weight.qweight.data_ptr(), weight.scales.data_ptr(), None if weight.mins is None else weight.mins.data_ptr(),
        dt, mt, None if bias is None else bias.data_ptr(), weight.out_features, weight.in_features, weight.padded_in,
        weight.bits, weight.group_size // 32, weight.zero,
        quant_ops.tiled_min_rows(weight.bits, isa, weight.activation_levels) or 2**62, weight.activation_levels,
        None, 0, int(lanes),
    )


def _dense_bf16(layer: nn.Module) -> AmxBf16Matmul | None:
    matmul = getattr(layer, "matmul", None)
    return matmul if isinstance(matmul, AmxBf16Matmul) else None


def _dense_linear(layer: nn.Module, matmul: AmxBf16Matmul) -> _Linear:
    bias = layer.bias
    return _Linear(None, None, None, None, None, None if bias is None else bias.data_ptr(), matmul.out_features,
                   matmul.in_features, matmul.packed.shape[1] * quant_ops.DENSE_BF16_BLOCK, 0, 0, 0, 0, 0,
                   matmul.packed.data_ptr(), int(matmul.glu), 0)


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _holders(dtype: torch.dtype) -> tuple:
    """The kinds of matrix the stack runs under ``dtype`` activations. Packed matrices under
    bfloat16 only where the CPU has no AMX-BF16: there the modules take another kernel from 64
    rows on (:func:`pagedllm.quant.formats.QuantizedWeight.matmul`), which the stack does not."""
    if dtype == torch.float32:
        return (_packed,)
    return (_dense_bf16,) if quant_ops.amx_bf16_available() else (_dense_bf16, _packed)


def layer_stack(model: nn.Module) -> LayerStack | None:
    """The stack of ``model`` (a bound LlamaForCausalLM), or None where its layers cannot all run natively."""
    if os.environ.get(ENV, "1") == "0" or model.tp.size != 1 or not model.layers:
        return None
    weight = model.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    # float32 activations with packed matrices, or bfloat16 with dense matrices on the AMX-BF16
    # tiles (checked first: a model of the other kind never loads the quantized kernels here), or
    # bfloat16 with packed matrices (where the modules widen to float32 for the integer kernels)
    if not any(all(held(m) is not None for layer in model.layers for m in _linears(layer))
               for held in _holders(weight.dtype)):
        return None
    if not (cpu_ops.available() and quant_ops.available()) or model.rotary.path is not KernelPath.NATIVE_CPU:
        return None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if any(n.path is not KernelPath.NATIVE_CPU for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return None
        if mlp.act.path is not KernelPath.NATIVE_CPU or not hasattr(attn.backend, "native_work"):
            return None
        if attn.backend is not model.layers[0].self_attn.backend:
            return None
        if any(n.eps != model.layers[0].input_layernorm.eps for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return None  # the native description holds one epsilon
    return LayerStack(model)


class LayerStack:
    """The native description of a model's layers; :meth:`run` runs them all, or declines a step."""

    def __init__(self, model: nn.Module) -> None:
        first = model.layers[0]
        attn = first.self_attn
        self.backend = attn.backend
        self.rotary = model.rotary
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.isa = quant_ops.isa()
        self._library = cpu_ops._library
        self.dtype = model.embed_tokens.weight.dtype  # of the activations and the KV cache
        self._suffix = "f32" if self.dtype == torch.float32 else "bf16"
        self._query_like = torch.empty((0, self.num_heads, self.head_dim), dtype=self.dtype)
        self._keep: list[Tensor] = []  # every tensor whose address the native description holds
        layers = []
        for layer in model.layers:
            modules = _linears(layer)
            if all(_packed(x) is not None for x in modules):  # float32, or bfloat16 without AMX-BF16
                weights = [_packed(x) for x in modules]
                linears = [_linear(x, w, self.isa) for x, w in zip(modules, weights)]  # codes reordered first
                for w in weights:
                    self._keep += [t for t in (w.qweight, w.scales, w.mins, *(w.row_tables() or ())) if t is not None]
            else:
                matmuls = [_dense_bf16(x) for x in modules]
                self._keep += [mm.packed for mm in matmuls]
                linears = [_dense_linear(x, mm) for x, mm in zip(modules, matmuls)]
            self._keep += [t for t in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                       *(x.bias for x in modules)) if t is not None]
            layers.append(_Layer(layer.input_layernorm.weight.data_ptr(),
                                 layer.post_attention_layernorm.weight.data_ptr(), *linears))
        self._layers = (_Layer * len(layers))(*layers)
        self.eps = first.input_layernorm.eps
        library, suffix = self._library, self._suffix
        self._stack = _Stack(
            _address(getattr(library, f"rms_norm_{suffix}")), _address(getattr(library, f"rotary_{suffix}")), None,
            None, _address(getattr(library, f"silu_mul_{suffix}")), self.isa, len(layers), attn.o_proj.output_size,
            self.num_heads, self.num_kv_heads, self.head_dim, first.mlp.down_proj.input_size, 0, 0, self.eps,
            attn.scale, ctypes.addressof(self._layers), _address(library.hadamard_f32), 0,
            torch.empty((), dtype=self.dtype).element_size(), _address(library.hadamard_bf16), 0,
            _address(getattr(library, f"silu_mul_{suffix}_serial")),
        )
        self._cache_tensors: list[tuple[Tensor, ...]] | None = None  # the caches the layers point at now
        self._run = quant_ops._library.quant_run_layers
        self._run.restype = ctypes.c_int
        self._run.argtypes = [_p, _i64, _p, _p, _p, _p, _p, _p, _p, _i64, _p, _i64, ctypes.c_int32, _i64, _p]
        self._scratch_floats = quant_ops._library.quant_stack_scratch_floats
        self._scratch_floats.restype = _i64
        self._scratch_floats.argtypes = [_p, _i64]
        # The layers' activations, kept from step to step and grown to the largest step seen
        # (the prefill chunks: about 29 KB per row for the default model). Allocated per
        # step instead, a prefill chunk's tens of megabytes were fresh pages the OS zeroed
        # and mapped on every step.
        self._scratch = torch.empty(0, dtype=torch.float32)

    def reserve(self, rows: int) -> None:
        """Hold the activations of a ``rows``-row step now, every page resident (zero-filled), so
        the first large step does not pay for mapping tens of megabytes page by page."""
        self._grow_scratch(rows, zero=True)

    def _grow_scratch(self, rows: int, zero: bool) -> None:
        """At least a ``rows``-row step's activations in ``_scratch`` (the old buffer freed first)."""
        needed = self._scratch_floats(ctypes.addressof(self._stack), rows)
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(0, dtype=torch.float32)
            (self._scratch,) = host_memory.host_tensors([((needed,), torch.float32)], zero=zero)

    def _bind_caches(self, kv_caches: list[tuple[Tensor, ...]]) -> bool:
        """Point the layers at this KV cache (8-bit, or of the activations' dtype); False where the
        modules' path must run."""
        first = kv_caches[0]
        kv8 = len(first) == 4
        if kv8 and first[0].dtype not in cpu_ops._CODE_SUFFIX:
            return False
        if not kv8 and first[0].dtype != self.dtype:
            return False
        if self._cache_tensors is not None and len(kv_caches) == len(self._cache_tensors) and all(
            a is b for a, b in zip(kv_caches, self._cache_tensors)
        ):
            return True  # the same (immutable) per-layer tuples as last time
        layouts = {cpu_ops.kv_layout(layer[0], layer[1]) for layer in kv_caches}
        if len(kv_caches) != len(self._layers) or len(layouts) != 1 or None in layouts or not all(
            s.is_contiguous() for layer in kv_caches for s in layer[2:]
        ) or (kv8 and not all(s.dtype == torch.float16 for layer in kv_caches for s in layer[2:])):
            return False
        library = self._library
        # int8 caches hold Hadamard-rotated vectors (kv_format), as the modules write them: rotated
        # in float32, K and V are quantized from float32 whatever the activations' dtype
        rotate = kv8 and kv_format.stores_rotated(first[0].dtype, self.head_dim)
        if kv8:
            suffix = cpu_ops._CODE_SUFFIX[first[0].dtype]
            writer = "f32" if rotate else self._suffix
            self._stack.write_kv = _address(getattr(library, f"write_kv_{writer}_{suffix}"))
            self._stack.attention = _address(getattr(library, f"paged_attention_{self._suffix}_{suffix}"))
        else:
            self._stack.write_kv = _address(getattr(library, f"write_kv_{self._suffix}"))
            self._stack.attention = _address(getattr(library, f"paged_attention_{self._suffix}"))
        self._stack.kv8 = int(kv8)
        self._stack.rotate = int(rotate)
        self._stack.block_size = first[0].shape[1]
        self._stack.kv_layout = layouts.pop()
        for layer, tensors in zip(self._layers, kv_caches):
            layer.k_cache, layer.v_cache = tensors[0].data_ptr(), tensors[1].data_ptr()
            layer.k_scale, layer.v_scale = (tensors[2].data_ptr(), tensors[3].data_ptr()) if kv8 else (None, None)
        self._cache_tensors = list(kv_caches)  # kept alive while the layers point at them
        return True

    def run(self, residual: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]], metadata) -> Tensor | None:
        """Every layer on ``residual`` [T, hidden] (updated in place, as the modules do); returns the
        last layer's MLP output, or None (nothing touched) where this step needs the modules."""
        rows = residual.shape[0]
        if rows == 0 or not residual.is_contiguous() or residual.dtype != self.dtype or positions.dtype != torch.int64 or metadata.slot_mapping.dtype != torch.int64:
            return None
        if not self._bind_caches(kv_caches):
            return None
        work = self.backend.native_work(self._query_like, kv_caches[0][0], metadata)
        if work is None:
            return None
        tiles, num_rows = work
        cos_table, sin_table = self.rotary.tables(positions.device)
        check_positions(positions, cos_table)
        positions = positions.contiguous()
        tables = metadata.block_tables
        tables = (tables if tables.dtype == torch.int32 else tables.to(torch.int32)).contiguous()
        slots = metadata.slot_mapping.contiguous()
        delta = torch.empty_like(residual)
        split_heads = tiles.shape[0] < 4 * torch.get_num_threads()
        self._grow_scratch(rows, zero=False)
        done = self._run(
            ctypes.addressof(self._stack), rows, residual.data_ptr(), delta.data_ptr(), positions.data_ptr(),
            cos_table.data_ptr(), sin_table.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.stride(0),
            tiles.data_ptr(), tiles.shape[0], int(split_heads), num_rows, self._scratch.data_ptr(),
        )
        if not done:
            raise MemoryError(f"layer stack scratch for {rows} rows")
        return delta
