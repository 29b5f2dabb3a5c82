"""``pagedllm bench serve --arm ... [--multi-turn]``: server arms, the multi-turn chat
workload (prompt growth, the number of conversations for a pool), and the report's
arithmetic; then the harness against real ``pagedllm serve`` processes (slow)."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.bench import arms, multiturn, serve
from pagedllm.bench.multiturn import ConversationLoad, TurnResult
from pagedllm.cli import build_parser
from pagedllm.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *argv])


# ---- arms ---------------------------------------------------------------------------


def test_an_arm_is_a_name_and_shell_split_flags_with_a_kv_dir_placeholder():
    arm = arms.parse_arm("on=--kv-cache-dir {kv_dir} --kv-host-cache-memory 2GiB --chat-template '{{ x }} y'")
    assert arm.name == "on"
    assert arm.flags == ("--kv-cache-dir", "{kv_dir}", "--kv-host-cache-memory", "2GiB", "--chat-template", "{{ x }} y")
    assert arm.uses_kv_dir
    assert arm.resolved_flags("/tmp/a")[:2] == ["--kv-cache-dir", "/tmp/a"]
    with pytest.raises(ValueError, match="needs a kv_dir"):
        arm.resolved_flags(None)
    base = arms.parse_arm("base=")
    assert base.flags == () and not base.uses_kv_dir and base.resolved_flags(None) == []


@pytest.mark.parametrize("text, message", [
    ("no-equals-sign", "write NAME=FLAGS"),
    ("=--num-kv-blocks 4", "write NAME=FLAGS"),
    ("a b=--x", "write NAME=FLAGS"),
    ("x=--port 9", "--port is set by the benchmark"),
    ("x=--chat-template 'unclosed", "do not parse"),
])
def test_bad_arms_are_config_errors_that_say_what_to_write(text, message):
    with pytest.raises(ConfigError, match=message):
        arms.parse_arm(text)


def test_arm_names_must_differ():
    with pytest.raises(ConfigError, match="must differ"):
        arms.parse_arms(["a=", "a=--num-kv-blocks 8"])


def test_an_arm_server_gets_the_shared_settings_then_its_own_flags_which_win():
    args = _args("--arm", "big=--num-kv-blocks 64 --max-num-seqs 4", "--max-num-seqs", "8")
    settings = serve.server_settings(args, 512)
    server = arms.ArmServer(arms.parse_arm(args.arm[0]), settings, None, args)
    command = server.command
    served = build_parser().parse_args(command[command.index("serve"):])
    assert (served.max_num_seqs, served.num_kv_blocks, served.max_model_len) == (4, 64, 512)
    assert served.port == int(server.base_url.rsplit(":", 1)[1])


# ---- /metrics counters and hit rates --------------------------------------------------

METRICS_TEXT = """\
# HELP pagedllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE pagedllm:prefix_cache_queries_total counter
pagedllm:prefix_cache_queries_total{model_name="m"} 1000.0
# HELP pagedllm:prefix_cache_hits_total Prompt tokens served from the prefix cache.
# TYPE pagedllm:prefix_cache_hits_total counter
pagedllm:prefix_cache_hits_total{model_name="m"} 300.0
# HELP pagedllm:kv_tier_hits_total Prompt tokens brought back from a tier.
# TYPE pagedllm:kv_tier_hits_total counter
pagedllm:kv_tier_hits_total{model_name="m",tier="host"} 200.0
pagedllm:kv_tier_hits_total{model_name="m",tier="disk"} 100.0
# HELP pagedllm:num_requests_running Requests in the running batch.
# TYPE pagedllm:num_requests_running gauge
pagedllm:num_requests_running{model_name="m"} 3.0
# HELP pagedllm:time_to_first_token_seconds Time to first token.
# TYPE pagedllm:time_to_first_token_seconds histogram
pagedllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0
pagedllm:time_to_first_token_seconds_count{model_name="m"} 2.0
pagedllm:time_to_first_token_seconds_sum{model_name="m"} 0.1
"""


def test_counters_are_read_by_short_name_with_the_tier_label():
    counters = arms.parse_counters(METRICS_TEXT)
    assert counters == {
        "prefix_cache_queries": 1000.0, "prefix_cache_hits": 300.0,
        "kv_tier_hits:host": 200.0, "kv_tier_hits:disk": 100.0, "num_requests_running": 3.0,
    }
    assert arms.tier_names(counters) == ["disk", "host"]


def test_hit_rate_of_a_load_counts_device_and_tier_hits_between_two_readings():
    before = {"prefix_cache_queries": 100.0, "prefix_cache_hits": 50.0, "kv_tier_hits:disk": 0.0}
    after = arms.parse_counters(METRICS_TEXT)
    hits = arms.prefix_hits(before, after)
    assert hits["queries"] == 900 and hits["device_hits"] == 250
    assert hits["tier_hits"] == {"disk": 100.0, "host": 200.0}
    assert hits["hit_rate"] == pytest.approx(550 / 900)
    assert hits["device_hit_rate"] == pytest.approx(250 / 900)
    assert hits["tier_hit_rates"] == {"disk": pytest.approx(100 / 900), "host": pytest.approx(200 / 900)}
    # prefix caching off (no queries) or a server without the metric: no hit rate at all
    assert arms.prefix_hits(after, after) is None
    assert arms.prefix_hits({}, {"num_requests_running": 1.0}) is None


# ---- the conversations ------------------------------------------------------------------


def test_user_messages_are_seeded_per_conversation_and_turn():
    load = ConversationLoad(user_words=12, seed=5)
    message = multiturn.user_message(load, 3, 1)
    assert len(message.split()) == 12
    assert message == multiturn.user_message(ConversationLoad(user_words=12, seed=5), 3, 1)
    others = {multiturn.user_message(load, c, t) for c, t in ((3, 0), (4, 1), (0, 0))}
    assert message not in others and len(others) == 3
    assert multiturn.user_message(ConversationLoad(user_words=12, seed=6), 3, 1) != message


def test_planned_prompt_is_the_whole_conversation_so_far_plus_the_new_message():
    load = ConversationLoad(user_words=4)
    plan = multiturn.planned_messages(load, 2, 3)
    assert [m["role"] for m in plan] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in plan[::2]] == [multiturn.user_message(load, 2, t) for t in range(3)]
    assert multiturn.planned_messages(load, 2, 2) == plan[:3]


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.models.paths import resolve_model_path
    from pagedllm.tokenizer import Tokenizer

    return Tokenizer.load(resolve_model_path(None))


def test_estimated_length_grows_by_a_message_an_answer_and_the_template_per_turn(tokenizer):
    load = ConversationLoad(user_words=20, max_tokens=10)
    lengths = [multiturn.estimated_tokens(tokenizer, load, 0, t) for t in (1, 2, 3)]
    for turn, (shorter, longer) in enumerate(zip(lengths, lengths[1:]), start=1):
        message = multiturn.user_message(load, 0, turn)
        message_tokens = len(tokenizer.encode(message, add_special_tokens=False))
        growth = longer - shorter
        # the new message, one more answer of max_tokens, and a few template tokens around both
        assert message_tokens + 10 < growth <= message_tokens + 10 + 12, (turn, growth, message_tokens)
    first = tokenizer.apply_chat_template(multiturn.planned_messages(load, 0, 1), add_generation_prompt=True)
    assert lengths[0] == len(tokenizer.encode(first, add_special_tokens=False)) + 10


def test_conversations_for_a_pool_is_the_smallest_count_that_holds_the_multiple():
    assert multiturn.conversations_for_pool(iter([100] * 1000), pool_tokens=1000, multiple=4) == 40
    assert multiturn.conversations_for_pool(iter([150, 250, 100, 500]), pool_tokens=100, multiple=4) == 2
    assert multiturn.conversations_for_pool(iter([150, 250, 100, 500]), pool_tokens=100, multiple=4.01) == 3
    with pytest.raises(ConfigError, match="never reach"):
        multiturn.conversations_for_pool(iter([1, 2]), pool_tokens=100, multiple=4)


def test_conversation_count_auto_from_the_first_pool_and_checked_against_max_model_len(tokenizer):
    args = _args("--multi-turn", "--arm", "off=", "--turns", "3", "--user-words", "20", "--output-len", "10")
    load = multiturn.load_from_args(args)
    plan = multiturn.Plan(args, load, tokenizer)
    per_conversation = multiturn.estimated_tokens(tokenizer, load, 0, 3)
    assert plan.max_model_len % 256 == 0 and plan.max_model_len >= per_conversation
    count = plan.fix_conversations(arms.KVPool(num_blocks=64, block_size=16))
    total = sum(multiturn.estimated_tokens(tokenizer, load, i, 3) for i in range(count))
    assert total >= 4 * 1024 > total - multiturn.estimated_tokens(tokenizer, load, count - 1, 3)
    assert plan.fix_conversations(arms.KVPool(num_blocks=1, block_size=16)) == count  # fixed by the first arm
    with pytest.raises(ConfigError, match="give --conversations N"):
        multiturn.Plan(args, load, tokenizer).fix_conversations(None)
    short = _args("--multi-turn", "--arm", "off=", "--conversations", "3", "--max-model-len", "64")
    with pytest.raises(ConfigError, match="more than --max-model-len 64"):
        multiturn.Plan(short, multiturn.load_from_args(short), tokenizer).fix_conversations(None)


# ---- report arithmetic --------------------------------------------------------------------


def test_turn_summary_splits_turn_one_from_later_turns():
    results = [
        TurnResult(0, 0, ttft_s=0.2, e2e_s=1.0, output_tokens=4, prompt_tokens=40, cached_tokens=16),
        TurnResult(0, 1, ttft_s=0.1, e2e_s=0.5, output_tokens=4, prompt_tokens=80, cached_tokens=32),
        TurnResult(1, 0, ttft_s=0.4, e2e_s=1.0, output_tokens=4, prompt_tokens=40, cached_tokens=0),
        TurnResult(1, 1, error="HTTP 500: boom"),
    ]
    summary = multiturn.summarize_turns(results, duration_s=2.0)
    assert (summary["num_conversations"], summary["turns_sent"], summary["turns_completed"]) == (2, 4, 3)
    assert summary["errors"] == 1 and summary["error_samples"] == ["HTTP 500: boom"]
    assert summary["output_tokens"] == 12 and summary["output_tokens_per_s"] == 6.0
    assert summary["ttft_turn1_ms"] == {"mean": pytest.approx(300), "p50": pytest.approx(300), "p90": pytest.approx(380)}
    assert summary["ttft_later_ms"]["mean"] == pytest.approx(100)
    assert summary["cached_share_turn1"] == pytest.approx(16 / 80)
    assert summary["cached_share_later"] == pytest.approx(32 / 80)
    # final lengths: conversation 0 after turn 2 (80 + 4), conversation 1 after turn 1 (40 + 4)
    assert summary["conversation_tokens"] == 84 + 44


def _arm(name: str, hit_rate: float, ttft_later: float, tok_s: float) -> dict:
    return {"arm": name, "prefix_cache": {"hit_rate": hit_rate}, "ttft_later_ms": {"mean": ttft_later},
            "output_tokens_per_s": tok_s}


def test_target_ratios_compare_the_arms_in_their_roles():
    results = [_arm("off", 0.2, 900.0, 10.0), _arm("on", 0.72, 150.0, 12.0), _arm("unlimited", 0.8, 100.0, 13.0)]
    ratios = multiturn.target_ratios(results, ("off", "on", "unlimited"))
    assert ratios == {"hit_rate_vs_unlimited": pytest.approx(0.9), "ttft_later_off_over_on": pytest.approx(6.0),
                      "tok_s_on_over_off": pytest.approx(1.2)}
    missing = multiturn.target_ratios(results[:1], ("off", "on", "unlimited"))
    assert missing == {"hit_rate_vs_unlimited": None, "ttft_later_off_over_on": None, "tok_s_on_over_off": None}


def test_a_reference_arm_smaller_than_the_conversations_is_flagged():
    ok = {"arm": "unlimited", "kv_vs_pool": 0.2, "server_metrics": {"preemptions": 0.0}}
    assert multiturn.reference_warnings([ok], "unlimited") == []
    small = {"arm": "unlimited", "kv_vs_pool": 1.5, "server_metrics": {"preemptions": 3.0}}
    warnings = multiturn.reference_warnings([small], "unlimited")
    assert len(warnings) == 2 and "1.50x" in warnings[0] and "preempted 3 times" in warnings[1]
    assert multiturn.reference_warnings([small], "other") == []


def test_restart_ratios_are_cold_over_restarted_and_the_disk_share():
    restart = {
        "restarted": {"prefix_cache": {"hit_rate": 0.9, "tier_hit_rates": {"disk": 0.85}}, "ttft_later_ms": {"mean": 50.0}},
        "cold": {"prefix_cache": {"hit_rate": 0.05, "tier_hit_rates": {}}, "ttft_later_ms": {"mean": 400.0}},
    }
    assert multiturn.restart_ratios(restart) == {
        "ttft_cold_over_restarted": 8.0, "disk_hit_rate": 0.85, "hit_rate_restarted": 0.9, "hit_rate_cold": 0.05,
    }
    restart["restarted"]["prefix_cache"] = None  # prefix caching off: no rates, no crash
    assert multiturn.restart_ratios(restart)["disk_hit_rate"] is None


def test_serve_arm_rows_divide_pool_peak_running_and_throughput_by_the_first_arm():
    def result(name: str, blocks: int, peak: float, tok_s: float) -> dict:
        return {"arm": name, "kv_pool": {"num_blocks": blocks, "num_tokens": 16 * blocks}, "completed": 256,
                "num_requests": 256, "output_tokens_per_s": tok_s, "ttft_ms": {"mean": 5.0},
                "server_metrics": {"peak_running": peak, "peak_waiting": 0.0, "preemptions": 3.0}, "loadavg_1m": 1.0}

    rows = arms.serve_arm_rows([result("auto", 100, 60.0, 500.0), result("int8", 200, 117.0, 480.0)])
    headers = arms.SERVE_ARM_HEADERS
    int8 = dict(zip(headers, rows[1]))
    assert int8["KV tokens"] == 3200 and int8["peak running"] == 117
    assert int8["tokens x first"] == 2.0 and int8["peak running x first"] == pytest.approx(1.95)
    assert int8["tok/s x first"] == pytest.approx(0.96)
    assert dict(zip(headers, rows[0]))["peak running x first"] == 1.0


# ---- bad input from the command line ------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--multi-turn"], "--multi-turn needs at least one --arm"),
    (["--arm", "a=", "--base-url", "http://127.0.0.1:1"], "without --base-url and --compare"),
    (["--multi-turn", "--arm", "a=", "--restart-arm", "b"], "--restart-arm 'b' is not one of the arms"),
    (["--multi-turn", "--arm", "a=", "--conversations", "many"], "'auto' or an integer"),
    (["--multi-turn", "--arm", "a=", "--turns", "0"], "--turns"),
    (["--multi-turn", "--arm", "a", "--turns", "2"], "write NAME=FLAGS"),
    (["--multi-turn", "--arm", "a=", "--target-arms", "off,on"], "three arm names"),
    (["--multi-turn", "--arm", "a=", "--pool-multiple", "0"], "--pool-multiple must be > 0"),
])
def test_bad_multi_turn_options_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        serve.run(_args(*argv))


# ---- against real servers ------------------------------------------------------------------
# Real ``pagedllm serve`` processes of a 2-layer random-weight Llama that has the default
# model's tokenizer and chat template (conftest.tiny_default_tokenizer_model): the prompts,
# the templated conversations and every token count are the default model's; each server
# starts and generates in a fraction of the default model's time. Answers are ``ignore_eos``,
# so their length does not depend on the weights.


@pytest.mark.slow
def test_multi_turn_arms_and_restart_against_real_servers(tmp_path, tiny_default_tokenizer_model):
    """Two device pools (the small one auto-sizes C to 2x its tokens), then a restart of the
    small arm with the returning turn on a restarted and a cold server."""
    args = _args(
        "--model", str(tiny_default_tokenizer_model), "--multi-turn", "--turns", "2", "--user-words", "16", "--output-len", "4", "--max-concurrency", "4",
        "--pool-multiple", "2", "--arm", "off=--num-kv-blocks 16", "--arm", "unlimited=--num-kv-blocks 256",
        "--target-arms", "off,unlimited,unlimited", "--restart-arm", "off", "--max-model-len", "256",
        "--no-warmup", "--metrics-interval", "0.2", "--json", str(tmp_path / "mt.json"),
    )
    assert multiturn.run_arms(args) == 0
    from pagedllm.bench.report import read_json

    data = read_json(tmp_path / "mt.json")
    off, unlimited = data["results"]
    count = data["num_conversations"]
    assert off["kv_pool"] == {"num_blocks": 16, "block_size": 16, "num_tokens": 256}
    assert unlimited["kv_pool"]["num_tokens"] == 4096
    for r in (off, unlimited):
        assert r["turns_completed"] == r["turns_sent"] == 2 * count and r["errors"] == 0
        assert r["output_tokens"] == 4 * 2 * count
        assert r["ttft_turn1_ms"]["mean"] > 0 and r["ttft_later_ms"]["mean"] > 0
    # the measured conversations hold at least 2x the small pool (the estimate is close to exact)
    assert off["conversation_tokens"] >= 2 * 256 * 0.95 and off["kv_vs_pool"] >= 1.9
    # each turn's prompt is the conversation so far: the first prompt, its answer and a new message
    by_key = {(t["conversation"], t["turn"]): t for t in off["turns"]}
    for c in range(count):
        first, second = by_key[(c, 0)], by_key[(c, 1)]
        assert second["prompt_tokens"] >= first["prompt_tokens"] + first["output_tokens"] + 16
    # every second turn finds its history in the large pool; the small one has lost some
    assert unlimited["prefix_cache"]["hit_rate"] > off["prefix_cache"]["hit_rate"]
    assert unlimited["cached_share_later"] > 0.3
    restart = data["restart"]
    assert restart["arm"] == "off" and not restart["kv_dir_reused"]
    for label in ("restarted", "cold"):
        assert restart[label]["turns_completed"] == count and restart[label]["errors"] == 0
        assert {t["turn"] for t in restart[label]["turns"]} == {2}
        assert restart[label]["ttft_later_ms"]["mean"] > 0
    assert multiturn.restart_ratios(restart)["ttft_cold_over_restarted"] > 0
    assert data["env"]["cpu_model"]


@pytest.mark.slow
def test_an_arm_server_whose_port_is_taken_meanwhile_starts_on_another(tiny_default_tokenizer_model):
    """free_port() closes its probe, so the port can be gone when the server binds it: the arm
    retries on a new port instead of failing the benchmark."""
    import socket

    import httpx

    args = _args("--model", str(tiny_default_tokenizer_model), "--arm", "a=--num-kv-blocks 16", "--max-model-len", "64")
    server = arms.ArmServer(arms.parse_arm(args.arm[0]), serve.server_settings(args, 64), None, args)
    taken = int(server.base_url.rsplit(":", 1)[1])
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with server:
            port = int(server.base_url.rsplit(":", 1)[1])
            assert port != taken
            assert str(port) in server.command and server.pool is not None
            assert httpx.get(f"{server.base_url}/v1/models", timeout=10).status_code == 200


@pytest.mark.slow
def test_single_turn_arms_report_their_pools_and_peak_running(tmp_path, tiny_default_tokenizer_model):
    """The 8-bit-KV arm's mechanism with two pool sizes that exist today: the report reads
    each server's pool and the most sequences it ran at once."""
    args = _args(
        "--model", str(tiny_default_tokenizer_model), "--arm", "small=--num-kv-blocks 24", "--arm", "double=--num-kv-blocks 48", "--dataset", "random",
        "--num-prompts", "16", "--input-len", "48", "--output-len", "24", "--max-model-len", "128",
        "--no-warmup", "--metrics-interval", "0.05", "--json", str(tmp_path / "arms.json"),
    )
    assert serve.run(args) == 0
    from pagedllm.bench.report import read_json

    small, double = read_json(tmp_path / "arms.json")["results"]
    assert small["kv_pool"]["num_tokens"] == 384 and double["kv_pool"]["num_tokens"] == 768
    assert small["completed"] == double["completed"] == 16
    # 16 sequences of up to 72 tokens (5 blocks) do not fit 24 blocks at once; they fit 48 better
    assert small["server_metrics"]["peak_running"] < 16
    # the server's exact per-step peak can only be above what a sample every 0.05 s saw (the small model runs this load in well under a second)
    for arm in (small, double):
        assert arm["server_metrics"]["peak_running_since_start"] >= arm["server_metrics"]["peak_running"]
    # the larger pool ran more at once: by the servers' exact peaks (the 0.05 s samples can miss
    # either arm's peak when the small model finishes the load between two of them)
    assert double["server_metrics"]["peak_running_since_start"] > small["server_metrics"]["peak_running_since_start"]
    rows = dict(zip(arms.SERVE_ARM_HEADERS, arms.serve_arm_rows([small, double])[1]))
    assert rows["tokens x first"] == 2.0 and rows["peak running x first"] > 1.0


