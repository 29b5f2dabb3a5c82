"""Weight-only quantized matrices (GGUF Q4_0 / Q4_1 / Q8_0 blocks, RTN int4 / int8)."""

from pagedllm.quant.formats import GGUF_BLOCK_BYTES, QuantizedWeight, from_gguf_blocks, quantize_rtn

__all__ = ["GGUF_BLOCK_BYTES", "QuantizedWeight", "from_gguf_blocks", "quantize_rtn"]
