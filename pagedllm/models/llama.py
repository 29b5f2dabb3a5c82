"""The Llama decoder (also serves Mistral, Qwen2 and SmolLM checkpoints).

Tokens of many sequences arrive flattened into one ``[num_tokens]`` batch; the
attention backend uses ``AttentionMetadata`` to keep sequences apart. Q/K/V are
one fused projection and gate/up another, so each layer runs four matmuls.
Under tensor parallelism every rank builds the same modules over its shard
(heads, MLP columns, vocabulary rows; see pagedllm.layers) and the two
row-parallel projections of each layer end in an all-reduce.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.distributed import (
    SINGLE_PROCESS,
    SharedHeadRows,
    TensorParallelGroup,
    attention_weight_count,
    balanced_range,
    head_shard,
    step_head_rows,
)
from pagedllm.errors import ModelLoadError
from pagedllm.kv import kv_format
from pagedllm.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    StepRotary,
    VocabParallelEmbedding,
    rotate,  # noqa: F401  (re-exported: tests and callers import it from here)
)
from pagedllm.layers.linear import _copy_checked
from pagedllm.models import rope_scaling
from pagedllm.models.config import ModelConfig
from pagedllm.quant.formats import QuantizedWeight
from pagedllm.quant.stack import layer_stack

logger = logging.getLogger("pagedllm")


def rope_inverse_frequencies(config: ModelConfig) -> Tensor:
    """``[head_dim / 2]`` float32 angular frequencies, with the config's scaling
    applied, then divided by its per-pair frequency factors (as llama.cpp does)."""
    inv_freq = rope_scaling.inverse_frequencies(
        config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
    )
    if config.rope_frequency_factors is None:
        return inv_freq
    return inv_freq / torch.tensor(config.rope_frequency_factors, dtype=torch.float32)


def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
    """The model's rotary tables: ``head_dim``, the positions the engine may use
    (past the trained length only under a rope scaling), the (scaled) frequencies
    and the scaling's attention factor."""
    return RotaryEmbedding(
        config.head_dim,
        config.max_context_len,
        lambda: rope_inverse_frequencies(config),
        attention_factor=rope_scaling.attention_factor(config.rope_scaling),
    )


