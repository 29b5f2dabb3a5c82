"""Benchmarks: offline throughput (against HF transformers and vLLM), single-request
latency, serving load tests against any OpenAI-compatible server, and the KV memory audit.

Run them with ``pagedllm bench throughput | latency | serve | memory``.
"""
