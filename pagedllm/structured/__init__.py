"""Structured outputs: grammar-constrained decoding (xgrammar) and tool calling.

- ``params``: StructuredOutputsParams (vLLM's names) and the GrammarSpec cache key.
- ``grammar``: GrammarCompiler (LRU cache of compiled grammars), GrammarState (one per sequence).
- ``bitmask``: a step's GrammarMask, filled per row and applied to the logits in one op.
- ``tools``: tool_choice resolution, its grammar, and parsing calls out of the output.

Nothing here imports xgrammar until a constrained request arrives.
"""

from pagedllm.structured.params import GrammarSpec, StructuredOutputsParams

__all__ = ["GrammarSpec", "StructuredOutputsParams"]
