"""Content hashing for the prefix cache.

A full block's KV depends on every token before it, so a block is keyed by a
*chained* hash: ``hash(parent_hash, its block_size token ids, extra keys)``,
where ``parent_hash`` is the previous block's hash (``None`` for the first
block) and the extra keys carry anything else the KV depends on (the request's
``cache_salt``). Two prompts share block ``i`` only if they agree on all tokens
of blocks ``0..i`` and on the extra keys.

The digest is SHA-256 over an explicit, platform-independent encoding, so a
collision between different contents is not a practical concern. The pool
still stores each cached block's :class:`BlockContent` and compares it on
lookup, so even a deliberately weak hash (tests swap one in) can only cost a
cache miss, never hand one prompt another prompt's KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes
"""A 32-byte SHA-256 digest identifying a block's content and its whole prefix."""


@dataclass(frozen=True)
class BlockContent:
    """Everything a full block's KV depends on, besides the model.

    ``parent_hash`` stands for the tokens of all earlier blocks; ``token_ids``
    has exactly ``block_size`` entries.
    """

    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple


def extra_keys_for(cache_salt: str | None) -> tuple:
    """Extra hash keys of a request: its salt, when it has one."""
    return () if cache_salt is None else (cache_salt,)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple
) -> BlockHash:
    """SHA-256 of (parent hash, token ids as little-endian int64, repr of extra keys)."""
    digest = hashlib.sha256()
    # A one-byte tag keeps "no parent" distinct from any 32-byte parent digest.
    digest.update(b"R" if parent_hash is None else b"P" + parent_hash)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    digest.update(repr(extra_keys).encode("utf-8"))
    return digest.digest()


def hash_content(content: BlockContent) -> BlockHash:
    """The chained hash of a block's content (looks up ``hash_block_tokens`` at call time)."""
    return hash_block_tokens(content.parent_hash, content.token_ids, content.extra_keys)


def block_content(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    block_index: int,
    block_size: int,
    extra_keys: tuple,
) -> BlockContent:
    """The content key of block ``block_index`` (``block_size`` tokens) of ``token_ids``."""
    start = block_index * block_size
    block_tokens = tuple(token_ids[start : start + block_size])
    if len(block_tokens) != block_size:
        raise ValueError(f"block {block_index} of a {len(token_ids)}-token sequence is not full")
    return BlockContent(parent_hash, block_tokens, extra_keys)