def test_the_report_prints_each_arm_the_target_ratios_and_the_restart():
    turns = [TurnResult(c, t, ttft_s=0.1 * (t + 1), e2e_s=1.0, output_tokens=4, prompt_tokens=50 * (t + 1),
                        cached_tokens=16 * t) for c in range(2) for t in range(2)]

    def arm(name: str, hit_rate: float | None, blocks: int) -> dict:
        prefix = None if hit_rate is None else {
            "hit_rate": hit_rate, "device_hit_rate": hit_rate / 2, "tier_hit_rates": {"disk": hit_rate / 2}}
        return {"arm": name, "label": name, "arm_flags": ["--num-kv-blocks", str(blocks)],
                "kv_pool": {"num_tokens": 16 * blocks}, "kv_vs_pool": 0.5, "prefix_cache": prefix,
                "server_metrics": {"peak_running": 2.0, "preemptions": 0.0}, "loadavg_1m": 1.5,
                **multiturn.summarize_turns(turns, 2.0)}

    results = [arm("off", 0.3, 16), arm("on", 0.54, 16), arm("unlimited", 0.6, 512)]
    restart = {"arm": "on", "kv_dir_reused": True, "restarted": arm("on", 0.8, 16), "cold": arm("on", None, 16)}
    env = {"cpu_model": "Some CPU", "native_isa": "avx512", "cpu_isa_flags": ["avx2", "avx512f"],
           "cpus_allowed": 2, "loadavg_1m": 1.234}
    text = multiturn.format_report(results, restart, ConversationLoad(num_turns=2), 2, env, ("off", "on", "unlimited"))
    assert "2 conversations x 2 turns" in text
    assert "hit rate on/unlimited 0.90x (>= 0.90)" in text
    assert "mean TTFT turns>=2 off/on 1.00x (>= 3)" in text and "output tok/s on/off 1.00x (>= 1)" in text
    assert "disk 27.0%" in text and "  off: --num-kv-blocks 16" in text
    assert "Restart of arm on" in text and "disk-tier hit rate 40.0%" in text
    assert "returning-turn TTFT cold/restarted 1.00x" in text
    assert "Some CPU, native ISA avx512 (avx2 avx512f), 2 CPUs, load average (1 min) 1.23" in text
