"""Triton kernels for the paged KV cache.

Modules (each imports triton, so import them only from a Triton backend):

- ``write_kv``:      scatter each new token's K/V into its cache slot.
- ``paged_decode``:  one query token per sequence, split-K over the context,
                     then a reduction of the partial softmax states.
- ``paged_prefill``: causal varlen attention for prefill chunks, prefix hits
                     and mixed batches.
- ``common``:        dot operand types and interpreter workarounds.

This package's ``__init__`` imports nothing on purpose: ``import pagedllm``
must keep working on machines without Triton.
"""