class StepHeadRows:
    """The step's :class:`SharedHeadRows` for this rank, computed once per step for every layer
    (None where no KV head straddles two ranks)."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        self.shards = [head_shard(config.num_heads, config.num_kv_heads, tp.size, r) for r in range(tp.size)]
        self.rank, self.group, self.head_dim = tp.rank, config.num_heads // config.num_kv_heads, config.head_dim
        self.active = self.shards[tp.rank].splits_rows
        self._metadata: AttentionMetadata | None = None
        self._rows: SharedHeadRows | None = None

    def for_step(self, metadata: AttentionMetadata) -> SharedHeadRows | None:
        if not self.active:
            return None
        if metadata is not self._metadata:
            self._rows = step_head_rows(self.shards, self.rank, self.group, self.head_dim,
                                        metadata.seq_lens_host, metadata.query_lens_host)
            self._metadata = metadata
        return self._rows


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache (this rank's heads).

    A KV head shared with a neighbouring rank (:func:`head_shard`) is projected and
    written whole on both, and its attention computed for this rank's rows only; the
    o_proj's collective takes each row of it from the rank that computed it."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallelGroup,
        head_rows: StepHeadRows | None = None,
    ) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_heads, config.num_kv_heads, config.attention_bias, tp
        )
        self.head_rows = head_rows or StepHeadRows(config, tp)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_q, heads.num_kv, d
        self.q_size, self.kv_size = heads.num_q * d, heads.num_kv * d
        self.o_proj = RowParallelLinear(
            config.num_heads * d, config.hidden_size, config.o_proj_bias, tp,
            input_range=(heads.q_start * d, (heads.q_start + heads.num_q) * d),
        )
        self.scale = d**-0.5
        self.backend = backend

    def forward(
        self,
        x: Tensor,  # [T, hidden]
        rotary: StepRotary,
        kv_cache: tuple[Tensor, ...],  # (k, v) each [num_blocks, block_size, KH, D], + (k_scale, v_scale) if 8-bit
        metadata: AttentionMetadata,
    ) -> Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        shared = self.head_rows.for_step(metadata)
        head_rows = None if shared is None else shared.head_rows
        qkv = self.qkv_proj.forward_rows(x, head_rows)  # [T, (H + 2 KH) * D]
        # q and k sit side by side: rotate both heads' sets with one set of ops
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = rotary(qk)  # [T, H + KH, D]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if len(kv_cache) == 2:
            k_cache, v_cache = kv_cache
            self.backend.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
            out = self.backend.forward(q, k_cache, v_cache, metadata, self.scale, head_rows=head_rows)  # [T, H, D]
        else:  # 8-bit codes with their scales [num_blocks, block_size, KH] float16
            k_cache, v_cache, k_scale, v_scale = kv_cache
            scale, dtype = self.scale, q.dtype
            rotated = kv_format.stores_rotated(k_cache.dtype, self.head_dim)
            if rotated:  # int8 holds H k and H v (kv_format): rotate q to match, and the output back
                # (in float32; the query then takes the model's dtype again, as over any other cache)
                q, k, v = kv_format.rotate(q).to(dtype), kv_format.rotate(k), kv_format.rotate(v)
                scale = kv_format.rotated_attention_scale(scale, self.head_dim)
            self.backend.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale=k_scale, v_scale=v_scale)
            out = self.backend.forward(
                q, k_cache, v_cache, metadata, scale, k_scale=k_scale, v_scale=v_scale, head_rows=head_rows
            )  # [T, H, D]
            if rotated:  # per (row, head) vector: another rank's rows stay apart
                out = kv_format.rotate(out, 1.0 / self.head_dim).to(dtype)
        out = out.reshape(num_tokens, self.q_size)
        if shared is None:
            return self.o_proj(out)
        return self.o_proj(shared.zero_unowned(out), shared_rows=shared)


# The attention kernel, rotary and KV writes of one query head cost about as much as this many
# times its q projection's weights (hidden x head_dim): measured on SmolLM2 under W64 (contexts of
# 32-640 tokens) on 2 ranks, from the ranks' forward CPU time (docs/benchmarks.md,
# "Tensor parallelism on the CPU"); longer contexts weigh more.
ATTENTION_WORK_PER_QUERY_HEAD = 4.5


def mlp_shard(config: ModelConfig, tp: TensorParallelGroup) -> tuple[int, int]:
    """This rank's ``[start, end)`` of the MLP's intermediate features.

    When the heads do not split evenly (SmolLM2's 3 KV groups over 2 ranks:
    3 and 6 query heads), the rank with less attention gets more of the MLP,
    so that every rank does as much work per token (weights, plus the attention
    kernel's share per query head) and none waits for the other at each all-reduce.
    """
    shards = [head_shard(config.num_heads, config.num_kv_heads, tp.size, r) for r in range(tp.size)]
    group = config.num_heads // config.num_kv_heads
    attention = [
        attention_weight_count(h, config.hidden_size, config.head_dim)
        + ATTENTION_WORK_PER_QUERY_HEAD * h.query_head_work(group) * config.hidden_size * config.head_dim
        for h in shards
    ]
    # gate, up and down: three weights per intermediate feature and hidden unit
    return balanced_range(config.intermediate_size, 3 * config.hidden_size, attention, tp.rank)


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused (rows ``[gate | up]``)."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        start, end = mlp_shard(config, tp)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [(start, end - start), (start, end - start)], False, tp, glu=True
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, False, tp, input_range=(start, end))

    def forward(self, x: Tensor) -> Tensor:  # x: [T, hidden]
        return self.down_proj(self.act.after(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallelGroup,
        head_rows: StepHeadRows | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend, tp, head_rows)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

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
    ``gate_up_proj``); :meth:`load_weights` accepts HF checkpoint names and
    keeps this rank's shard of each. Kernels are chosen per layer by
    :meth:`bind_kernels`, after loading and after any move or cast.
    """

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, tp: TensorParallelGroup = SINGLE_PROCESS
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary = rotary_embedding(config)
        head_rows = StepHeadRows(config, tp)  # one split of the shared heads' rows per step, for every layer
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend, tp, head_rows) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, tied=tied)
        self._bound = False
        self.layer_stack = None  # set by bind_kernels()

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds (its KV cache's head count)."""
        return self.layers[0].self_attn.num_kv_heads

    def bind_kernels(self) -> None:
        """Choose every layer's kernels for the device and dtype the weights are on now."""
        weight = self.embed_tokens.weight
        for module in self.modules():
            if module is not self and hasattr(module, "bind"):
                module.bind(weight.device, weight.dtype)
        self.layer_stack = layer_stack(self)  # every layer in one native call, where all its kernels are native
        self._bound = True

    def reserve_activations(self, rows: int) -> None:
        """Make the native layer stack's activations for a ``rows``-row step resident now (where
        the stack runs; see :meth:`LayerStack.reserve`)."""
        if not self._bound:
            self.bind_kernels()
        if self.layer_stack is not None:
            self.layer_stack.reserve(rows)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / to_empty(): the packed weights and kernel choices are stale
        self._bound = False
        return super()._apply(fn, recurse)

    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        kv_caches: list[tuple[Tensor, ...]],  # KVCache.layers
        attn_metadata: AttentionMetadata,
        logits_indices: Tensor | None = None,  # [num_samples]
    ) -> Tensor | None:  # [num_samples, vocab] float32
        """Logits of the rows in ``logits_indices`` (all rows when None), as float32; under tensor
        parallelism on the first rank only (None on the others, see :class:`ParallelLMHead`)."""
        if not self._bound:
            self.bind_kernels()
        residual = self.embed_tokens(input_ids)  # [T, hidden], a fresh tensor the layers update in place
        delta = None
        if self.layer_stack is not None:
            delta = self.layer_stack.run(residual, positions, kv_caches, attn_metadata)
        if delta is None:
            rotary = self.rotary.for_step(positions, residual)  # shared by every layer
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                delta = layer(residual, delta, rotary, kv_cache, attn_metadata)
        if logits_indices is not None:
            residual = residual.index_select(0, logits_indices)  # [num_samples, hidden]
            delta = None if delta is None else delta.index_select(0, logits_indices)
        hidden = self.norm(residual) if delta is None else self.norm(delta, residual)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors in (this rank's shard), splicing q/k/v and gate/up into the fused matrices.

        Raises ModelLoadError on a shape mismatch or when any parameter is left
        unset; names this model has no use for (rotary buffers, a tied lm_head)
        are skipped with a debug log. Packed tensors (:class:`QuantizedWeight`)
        replace their layer's dense weight (see :func:`pagedllm.quant.layers.install_quantized`).
        """
        params = dict(self.named_parameters())
        expected = set(self._expected_pieces())
        loaded: set[str] = set()
        quantized: dict[str, dict[int, QuantizedWeight]] = {}  # parameter -> fused part -> packed rows
        for hf_name, tensor in weights:
            target = self._map_hf_name(hf_name)
            if target is None:
                logger.debug("ignoring checkpoint tensor %s", hf_name)
                continue
            name, part = target
            if name not in params:
                logger.debug("ignoring checkpoint tensor %s (no parameter %s)", hf_name, name)
                continue
            module_name, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(tensor, QuantizedWeight):  # a GGUF tensor kept packed (quantization="gguf")
                quantized.setdefault(name, {})[part] = tensor
            elif hasattr(module, "load_weight"):
                module.load_weight(leaf, tensor, part, hf_name)
            else:
                _copy_checked(params[name].data, tensor, hf_name)
            loaded.add(f"{name}@{part}")
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:5]}"
            )
        if quantized:
            from pagedllm.quant.layers import install_quantized, local_shard

            packed = {name: local_shard(self.get_submodule(name.removesuffix(".weight")),
                                        [parts[p] for p in sorted(parts)])
                      for name, parts in quantized.items()}
            install_quantized(self, packed)
        self.bind_kernels()

    def _map_hf_name(self, hf_name: str) -> tuple[str, int] | None:
        """HF tensor name -> (own parameter name, which fused part it fills), or None to skip."""
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if "rotary_emb" in name:
            return None
        fused = {
            "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
            "self_attn.k_proj.": ("self_attn.qkv_proj.", 1),
            "self_attn.v_proj.": ("self_attn.qkv_proj.", 2),
            "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
            "mlp.up_proj.": ("mlp.gate_up_proj.", 1),
        }
        for hf_part, (own_part, part) in fused.items():
            if hf_part in name:
                return name.replace(hf_part, own_part), part
        return name, 0

    def _expected_pieces(self) -> list[str]:
        """Every (parameter, fused part) a complete checkpoint fills."""
        pieces = []
        for name, _ in self.named_parameters():
            module_name = name.rpartition(".")[0]
            num_parts = getattr(self.get_submodule(module_name), "num_parts", 1)
            pieces += [f"{name}@{part}" for part in range(num_parts)]
        return pieces
