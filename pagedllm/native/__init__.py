"""Native CPU kernels, compiled on first use (see :mod:`pagedllm.native.cpu_ops`)."""
