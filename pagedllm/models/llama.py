"""The Llama decoder (also serves Mistral, Qwen2 and SmolLM checkpoints).

Tokens of many sequences arrive flattened into one ``[num_tokens]`` batch; the
attention backend uses ``AttentionMetadata`` to keep sequences apart. Q/K/V are
one fused projection and gate/up another, so each layer runs four matmuls.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.errors import ModelLoadError
from pagedllm.models import rope_scaling
from pagedllm.models.config import ModelConfig
from pagedllm.native import cpu_ops
from pagedllm.quant.formats import QuantizedWeight

logger = logging.getLogger("pagedllm")


class PackedWeight:
    """A weight matrix reordered once into oneDNN's blocked layout for CPU matmuls.

    On this class of CPU, oneDNN on a pre-reordered weight runs float32
    matmuls 2-3x faster than ``F.linear`` (MKL) at every batch size above a
    few rows, and bfloat16 ones a little faster. The packed copy is rebuilt
    whenever the weight's storage, dtype or shape changes, and dropped by
    :meth:`invalidate` after its contents are overwritten in place.
    """

    __slots__ = ("key", "packed")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.packed: Tensor | None = None

    def invalidate(self) -> None:
        self.key, self.packed = None, None

    def get(self, weight: Tensor) -> Tensor:
        key = (weight.data_ptr(), weight.dtype, tuple(weight.shape))
        if key != self.key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self.key = key
        return self.packed


def _onednn_usable(x: Tensor, weight: Tensor) -> bool:
    if x.device.type != "cpu" or torch.is_grad_enabled() or x.dtype != weight.dtype or not _ONEDNN:
        return False
    if x.dtype == torch.float32:
        return True
    return x.dtype == torch.bfloat16 and _ONEDNN_BF16


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_ONEDNN_BF16 = _ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: PackedWeight) -> Tensor:
    """``F.linear`` (x [T, in] -> [T, out]), through the packed oneDNN weight where it applies."""
    if not _onednn_usable(x, weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.get(weight), bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU inference matmul uses a :class:`PackedWeight`.

    Quantization hook: when ``quantized`` holds a packed matrix
    (:class:`pagedllm.quant.QuantizedWeight`), the matmul runs on it and
    ``weight`` is an empty placeholder.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = PackedWeight()
        self.quantized: QuantizedWeight | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.quantized is not None:
            y = self.quantized.apply(x)
            return y if self.bias is None else y + self.bias
        return linear(x, self.weight, self.bias, self.packed)


def _native(*tensors: Tensor) -> bool:
    """Whether the native CPU kernels take this step (inference only: they have no autograd)."""
    return not torch.is_grad_enabled() and cpu_ops.usable_for(*tensors)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistic computed in float32 whatever the input dtype.

    Called with a ``residual``, it first adds ``x`` into ``residual`` in place
    and normalises the sum: the residual add of the sublayer before, fused.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:  # x: [T, hidden]
        if residual is None:
            if _native(x, self.weight):
                return cpu_ops.rms_norm(x.contiguous(), None, self.weight, self.eps)
            return self._norm(x)
        if _native(x, residual, self.weight) and residual.is_contiguous():
            return cpu_ops.rms_norm(residual, x, self.weight, self.eps)
        residual += x
        return self._norm(residual)

    def _norm(self, x: Tensor) -> Tensor:
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))  # [T, 1]
        if x.dtype == torch.float32:
            return self.weight * (x32 * inv_rms)
        return self.weight * (x32 * inv_rms).to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> Tensor:
    """``[head_dim / 2]`` float32 angular frequencies, with the config's scaling
    applied, then divided by its per-pair frequency factors (as llama.cpp does)."""
    inv_freq = rope_scaling.inverse_frequencies(
        config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
    )
    if config.rope_frequency_factors is None:
        return inv_freq
    return inv_freq / torch.tensor(config.rope_frequency_factors, dtype=torch.float32)


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (the HF "rotate_half" convention).

    The cos/sin tables cover positions ``0 .. max_context_len - 1`` (scaled by
    the rope scaling's attention factor) and
    are built once per device on first use (not registered as buffers, so a
    model built on the meta device and materialised later still gets them, and
    casting the model to bfloat16 keeps them float32).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._tables:
            self._tables[device] = self._build_tables(device)
        return self._tables[device]

    @torch.inference_mode(False)
    def _build_tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin, each [max_positions, head_dim / 2] float32; built as normal
        tensors even under inference mode so later autograd use is not refused."""
        with torch.no_grad():
            inv_freq = rope_inverse_frequencies(self.config).to(device)
            positions = torch.arange(self.config.max_context_len, device=device, dtype=torch.float32)
            angles = positions[:, None] * inv_freq[None, :]  # [max_pos, D/2]
            magnitude = rope_scaling.attention_factor(self.config.rope_scaling)
            if magnitude == 1.0:
                return angles.cos(), angles.sin()
            return angles.cos() * magnitude, angles.sin() * magnitude

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin at ``positions`` [T], each [T, 1, D/2] in ``dtype``; once per forward pass."""
        cos_table, sin_table = self.tables(positions.device)
        cos = cos_table.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = sin_table.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin

    def for_step(self, positions: Tensor, like: Tensor) -> StepRotary:
        """The angles of one forward pass at ``positions`` [T], for tensors like ``like``."""
        return StepRotary(self, positions, like)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q: [T, H, D], k: [T, KH, D], positions: [T] -> rotated (q, k)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin)


class StepRotary:
    """The rotary angles of one forward pass, shared by every layer.

    On the CPU with the native kernels, heads are rotated in place reading the
    float32 tables at each position; otherwise cos/sin are gathered once here
    and :func:`rotate` builds a new tensor per layer.
    """

    def __init__(self, rotary: RotaryEmbedding, positions: Tensor, like: Tensor) -> None:
        self.native = _native(like) and positions.dtype == torch.int64
        if self.native:
            self.cos_table, self.sin_table = rotary.tables(positions.device)
            if positions.numel() and int(positions.max()) >= self.cos_table.shape[0]:
                raise ValueError(
                    f"position {int(positions.max())} is past the model's "
                    f"{self.cos_table.shape[0]} rotary positions"
                )
            self.positions = positions.contiguous()
        else:
            self.cos, self.sin = rotary.cos_sin(positions, like.dtype)

    def __call__(self, x: Tensor) -> Tensor:
        """x [T, N, D] (rows may be strided) rotated; in place on the native path."""
        if self.native:
            cpu_ops.rotary_(x, self.positions, self.cos_table, self.sin_table)
            return x
        return rotate(x, self.cos, self.sin)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, N, D] rotated by angle pairs (cos, sin [T, 1, D/2]) into a new contiguous tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin)  # x2 cos + x1 sin
    return out


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # rows: [q (H*D) | k (KH*D) | v (KH*D)]
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.scale = config.head_dim**-0.5
        self.backend = backend

    def forward(
        self,
        x: Tensor,  # [T, hidden]
        rotary: StepRotary,
        kv_cache: tuple[Tensor, Tensor],
        metadata: AttentionMetadata,
    ) -> Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KH) * D]
        # q and k sit side by side: rotate both heads' sets with one set of ops
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = rotary(qk)  # [T, H + KH, D]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = self.backend.forward(q, k_cache, v_cache, metadata, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused (rows ``[gate | up]``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, hidden]
        gate_up = self.gate_up_proj(x)
        if _native(gate_up):
            return self.down_proj(cpu_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, residual: Tensor, delta: Tensor | None, rotary, kv_cache, metadata) -> Tensor:
        """One layer on the residual stream ``residual`` [T, hidden], updated in place.

        ``delta`` is the previous layer's MLP output, not yet added (None for the
        first layer): each residual add is fused into the norm that follows it.
        Returns this layer's MLP output, for the next norm to add.
        """
        x = self.input_layernorm(residual) if delta is None else self.input_layernorm(delta, residual)
        attn = self.self_attn(x, rotary, kv_cache, metadata)
        return self.mlp(self.post_attention_layernorm(attn, residual))


class LlamaForCausalLM(nn.Module):
    """Embedding -> N decoder layers -> final norm -> LM head (tied or not).

    Parameters live under the names this module defines (fused ``qkv_proj`` and
    ``gate_up_proj``); :meth:`load_weights` accepts HF checkpoint names.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.head_packed = PackedWeight()  # the LM head matmul (tied: the embedding matrix)
        # Quantization hook: packed embedding / LM head matrices (tied: one matrix for both).
        self.embed_quantized: QuantizedWeight | None = None
        self.head_quantized: QuantizedWeight | None = None

    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        kv_caches: list[tuple[Tensor, Tensor]],
        attn_metadata: AttentionMetadata,
        logits_indices: Tensor | None = None,  # [num_samples]
    ) -> Tensor:  # [num_samples, vocab] float32
        """Logits of the rows in ``logits_indices`` (all rows when None), as float32."""
        residual = self._embed(input_ids)  # [T, hidden], a fresh tensor the layers update in place
        rotary = self.rotary.for_step(positions, residual)  # shared by every layer
        delta = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            delta = layer(residual, delta, rotary, kv_cache, attn_metadata)
        if logits_indices is not None:
            residual = residual.index_select(0, logits_indices)  # [num_samples, hidden]
            delta = None if delta is None else delta.index_select(0, logits_indices)
        hidden = self.norm(residual) if delta is None else self.norm(delta, residual)
        if self.head_quantized is not None:
            return self.head_quantized.apply(hidden).float()
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, head, None, self.head_packed).float()

    def _embed(self, input_ids: Tensor) -> Tensor:
        if self.embed_quantized is None:
            return self.embed_tokens(input_ids)
        return self.embed_quantized.embed(input_ids).to(self.norm.weight.dtype)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors in, splicing q/k/v and gate/up into the fused matrices.

        Raises ModelLoadError on a shape mismatch or when any parameter is left
        unset; names this model has no use for (rotary buffers, a tied lm_head)
        are skipped with a debug log.
        """
        params = dict(self.named_parameters())
        expected = set(self._expected_pieces())
        loaded: set[str] = set()
        quantized: dict[str, list[tuple[int, QuantizedWeight]]] = {}  # parameter -> (first row, piece)
        for hf_name, tensor in weights:
            target = self._map_hf_name(hf_name)
            if target is None:
                logger.debug("ignoring checkpoint tensor %s", hf_name)
                continue
            name, row_start = target
            if name not in params:
                logger.debug("ignoring checkpoint tensor %s (no parameter %s)", hf_name, name)
                continue
            if isinstance(tensor, QuantizedWeight):
                quantized.setdefault(name, []).append((row_start, tensor))
            else:
                _copy_rows(params[name], tensor, row_start, hf_name)
            loaded.add(f"{name}@{row_start}")
        for name, pieces in quantized.items():
            self.set_quantized(name, QuantizedWeight.cat_rows([p for _, p in sorted(pieces, key=lambda x: x[0])]))
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:5]}"
            )
        self.invalidate_packed_weights()

    def set_quantized(self, name: str, weight: QuantizedWeight) -> None:
        """Serve parameter ``name`` (a linear weight, the embedding or the LM head) from ``weight``;
        the dense parameter becomes an empty placeholder. Raises ModelLoadError on a shape mismatch."""
        module_name = name.removesuffix(".weight")
        module = self.get_submodule(module_name)
        if tuple(module.weight.shape) != weight.shape:
            raise ModelLoadError(f"quantized {name} has shape {weight.shape}, expected {tuple(module.weight.shape)}")
        placeholder = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)
        if isinstance(module, Linear):
            module.quantized = weight
        elif module is self.embed_tokens:
            self.embed_quantized = weight
            if self.lm_head is None:
                self.head_quantized = weight
        elif module is self.lm_head:
            self.head_quantized = weight
        else:
            raise ModelLoadError(f"{name} cannot be quantized")
        module.weight = placeholder

    def quantizable_weights(self) -> list[str]:
        """Names of the parameters :meth:`set_quantized` accepts (linear weights, embedding, LM head)."""
        names = [f"{n}.weight" for n, m in self.named_modules() if isinstance(m, Linear)]
        names.append("embed_tokens.weight")
        if self.lm_head is not None:
            names.append("lm_head.weight")
        return names

    def invalidate_packed_weights(self) -> None:
        """Drop every packed matmul weight (call after changing weights in place)."""
        self.head_packed.invalidate()
        for module in self.modules():
            if isinstance(module, Linear):
                module.packed.invalidate()

    def _map_hf_name(self, hf_name: str) -> tuple[str, int] | None:
        """HF tensor name -> (own parameter name, first row it fills), or None to skip."""
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        if "rotary_emb" in name:
            return None
        cfg = self.config
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {
            "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
            "self_attn.k_proj.": ("self_attn.qkv_proj.", q_rows),
            "self_attn.v_proj.": ("self_attn.qkv_proj.", q_rows + kv_rows),
            "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
            "mlp.up_proj.": ("mlp.gate_up_proj.", cfg.intermediate_size),
        }
        for hf_part, (own_part, row_start) in fused.items():
            if hf_part in name:
                return name.replace(hf_part, own_part), row_start
        return name, 0

    def _expected_pieces(self) -> list[str]:
        """Every (parameter, row offset) a complete checkpoint fills."""
        cfg = self.config
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        pieces = []
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                pieces += [f"{name}@0", f"{name}@{q_rows}", f"{name}@{q_rows + kv_rows}"]
            elif ".gate_up_proj." in name:
                pieces += [f"{name}@0", f"{name}@{cfg.intermediate_size}"]
            else:
                pieces.append(f"{name}@0")
        return pieces


def _copy_rows(param: Tensor, tensor: Tensor, row_start: int, hf_name: str) -> None:
    """Copy ``tensor`` into ``param[row_start : row_start + len(tensor)]`` (dtype/device converted)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    target = param.data[row_start : row_start + rows] if param.dim() else param.data
    if target.shape != tensor.shape:
        raise ModelLoadError(
            f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)
