"""Write a variant of cpu_ops.c whose float tile kernels read a head-major block layout.

    python benchmarks/attention_head_major_variant.py OUT.c

The engine's K/V blocks are [block_size, num_kv_heads, head_dim] (a token's heads side by
side); the variant reads [num_kv_heads, block_size, head_dim] (each head's tokens of a block
contiguous), changing only where a chunk's rows start, the stride between them and the
prefetch addresses. It is an experiment for benchmarks/attention_decode_bench.c (whose
caches hold random values, so the layout does not change what is timed, only the order the
bytes are read in), not a kernel the engine can call: its writes and every other reader keep
the engine's layout. docs/profile.md, "Eleventh round", has what it measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "pagedllm" / "native" / "cpu_ops.c"

# (engine layout, head-major layout) pairs, each once in the DEFINE_TILE macro
EDITS = [
    ("const int64_t tok_stride = num_kv_heads * D, max_len = tile.len0 + tile.rows - 1;",
     "const int64_t tok_stride = D, max_len = tile.len0 + tile.rows - 1;"),
    ("kbs[sub] = k_cache + (slots[sub] * num_kv_heads + h) * D;",
     "kbs[sub] = k_cache + (((slots[sub] / block_size) * num_kv_heads + h) * block_size + slots[sub] % block_size) * D;"),
    ("vbs[sub] = v_cache + (slots[sub] * num_kv_heads + h) * D;",
     "vbs[sub] = v_cache + (((slots[sub] / block_size) * num_kv_heads + h) * block_size + slots[sub] % block_size) * D;"),
    ("const int64_t at = (next_slots[sub] * num_kv_heads + (next_h >= 0 ? next_h : h)) * D; \\",
     "const int64_t at = (((next_slots[sub] / block_size) * num_kv_heads + (next_h >= 0 ? next_h : h)) * block_size"
     " + next_slots[sub] % block_size) * D; \\"),
]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    text = SOURCE.read_text()
    start = text.index("#define DEFINE_TILE(")
    end = text.index("DEFINE_TILE(tile_f32,", start)
    macro = text[start:end]
    for old, new in EDITS:
        if macro.count(old) != 1:
            raise SystemExit(f"cpu_ops.c has changed: {old!r} occurs {macro.count(old)} times in DEFINE_TILE")
        macro = macro.replace(old, new)
    Path(sys.argv[1]).write_text(text[:start] + macro + text[end:])


if __name__ == "__main__":
    main()
