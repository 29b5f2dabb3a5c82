"""Executes a scheduled step: apply block copies and swaps, build inputs, run the model."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.engine.scheduler import MemoryOpKind, SchedulerOutput
from pagedllm.kv.kv_cache import KVCache
from pagedllm.runner.cuda_graphs import DecodeGraphs
from pagedllm.runner.inputs import ModelInputs, build_model_inputs, to_device


class ModelRunner:
    """Owns the model and the KV tensors; does exactly what the scheduler's output says."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.decode_graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture CUDA graphs for decode steps; later decode-only steps replay them."""
        graphs = DecodeGraphs(
            self.model, self.kv_cache.layers, block_size=self.block_size,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, device=self.device,
        )
        graphs.capture_all()
        self.decode_graphs = graphs

    def apply_memory_ops(self, out: SchedulerOutput) -> None:
        # In the order decided: a block freed by one op may be the target of the next.
        apply = {
            MemoryOpKind.SWAP_OUT: self.kv_cache.swap_out,
            MemoryOpKind.SWAP_IN: self.kv_cache.swap_in,
            MemoryOpKind.COPY: self.kv_cache.copy_blocks,
        }
        for op in out.memory_ops:
            apply[op.kind](op.pairs)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, fed_tokens: tuple[list[int], list[int], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ModelInputs]:
        """Run one forward pass; returns logits [num_rows, vocab] float32 and the inputs used.

        ``fed_tokens`` = (input rows, source rows, tokens on the device): input
        token ``rows[i]`` is taken from ``tokens[source[i]]``, the previous
        step's draw that the host has not read yet. No device sync.
        """
        self.apply_memory_ops(out)
        inputs = build_model_inputs(out.chunks, self.block_size, self.device)
        if fed_tokens is not None:
            dst, src, tokens = fed_tokens
            if dst == src and len(dst) == inputs.input_ids.shape[0] == tokens.shape[0]:
                inputs.input_ids.copy_(tokens)  # the usual decode step: same rows, same order
            else:
                rows, source = to_device([np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64)], self.device)
                inputs.input_ids[rows] = tokens[source].to(inputs.input_ids.dtype)
        if self.decode_graphs is not None and self.decode_graphs.can_run(inputs):
            return self.decode_graphs.run(inputs), inputs
        logits = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_cache.layers,
            inputs.metadata,
            inputs.logits_indices,
        )
        return logits, inputs
