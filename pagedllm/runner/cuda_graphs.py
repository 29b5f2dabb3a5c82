"""CUDA graphs for decode steps: capture once per bucketed batch size, replay with fresh inputs.

A decode step is the same kernels on the same shapes every time, so its CPU
launch overhead can be paid once: each bucket's forward pass is captured into
a graph that reads its inputs from static buffers. A step of ``n`` sequences
copies its inputs into the first ``n`` rows, marks rows ``n..bucket`` as
padding (slot -1, context length 0: nothing is written, the output row is
unused) and replays the smallest bucket that holds it.

Requirements on the attention backend: decode kernels must size their grids
from host ints that do not change between replays (the Triton backend plans
its split-K from ``max_seq_len``, which is captured at ``max_model_len``, and
any split count is correct for any context). Prefill and mixed steps always
run eagerly.

With ``use_graphs=False`` the same static-buffer path runs eagerly; the tests
use it on the CPU to check the staging and padding logic that graphs replay.
"""

from __future__ import annotations

import logging
import math

import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.runner.inputs import ModelInputs

logger = logging.getLogger("pagedllm")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs]
    return buckets + [max_num_seqs]


class DecodeGraphs:
    """Static input buffers plus one captured forward pass per batch-size bucket."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.use_graphs = use_graphs
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)  # [max_bucket]
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(size, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(size, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = None

    # ---- eligibility ------------------------------------------------------

    def can_run(self, inputs: ModelInputs) -> bool:
        md = inputs.metadata
        return (
            md.max_query_len == 1
            and inputs.logits_indices.shape[0] == md.num_seqs
            and md.num_seqs <= self.buckets[-1]
            and md.block_tables.shape[1] <= self.max_blocks
        )

    @property
    def captured_sizes(self) -> list[int]:
        """Batch sizes with a captured graph (none when graphs are off)."""
        return sorted(self._graphs)

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    # ---- capture ----------------------------------------------------------

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            seq_lens_host=[self.max_model_len] * size,
            query_lens_host=[1] * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:size], self.positions[:size], self.kv_layers,
            self._metadata(size), self.logits_indices[:size],
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        if not self.use_graphs:
            return
        for size in reversed(self.buckets):
            self._capture(size)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _capture(self, size: int) -> None:
        # Warm up on a side stream first: kernels compile and allocators settle
        # outside the capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._forward(size)
        self._pool = graph.pool()
        self._graphs[size] = (graph, output)

    # ---- replay -----------------------------------------------------------

    def _stage(self, inputs: ModelInputs, size: int) -> None:
        """Copy the step's inputs into the static buffers; rows n..size become padding."""
        md, n = inputs.metadata, inputs.metadata.num_seqs
        width = md.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.block_tables[:n, :width].copy_(md.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self.seq_lens[n:size].fill_(0)

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits [num_seqs, vocab] for a decode-only step."""
        n = inputs.metadata.num_seqs
        size = self.bucket_for(n)
        self._stage(inputs, size)
        graph, output = self._graphs.get(size, (None, None))
        if graph is None:
            output = self._forward(size)
        else:
            graph.replay()
        return output[:n]
