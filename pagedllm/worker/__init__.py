"""The worker side of a step: model, KV tensors, attention backend, CUDA graphs, sampler."""
