"""``pagedllm bench``: dispatch to throughput | latency | serve | structured | memory | sessions | beam.

Each benchmark module has ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their benchmark runs (the heavy imports, torch
and the engine, happen inside them).
"""

from __future__ import annotations

import argparse
import importlib

from pagedllm.bench import stopping

BENCHMARKS = {
    "throughput": ("pagedllm.bench.throughput", "Offline throughput on a workload, optionally beside HF / vLLM"),
    "latency": ("pagedllm.bench.latency", "One request at a time: TTFT, TPOT, decode tok/s"),
    "serve": (
        "pagedllm.bench.serve",
        "Load-test an OpenAI-compatible server with streaming requests, or start pagedllm's and vLLM's in turn (--compare)",
    ),
    "structured": ("pagedllm.bench.structured", "JSON-schema-constrained decoding vs unconstrained: tok/s, mask time, compile time"),
    "memory": ("pagedllm.bench.memory", "KV memory audit: waste per allocation policy, savings from sharing"),
    "sessions": (
        "pagedllm.bench.sessions",
        "Many multi-turn chat sessions against a real server in a fixed KV budget, with disconnects",
    ),
    "beam": ("pagedllm.bench.beam", "Beam search of width W over one long prompt: time and peak KV blocks"),
}


def add_arguments(parser: argparse.ArgumentParser, name: str = "bench") -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")
    for bench_name, (module_name, help_text) in BENCHMARKS.items():
        bench_parser = sub.add_parser(bench_name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_arguments(bench_parser)
        bench_parser.set_defaults(_bench_module=module_name)


def run(args: argparse.Namespace) -> int:
    # SIGTERM (``kill``, ``timeout``) unwinds the bench like Ctrl-C, stopping the servers it started.
    stopping.install()
    return int(importlib.import_module(args._bench_module).run(args) or 0)
