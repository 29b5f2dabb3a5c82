"""The tiered prefix cache: the disk tier's files, and the engine with tiers on against tiers off.

Engine runs use a tiny random Llama (fp32, greedy, CPU) with a device pool
small enough that conversations evict each other's prefix blocks; revisiting
them must give the tokens a tiers-off engine gives, with the hits counted in
the host or disk tier. A new engine on the same directory (a restart) hits
the disk tier on its first request; corrupt or truncated files are misses; a
directory that cannot be used is a warning, and the engine serves without it.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time

import pytest
import torch
from test_server_fuzz import make_tiny_llama

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ConfigError
from pagedllm.kv.prefix_cache import BlockContent, hash_content
from pagedllm.kv.tiers import (
    MANIFEST,
    NUM_READERS,
    SUFFIX,
    DiskState,
    DiskTier,
    pack_block,
    tensors_from_raw,
    tier_key,
)

BS = 16
LAYOUT = [((BS, 2, 4), torch.float32), ((BS, 2), torch.float16)]  # a K-like tensor and a scale-like one
KEY = tier_key(model_identity="m", dtype="float32", layout=LAYOUT, block_size=BS, tp_rank=0, tp_size=1)


def content(i: int, parent=None) -> BlockContent:
    return BlockContent(parent, tuple(range(i, i + BS)), ())


def tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape, dtype in LAYOUT]


def store(tier: DiskTier, c: BlockContent, seed: int) -> bytes:
    block_hash = hash_content(c)
    ticket = tier.plan_write(block_hash, c)
    tier.submit_write(ticket, pack_block(tensors(seed)))
    return block_hash


def load(tier: DiskTier, block_hash: bytes, c: BlockContent) -> list[torch.Tensor] | None:
    tier.prefetch(block_hash)
    if tier.lookup(block_hash, c) is not DiskState.READY:
        return None
    return tensors_from_raw(tier.take_claimed(tier.claim(block_hash)), LAYOUT)


# -- the disk tier on its own ------------------------------------------------------------


def test_a_block_round_trips_through_a_file_and_survives_a_restart(tmp_path):
    tier = DiskTier(tmp_path, KEY, LAYOUT, 1 << 20, threaded=False)
    c = content(0)
    block_hash = store(tier, c, seed=1)
    (path,) = tier.directory.glob("*" + SUFFIX)
    assert path.name == block_hash.hex() + SUFFIX
    assert json.loads((tier.directory / MANIFEST).read_text()) == KEY
    tier.check_invariants()
    tier.close()

    again = DiskTier(tmp_path, KEY, LAYOUT, 1 << 20, threaded=False)  # the index is rebuilt from the files
    assert again.lookup(block_hash, c) is DiskState.STORED
    assert again.lookup(block_hash, content(1)) is DiskState.ABSENT  # same hash, other content: a miss
    loaded = load(again, block_hash, c)
    for got, want in zip(loaded, tensors(1), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    again.check_invariants()


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_tokens", "other_block"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path, damage):
    tier = DiskTier(tmp_path, KEY, LAYOUT, 1 << 20, threaded=False)
    c, other = content(0), content(100)
    block_hash, other_hash = store(tier, c, seed=1), store(tier, other, seed=2)
    path = tier.directory / (block_hash.hex() + SUFFIX)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-7]
    elif damage == "flip_payload":
        raw[-3] ^= 0x40
    elif damage == "flip_tokens":  # the header's token ids change, the checksum does not follow
        raw = bytearray(bytes(raw).replace(b'"tokens": [0, 1', b'"tokens": [9, 1'))
    else:  # a sound file of another block under this name
        raw = bytearray((tier.directory / (other_hash.hex() + SUFFIX)).read_bytes())
    path.write_bytes(bytes(raw))
    assert load(tier, block_hash, c) is None
    assert tier.lookup(block_hash, c) is DiskState.ABSENT
    assert not path.exists()
    assert tier.counters.num_corrupt_files == 1
    assert load(tier, other_hash, other) is not None  # the other block is untouched
    tier.check_invariants()


def test_bad_files_are_dropped_when_the_index_is_rebuilt(tmp_path):
    tier = DiskTier(tmp_path, KEY, LAYOUT, 1 << 20, threaded=False)
    good, bad = store(tier, content(0), 1), store(tier, content(50), 2)
    tier.close()
    bad_path = tier.directory / (bad.hex() + SUFFIX)
    bad_path.write_bytes(bad_path.read_bytes()[:40])
    (tier.directory / "stray.kvb.1.2.tmp").write_bytes(b"half a write")
    again = DiskTier(tmp_path, KEY, LAYOUT, 1 << 20, threaded=False)
    assert again.num_blocks == 1 and again.lookup(good, content(0)) is DiskState.STORED
    assert sorted(p.name for p in again.directory.iterdir()) == sorted([MANIFEST, good.hex() + SUFFIX])
    again.check_invariants()


def test_the_size_cap_evicts_the_least_recently_used_file(tmp_path):
    probe = DiskTier(tmp_path / "probe", KEY, LAYOUT, 1 << 20, threaded=False)
    store(probe, content(60), 0)
    file_size = probe.num_bytes  # the largest of the four below (two-digit token ids)
    tier = DiskTier(tmp_path / "dir", KEY, LAYOUT, 3 * file_size + file_size // 2, threaded=False)
    hashes = [store(tier, content(i), i) for i in (0, 20, 40)]
    assert tier.plan_write(hashes[0], content(0)) is None  # already stored: it becomes the most recent
    store(tier, content(60), 60)
    assert tier.lookup(hashes[1], content(20)) is DiskState.ABSENT  # the least recently used went
    assert tier.lookup(hashes[0], content(0)) is DiskState.STORED
    assert tier.num_blocks == 3 and tier.num_bytes <= 3 * file_size + file_size // 2
    tier.check_invariants()


def test_a_directory_of_another_model_or_format_is_not_loaded(tmp_path):
    tier = DiskTier(tmp_path, KEY, LAYOUT, 1 << 20, threaded=False)
    block_hash = store(tier, content(0), 1)
    tier.close()
    other_layout = [((BS, 2, 4), torch.int8), ((BS, 2), torch.float16)]
    other_key = {**KEY, "layout": [[list(s), str(d)] for s, d in other_layout]}
    other = DiskTier(tmp_path, other_key, other_layout, 1 << 20, threaded=False)
    assert other.directory != tier.directory and other.num_blocks == 0
    assert other.lookup(block_hash, content(0)) is DiskState.ABSENT
    # A manifest that does not match its directory (copied in by hand) disables the tier.
    (other.directory / MANIFEST).write_text(json.dumps(KEY))
    forged = DiskTier(tmp_path, other_key, other_layout, 1 << 20, threaded=False)
    assert not forged.enabled and forged.plan_write(block_hash, content(0)) is None


def test_an_unusable_directory_warns_once_and_disables_the_tier(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        tier = DiskTier(blocker / "cache", KEY, LAYOUT, 1 << 20, threaded=False)
    assert not tier.enabled
    assert [r.message for r in caplog.records if "disk tier disabled" in r.message]
    assert tier.plan_write(hash_content(content(0)), content(0)) is None


def test_the_background_threads_write_and_prefetch(tmp_path):
    tier = DiskTier(tmp_path, KEY, LAYOUT, 1 << 20)
    c = content(0)
    block_hash = store(tier, c, seed=3)
    tier.drain()
    tier.prefetch(block_hash)
    tier.drain()
    assert tier.lookup(block_hash, c) is DiskState.READY
    got = tensors_from_raw(tier.take_claimed(tier.claim(block_hash)), LAYOUT)
    assert all(torch.equal(a, b) for a, b in zip(got, tensors(3), strict=True))
    assert tier.counters.num_written_bytes > 0 and tier.counters.write_seconds > 0
    tier.check_invariants()
    tier.close()


def test_read_buffers_are_reused_once_their_block_is_copied(tmp_path):
    tier = DiskTier(tmp_path, KEY, LAYOUT, 1 << 20, threaded=False, max_loaded_blocks=2)
    blocks = [(content(i), store(tier, content(i), seed=i)) for i in (0, 20, 40)]
    (c0, h0), (c1, h1), (c2, h2) = blocks
    tier.prefetch(h0)
    first = tier.take_claimed(tier.claim(h0))
    tier.recycle([first])  # its bytes are in the device pool now
    tier.prefetch(h1)
    again = tier.take_claimed(tier.claim(h1))
    assert again is first  # the same buffer, read into again
    assert torch.equal(tensors_from_raw(again, LAYOUT)[0], tensors(20)[0])
    tier.prefetch(h0)
    tier.prefetch(h2)  # a second buffer: two blocks loaded and unclaimed, the bound
    tier.prefetch(h1)  # over the bound: the oldest loaded copy (h0) goes back to the free list
    assert tier.lookup(h0, c0) is DiskState.STORED and tier.lookup(h1, c1) is DiskState.READY
    assert len(tier._buffers) <= 2
    tier.check_invariants()
    tier.recycle([again, again])  # handed back twice by mistake: the invariant check says so
    with pytest.raises(AssertionError, match="twice"):
        tier.check_invariants()


def busy_readers(tier: DiskTier, seconds: float) -> None:
    """Every reader thread sleeps ``seconds`` before it takes the next load (a slow disk)."""
    for _ in range(NUM_READERS):
        tier._enqueue(tier._reads, time.sleep, seconds)


def test_a_waiting_engine_sleeps_until_the_load_it_needs_is_done(tmp_path):
    tier = DiskTier(tmp_path, KEY, LAYOUT, 1 << 20)
    c = content(0)
    block_hash = store(tier, c, seed=4)
    tier.drain()
    assert tier.wait_loaded(block_hash, timeout=5.0)  # not loading: at once
    busy_readers(tier, 0.6)  # the readers are busy before they get to the block
    tier.prefetch(block_hash)
    assert tier.lookup(block_hash, c) is DiskState.LOADING
    start = time.monotonic()
    assert not tier.wait_loaded(block_hash, timeout=0.05)  # timed out, still loading
    assert 0.04 <= time.monotonic() - start < 0.5
    tier.wake()  # another thread has work for the waiter: the next wait ends at once, once
    assert not tier.wait_loaded(block_hash, timeout=5.0)
    assert time.monotonic() - start < 0.5
    threading.Timer(0.05, tier.wake).start()
    assert not tier.wait_loaded(block_hash, timeout=5.0)
    assert time.monotonic() - start < 0.5
    assert tier.wait_loaded(block_hash, timeout=5.0)
    assert time.monotonic() - start >= 0.55  # woke when the load ended, not before
    assert tier.lookup(block_hash, c) is DiskState.READY
    tier.close()


def _mixed_kv(num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Block tensors of every kind a KV cache holds: float32 and bfloat16 K/V, 8-bit codes, float16 scales."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, BS, 2, 8, generator=g),
        torch.randn(num_blocks, BS, 2, 8, generator=g).to(torch.bfloat16),
        torch.randint(-128, 128, (num_blocks, BS, 2, 8), generator=g, dtype=torch.int8),
        torch.randn(num_blocks, BS, 2, 8, generator=g).to(torch.float8_e4m3fn),
        torch.randn(num_blocks, BS, 2, generator=g).to(torch.float16),
    ]


def test_native_block_moves_equal_the_torch_reference():
    from pagedllm.kv.tiers import (
        read_blocks,
        read_blocks_reference,
        write_blocks,
        write_blocks_reference,
    )
    from pagedllm.native import cpu_ops

    if not cpu_ops.available():
        pytest.skip("native CPU kernels not built here")
    source = _mixed_kv(40, seed=1)
    ids = random.Random(0).sample(range(40), 25)
    want = read_blocks_reference(source, ids)
    got = read_blocks(source, ids)
    assert len(got) == len(want) == len(ids)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(got[3], pack_block([t[ids[3]] for t in source]))  # a raw block is its slices in order

    targets = random.Random(1).sample(range(40), 25)
    native, reference = _mixed_kv(40, seed=2), _mixed_kv(40, seed=2)
    write_blocks(native, targets, got)
    write_blocks_reference(reference, targets, want)
    for a, b in zip(native, reference, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    untouched = sorted(set(range(40)) - set(targets))
    for moved, original, fresh in zip(native, source, _mixed_kv(40, seed=2), strict=True):
        assert torch.equal(moved[targets].view(torch.uint8), original[ids].view(torch.uint8))
        assert torch.equal(moved[untouched].view(torch.uint8), fresh[untouched].view(torch.uint8))
    with pytest.raises(AssertionError, match="outside"):
        write_blocks(native, [40], got[:1])


def test_tier_options_are_checked():
    from pagedllm.config import EngineConfig

    with pytest.raises(ConfigError, match="kv_cache_dir_size"):
        EngineConfig(kv_cache_dir_size=0)
    with pytest.raises(ConfigError, match="kv_host_cache_memory"):
        EngineConfig(kv_host_cache_memory=-1)
    with pytest.raises(ConfigError, match="kv_cache_dir"):
        EngineConfig(kv_cache_dir="")


# -- the engine ------------------------------------------------------------------------------

NUM_CONVERSATIONS = 6
PREFIX_LEN = 6 * BS
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # layers x (K, V) x slots x KV heads x head_dim x fp32


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(directory)
    return directory


def conversation_prompts(turn: int) -> list[list[int]]:
    """One prompt per conversation: its own 6-block prefix plus a question for this turn."""
    prompts = []
    for c in range(NUM_CONVERSATIONS):
        rng = random.Random(c)
        prefix = [rng.randrange(3, 256) for _ in range(PREFIX_LEN)]
        prompts.append(prefix + [3 + turn, 4 + c, 5])
    return prompts


def tiny_llm(model_dir, **options) -> LLM:
    # 20 blocks: a conversation takes 7, so the next two evict its prefix.
    return LLM(model=str(model_dir), dtype="float32", device="cpu", block_size=BS, num_kv_blocks=20, **options)


def run_turns(llm: LLM, turns=(0, 1)) -> list[list[int]]:
    """Each conversation's turns one request at a time, so eviction order is fixed."""
    outputs = []
    for turn in turns:
        for prompt in conversation_prompts(turn):
            (out,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
            outputs.append(list(out.outputs[0].token_ids))
    llm.llm_engine.block_manager.check_invariants()
    return outputs


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = tiny_llm(tiny_dir)
    outputs = run_turns(llm)
    stats = llm.kv_cache_stats()
    assert stats.tiers == ()
    assert stats.prefix_cache_hits == 0  # with tiers off the revisited prefixes were evicted
    return outputs


def test_host_tier_serves_evicted_prefixes_with_equal_outputs(tiny_dir, reference):
    llm = tiny_llm(tiny_dir, kv_host_cache_memory=64 * BLOCK_BYTES)
    assert run_turns(llm) == reference
    stats = llm.kv_cache_stats()
    host = stats.tier("host")
    # Every second-turn request finds its whole 6-block prefix: on the device still, or on the host.
    assert host.num_hit_tokens + stats.prefix_cache_hits == NUM_CONVERSATIONS * PREFIX_LEN
    assert host.num_hit_tokens >= (NUM_CONVERSATIONS - 2) * PREFIX_LEN
    assert host.num_blocks == NUM_CONVERSATIONS * PREFIX_LEN // BS  # 36 distinct prefix blocks, all kept
    assert host.num_bytes == host.num_blocks * BLOCK_BYTES
    assert host.num_read_bytes == host.num_hit_tokens // BS * BLOCK_BYTES and host.num_written_bytes > 0


def test_disk_tier_serves_evicted_prefixes_and_a_restart(tiny_dir, reference, tmp_path):
    llm = tiny_llm(tiny_dir, kv_cache_dir=str(tmp_path))
    assert run_turns(llm) == reference
    stats = llm.kv_cache_stats()
    disk = stats.tier("disk")
    assert disk.num_hit_tokens + stats.prefix_cache_hits == NUM_CONVERSATIONS * PREFIX_LEN
    assert disk.num_hit_tokens >= (NUM_CONVERSATIONS - 2) * PREFIX_LEN
    assert stats.tier("host") is None  # a CPU device has no host tier unless one is asked for
    assert disk.num_written_bytes > 0 and disk.num_read_bytes > 0 and disk.num_blocks > 0
    llm.llm_engine.shutdown()  # saves what is still cached on the device

    restarted = tiny_llm(tiny_dir, kv_cache_dir=str(tmp_path))
    first = conversation_prompts(1)[0]
    (out,) = restarted.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == reference[NUM_CONVERSATIONS]
    assert restarted.kv_cache_stats().tier("disk").num_hit_tokens == PREFIX_LEN
    assert out.num_cached_tokens == PREFIX_LEN
    restarted.llm_engine.block_manager.check_invariants()
    restarted.llm_engine.shutdown()


@pytest.mark.parametrize("first,second", [("token", "head"), ("head", "token")])
def test_a_disk_tier_written_in_one_kv_layout_serves_a_restart_in_the_other(tiny_dir, reference, tmp_path,
                                                                           monkeypatch, first, second):
    """Raw blocks hold token-major slices whatever the pools' layout (cpu_ops.c KV_LAYOUT_*), so a
    restart with the other layout reads the files; and both layouts give the reference's tokens."""
    monkeypatch.setenv("PAGEDLLM_KV_LAYOUT", first)
    llm = tiny_llm(tiny_dir, kv_cache_dir=str(tmp_path))
    assert llm.llm_engine.worker.kv_cache.layout == first
    assert run_turns(llm) == reference
    llm.llm_engine.shutdown()
    monkeypatch.setenv("PAGEDLLM_KV_LAYOUT", second)
    restarted = tiny_llm(tiny_dir, kv_cache_dir=str(tmp_path))
    assert restarted.llm_engine.worker.kv_cache.layout == second
    outputs = []
    for prompt in conversation_prompts(1):
        (out,) = restarted.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        outputs.append(list(out.outputs[0].token_ids))
    assert outputs == reference[NUM_CONVERSATIONS:]
    assert restarted.kv_cache_stats().tier("disk").num_hit_tokens >= (NUM_CONVERSATIONS - 2) * PREFIX_LEN
    restarted.llm_engine.block_manager.check_invariants()
    restarted.llm_engine.shutdown()


def test_a_restarted_engine_waits_for_its_prefix_without_polling(tiny_dir, reference, tmp_path):
    llm = tiny_llm(tiny_dir, kv_cache_dir=str(tmp_path))
    assert run_turns(llm, turns=(0,)) == reference[:NUM_CONVERSATIONS]
    llm.llm_engine.shutdown()

    restarted = tiny_llm(tiny_dir, kv_cache_dir=str(tmp_path))
    engine = restarted.llm_engine
    start = time.monotonic()
    for c in (0, 1):  # a slow disk: r0's prefix is in memory after 0.05 s, r1's after 0.1 s
        busy_readers(engine.disk_tier, 0.05)
        engine.add_request(f"r{c}", conversation_prompts(1)[c], GREEDY)
    num_steps, first_step, tokens = 0, {}, {}
    while engine.has_unfinished_requests():
        num_steps += 1
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            first_step.setdefault(out.request_id, num_steps)
    # The steps before the first token each slept until a load ended (at most one step per
    # block loaded; polling every 1 ms for 0.3 s would take hundreds), and both requests,
    # which came in together, ran their first step together: r0 waited for r1's loads
    # (well within its 0.5 s wait) instead of stepping alone.
    assert first_step["r0"] == first_step["r1"] <= 2 * PREFIX_LEN // BS + 1
    assert time.monotonic() - start >= 0.1
    assert [tokens["r0"], tokens["r1"]] == reference[NUM_CONVERSATIONS : NUM_CONVERSATIONS + 2]
    assert restarted.kv_cache_stats().tier("disk").num_hit_tokens == 2 * PREFIX_LEN
    engine.block_manager.check_invariants()
    engine.shutdown()


def test_corrupt_and_truncated_files_are_misses(tiny_dir, reference, tmp_path):
    llm = tiny_llm(tiny_dir, kv_cache_dir=str(tmp_path))
    assert run_turns(llm, turns=(0,)) == reference[:NUM_CONVERSATIONS]
    llm.llm_engine.shutdown()
    files = sorted(tmp_path.rglob("*" + SUFFIX))
    assert files
    for i, path in enumerate(files):
        raw = bytearray(path.read_bytes())
        if i % 2:
            raw = raw[: len(raw) // 2]  # truncated: dropped when the index is rebuilt
        else:
            raw[-5] ^= 0x01  # corrupt payload: fails its checksum when loaded
        path.write_bytes(bytes(raw))
    restarted = tiny_llm(tiny_dir, kv_cache_dir=str(tmp_path))
    assert run_turns(restarted, turns=(1,)) == reference[NUM_CONVERSATIONS:]
    stats = restarted.kv_cache_stats()
    assert stats.tier("disk").num_hit_tokens == 0
    assert restarted.llm_engine.disk_tier.counters.num_corrupt_files > 0
    restarted.llm_engine.shutdown()


def test_an_unwritable_cache_dir_warns_and_serves(tiny_dir, reference, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = tiny_llm(tiny_dir, kv_cache_dir=str(blocker / "kv"))
    assert any("disk tier disabled" in r.message for r in caplog.records)
    assert run_turns(llm) == reference
    assert llm.kv_cache_stats().tier("disk").num_blocks == 0


# -- a real server, restarted on the same --kv-cache-dir ----------------------------------------


def _tier_samples(server, name: str) -> dict[str, float]:
    """``pagedllm:<name>`` samples by their tier label, from the server's /metrics text."""
    import re

    import httpx

    text = httpx.get(f"{server.base_url}/metrics", timeout=10.0).text
    pattern = rf'^pagedllm:{name}\{{[^}}]*tier="(\w+)"[^}}]*\}}\s+(\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}


@pytest.mark.slow
def test_a_restarted_server_serves_its_first_request_from_the_disk_tier(tiny_dir, tmp_path):
    from openai import OpenAI
    from server_fixture import ServerProcess

    args = ("--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu", "--block-size", str(BS),
            "--num-kv-blocks", "20", "--kv-cache-dir", str(tmp_path), "--kv-cache-dir-size", "64MiB")

    def complete(server, prompt):
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        out = client.completions.create(model=tiny_dir.name, prompt=prompt, max_tokens=6, temperature=0.0)
        return out.choices[0].text

    server = ServerProcess(*args).wait_ready()
    try:
        first_texts = [complete(server, prompt) for prompt in conversation_prompts(0)]
        assert _tier_samples(server, "kv_tier_hits_total") == {"disk": 0.0}
        assert _tier_samples(server, "kv_tier_written_bytes_total")["disk"] > 0
    finally:
        assert server.stop() == 0, server.log()
    assert any(tmp_path.rglob("*" + SUFFIX))

    server = ServerProcess(*args).wait_ready()
    try:
        assert _tier_samples(server, "kv_tier_blocks")["disk"] >= NUM_CONVERSATIONS * PREFIX_LEN // BS
        assert complete(server, conversation_prompts(0)[0]) == first_texts[0]
        assert _tier_samples(server, "kv_tier_hits_total")["disk"] == PREFIX_LEN
        assert _tier_samples(server, "kv_tier_read_bytes_total")["disk"] > 0
    finally:
        assert server.stop() == 0, server.log()


def test_a_directory_that_fails_while_serving_warns_and_serves(tiny_dir, reference, tmp_path, caplog):
    import shutil

    llm = tiny_llm(tiny_dir, kv_cache_dir=str(tmp_path / "kv"))
    directory = llm.llm_engine.disk_tier.directory
    shutil.rmtree(directory)
    directory.write_text("")  # every block write now fails, as on a full or vanished disk
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert run_turns(llm) == reference
        llm.llm_engine.disk_tier.drain()
    assert len([r for r in caplog.records if "disk tier disabled" in r.message]) == 1
    assert not llm.llm_engine.disk_tier.enabled
    llm.llm_engine.shutdown()


@pytest.mark.slow
def test_host_tier_under_tensor_parallelism(tiny_dir, reference):
    """Each rank keeps its heads' share of an evicted block in its own host pool."""
    llm = tiny_llm(tiny_dir, tensor_parallel_size=2, kv_host_cache_memory=64 * BLOCK_BYTES)
    try:
        assert run_turns(llm) == reference
        stats = llm.kv_cache_stats()
        assert stats.tier("host").num_hit_tokens + stats.prefix_cache_hits == NUM_CONVERSATIONS * PREFIX_LEN
        assert stats.tier("host").num_hit_tokens > 0 and stats.tier("disk") is None
    finally:
        llm.llm_engine.shutdown()


def test_disk_tier_under_tensor_parallelism_and_a_restart(tiny_dir, reference, tmp_path):
    """Rank 0 saves whole blocks (every KV head, gathered from both ranks) and scatters them
    back on a hit: outputs equal the single-process engine's, before and after a restart."""
    llm = tiny_llm(tiny_dir, tensor_parallel_size=2, kv_cache_dir=str(tmp_path))
    try:
        assert llm.llm_engine.kv_cache.block_tensors()[0].shape[2] == 1  # this rank's one KV head of 2
        assert run_turns(llm) == reference
        stats = llm.kv_cache_stats()
        disk = stats.tier("disk")
        assert disk.num_hit_tokens + stats.prefix_cache_hits == NUM_CONVERSATIONS * PREFIX_LEN
        assert disk.num_hit_tokens >= (NUM_CONVERSATIONS - 2) * PREFIX_LEN
        (directory,) = [p for p in tmp_path.iterdir() if p.is_dir()]
        manifest = json.loads((directory / MANIFEST).read_text())
        assert manifest["tp_size"] == 2
        assert [shape for shape, _ in manifest["layout"]] == [[BS, 2, 16]] * 4  # 2 layers x (K, V), both heads
    finally:
        llm.llm_engine.shutdown()  # every rank's part of what is still cached goes to disk
    restarted = tiny_llm(tiny_dir, tensor_parallel_size=2, kv_cache_dir=str(tmp_path))
    try:
        for c in (0, NUM_CONVERSATIONS - 1):  # evicted long ago, and cached on the device at shutdown
            prompt = conversation_prompts(1)[c]
            (out,) = restarted.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
            assert list(out.outputs[0].token_ids) == reference[NUM_CONVERSATIONS + c]
            assert out.num_cached_tokens == PREFIX_LEN
        assert restarted.kv_cache_stats().tier("disk").num_hit_tokens == 2 * PREFIX_LEN
        restarted.llm_engine.block_manager.check_invariants()
    finally:
        restarted.llm_engine.shutdown()


@pytest.mark.slow
def test_disk_tier_under_tensor_parallelism_with_a_shared_kv_head(tmp_path):
    """3 KV heads over 2 ranks: the middle head is held by both (its rows' attention split
    between them, pagedllm.distributed.head_shard). Rank 0 saves whole blocks gathered from
    both ranks and scatters them back on a hit: outputs equal the single-process engine's,
    before and after a restart, and each rank's block invariants hold."""
    from tiny_models import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    want = run_turns(tiny_llm(model))
    cache = tmp_path / "cache"
    llm = tiny_llm(model, tensor_parallel_size=2, kv_cache_dir=str(cache))
    try:
        assert llm.llm_engine.kv_cache.block_tensors()[0].shape[2] == 2  # its own KV head and the shared one
        assert run_turns(llm) == want
        stats = llm.kv_cache_stats()
        assert stats.tier("disk").num_hit_tokens >= (NUM_CONVERSATIONS - 2) * PREFIX_LEN
    finally:
        llm.llm_engine.shutdown()
    restarted = tiny_llm(model, tensor_parallel_size=2, kv_cache_dir=str(cache))
    try:
        for c in (0, NUM_CONVERSATIONS - 1):
            (out,) = restarted.generate([{"prompt_token_ids": conversation_prompts(1)[c]}], GREEDY, use_tqdm=False)
            assert list(out.outputs[0].token_ids) == want[NUM_CONVERSATIONS + c]
            assert out.num_cached_tokens == PREFIX_LEN
        restarted.llm_engine.block_manager.check_invariants()
    finally:
        restarted.llm_engine.shutdown()
