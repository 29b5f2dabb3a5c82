"""``pagedllm bench serve --multi-turn``: C chat conversations of T turns, per server arm.

Each conversation sends T user messages to ``/v1/chat/completions`` (streamed), each
turn's prompt the whole conversation so far (earlier user messages and the server's
answers) plus the new message, as chat clients do. User messages are seeded random
words; answers are ``--output-len`` tokens each (``ignore_eos``), greedy unless
``--temperature`` is given (then seeded per conversation and turn). At most
``--max-concurrency`` turns are in flight; a conversation's next turn queues behind
the turns already waiting, so the conversations advance round by round and a turn
comes back to its prefix only after every other conversation has run a turn: the
reuse distance is the whole working set.

``--conversations auto`` picks the smallest C whose conversations, at their final
length, hold ``--pool-multiple`` (default 4) times the first arm's device KV pool
(read from the server). The lengths are counted with the model's tokenizer and chat
template, the answers at ``--output-len`` tokens; the report gives the measured total.

Per arm (see :mod:`pagedllm.bench.arms`): prefix hit rate over the load from the
server's ``/metrics`` (device pool and each tier), TTFT of turn 1 and of turns >= 2
(mean, p50, p90), output tok/s, peak running requests, preemptions, load average.
With arms named as ``--target-arms`` (default ``off,on,unlimited``) it prints the
issue's ratios: hit rate on / unlimited, mean TTFT of turns >= 2 off / on, output
tok/s on / off.

``--restart-arm NAME``: after arm NAME's load its server stops, a new one starts with
the same flags and the same ``{kv_dir}``, and each conversation sends one more turn
(its history from before the restart plus a new message); then a cold server (a
fresh, empty ``{kv_dir}``) gets the very same requests. Reported: the returning
turn's hit rates (the disk tier's among them) and its TTFT restarted vs cold.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from pagedllm.bench import report
from pagedllm.bench.arms import (
    ArmServer,
    ServerArm,
    fresh_dir,
    loadavg_1m,
    machine_line,
    parse_arms,
    prefix_hits,
    ratio,
    read_counters,
)
from pagedllm.bench.sessions import _WORDS, TurnRecord, stream_chat_turn
from pagedllm.bench.stopping import run_async
from pagedllm.errors import ConfigError

DEFAULT_TARGET_ARMS = ("off", "on", "unlimited")
# Slack on the estimated conversation length when sizing max_model_len: an answer's
# text may re-tokenize to a few more tokens than were generated.
_LENGTH_SLACK = 1.15


@dataclass(frozen=True)
class ConversationLoad:
    """The shape of the load: token counts per turn; ``max_concurrency`` turns in flight."""

    num_turns: int = 4
    user_words: int = 48
    max_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    max_concurrency: int = 8

    def check(self) -> None:
        if self.num_turns < 1 or self.user_words < 1 or self.max_tokens < 1 or self.max_concurrency < 1:
            raise ConfigError("--turns, --user-words, --output-len and --max-concurrency must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")


def user_message(load: ConversationLoad, conversation: int, turn: int) -> str:
    """Conversation ``conversation``'s user message of turn ``turn`` (0-based): the same on every arm."""
    rng = random.Random(f"{load.seed}:{conversation}:{turn}")
    return " ".join(rng.choice(_WORDS) for _ in range(load.user_words))


def planned_messages(load: ConversationLoad, conversation: int, num_turns: int) -> list[dict]:
    """The conversation at its ``num_turns``-th prompt with every earlier answer left empty."""
    messages: list[dict] = []
    for turn in range(num_turns):
        if turn:
            messages.append({"role": "assistant", "content": ""})
        messages.append({"role": "user", "content": user_message(load, conversation, turn)})
    return messages


def estimated_tokens(tokenizer, load: ConversationLoad, conversation: int, num_turns: int) -> int:
    """Tokens of the conversation after its ``num_turns``-th answer: the chat-templated prompt
    with empty earlier answers, plus ``max_tokens`` per answer (the earlier ones and the last)."""
    text = tokenizer.apply_chat_template(planned_messages(load, conversation, num_turns), add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False)) + num_turns * load.max_tokens


def conversations_for_pool(conversation_tokens, pool_tokens: int, multiple: float) -> int:
    """The smallest C whose first C conversations (``conversation_tokens``, an iterable of
    each conversation's final length) hold at least ``multiple`` x ``pool_tokens``."""
    wanted = multiple * pool_tokens
    total = 0
    for count, tokens in enumerate(conversation_tokens, start=1):
        total += tokens
        if total >= wanted:
            return count
    raise ConfigError(f"the conversations never reach {wanted:.0f} tokens")


def _endless(tokenizer, load: ConversationLoad, num_turns: int):
    conversation = 0
    while True:
        yield estimated_tokens(tokenizer, load, conversation, num_turns)
        conversation += 1


# ---- running conversations ------------------------------------------------------


@dataclass
class TurnResult:
    """One turn of one conversation; seconds since it was sent, token counts from the usage chunk."""

    conversation: int
    turn: int  # 0-based
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


async def run_conversation(client, base_url: str, model: str, load: ConversationLoad, conversation: int,
                           history: list[dict], turns: range, gate: asyncio.Semaphore) -> list[TurnResult]:
    """Send ``turns`` of one conversation, growing ``history`` (its messages) in place.
    Stops at the first failed turn (recorded with its error)."""
    results = []
    for turn in turns:
        history.append({"role": "user", "content": user_message(load, conversation, turn)})
        payload = {
            "model": model, "messages": list(history), "max_tokens": load.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": load.temperature,
        }
        if load.temperature > 0:
            payload["seed"] = load.seed * 1_000_003 + conversation * 1000 + turn
        record = TurnRecord()
        result = TurnResult(conversation, turn)
        results.append(result)
        try:
            async with gate:
                answer = await stream_chat_turn(client, f"{base_url}/v1/chat/completions", payload, record, None)
        except Exception as exc:  # noqa: BLE001 - a load test records failures and carries on
            result.error = f"{type(exc).__name__}: {exc}"[:300]
            return results
        result.ttft_s, result.e2e_s, result.output_tokens = record.ttft_s, record.e2e_s, record.output_tokens
        result.prompt_tokens, result.cached_tokens = record.prompt_tokens, record.cached_tokens
        history.append({"role": "assistant", "content": answer})
    return results


async def run_phase(base_url: str, model: str, load: ConversationLoad, histories: list[list[dict]],
                    turns: range, metrics_interval_s: float) -> dict:
    """Every conversation's ``turns``; counters read before and after, /metrics sampled between."""
    import httpx

    from pagedllm.bench.serve import MetricsSampler

    pool = load.max_concurrency + 4
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=60.0), limits=limits) as client:
        before = await read_counters(client, base_url)
        gate = asyncio.Semaphore(load.max_concurrency)
        sampler = MetricsSampler(client, f"{base_url}/metrics", metrics_interval_s)
        sampling = asyncio.create_task(sampler.run())
        start = time.perf_counter()
        per_conversation = await asyncio.gather(*(
            run_conversation(client, base_url, model, load, i, history, turns, gate)
            for i, history in enumerate(histories)
        ))
        duration = time.perf_counter() - start
        await sampler.stop(sampling)
        after = await read_counters(client, base_url)
    turn_results = [t for conversation in per_conversation for t in conversation]
    return {
        **summarize_turns(turn_results, duration),
        "prefix_cache": prefix_hits(before, after),
        "server_metrics": sampler.summary(),
        "loadavg_1m": loadavg_1m(),
    }


def _stats(values: list[float]) -> dict | None:
    """mean / p50 / p90 in ms."""
    if not values:
        return None
    return {
        "mean": 1000 * sum(values) / len(values),
        "p50": 1000 * report.percentile(values, 50),
        "p90": 1000 * report.percentile(values, 90),
    }


def summarize_turns(results: list[TurnResult], duration_s: float) -> dict:
    """TTFT of turn 1 and of turns >= 2, throughput, final conversation lengths and errors."""
    done = [t for t in results if t.error is None]
    first = [t for t in done if t.turn == 0]
    later = [t for t in done if t.turn > 0]
    output_tokens = sum(t.output_tokens for t in done)
    final: dict[int, int] = {}  # conversation -> tokens after its last completed turn
    for t in done:
        if t.prompt_tokens is not None:
            final[t.conversation] = max(final.get(t.conversation, 0), t.prompt_tokens + t.output_tokens)
    return {
        "num_conversations": len({t.conversation for t in results}),
        "turns_sent": len(results),
        "turns_completed": len(done),
        "errors": len(results) - len(done),
        "error_samples": sorted({t.error for t in results if t.error})[:5],
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else None,
        "prompt_tokens": sum(t.prompt_tokens or 0 for t in done),
        "conversation_tokens": sum(final.values()),
        "ttft_turn1_ms": _stats([t.ttft_s for t in first if t.ttft_s is not None]),
        "ttft_later_ms": _stats([t.ttft_s for t in later if t.ttft_s is not None]),
        # the server's own count per request (usage.prompt_tokens_details.cached_tokens)
        "cached_share_turn1": _cached_share(first),
        "cached_share_later": _cached_share(later),
        "turns": [asdict(t) for t in results],
    }


def _cached_share(turns: list[TurnResult]) -> float | None:
    counted = [t for t in turns if t.prompt_tokens and t.cached_tokens is not None]
    prompt = sum(t.prompt_tokens for t in counted)
    return sum(t.cached_tokens for t in counted) / prompt if prompt else None


# ---- arms -----------------------------------------------------------------------------


def load_from_args(args: argparse.Namespace) -> ConversationLoad:
    load = ConversationLoad(
        num_turns=args.turns, user_words=args.user_words,
        max_tokens=args.output_len if args.output_len is not None else 32,
        temperature=args.temperature, seed=args.seed, max_concurrency=args.max_concurrency or 8,
    )
    load.check()
    return load


def _num_conversations(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError as exc:
        raise ConfigError(f"--conversations must be 'auto' or an integer >= 1, got {text!r}") from exc
    if value < 1:
        raise ConfigError(f"--conversations must be >= 1, got {value}")
    return value


class Plan:
    """Sizes of the run: the number of conversations (fixed once the first server is up)
    and the max_model_len every server gets, from the model's tokenizer."""

    def __init__(self, args: argparse.Namespace, load: ConversationLoad, tokenizer) -> None:
        self.args, self.load, self.tokenizer = args, load, tokenizer
        self.num_conversations = _num_conversations(args.conversations)
        # the longest prompt is the restart arm's returning turn, one past the last
        self.num_prompts = load.num_turns + (1 if args.restart_arm else 0)
        self.max_model_len = args.max_model_len or self._default_max_model_len()

    def _default_max_model_len(self) -> int:
        sample = range(self.num_conversations or 64)
        longest = max(estimated_tokens(self.tokenizer, self.load, i, self.num_prompts) for i in sample)
        return -(-int(longest * _LENGTH_SLACK) // 256) * 256

    def fix_conversations(self, pool) -> int:
        """C, computed from ``pool`` (the first arm's) when --conversations is auto; checks that
        every conversation fits max_model_len."""
        if self.num_conversations is None:
            if pool is None:
                raise ConfigError("--conversations auto reads the device pool from /dashboard/feed, which this "
                                  "server does not serve; give --conversations N")
            tokens = _endless(self.tokenizer, self.load, self.load.num_turns)
            self.num_conversations = conversations_for_pool(tokens, pool.num_tokens, self.args.pool_multiple)
            print(f"{self.num_conversations} conversations: {self.args.pool_multiple}x the {pool.num_tokens}-token "
                  "device pool", file=sys.stderr, flush=True)
        longest = max(estimated_tokens(self.tokenizer, self.load, i, self.num_prompts)
                      for i in range(self.num_conversations))
        if longest > self.max_model_len:
            raise ConfigError(f"a conversation reaches about {longest} tokens, more than --max-model-len "
                              f"{self.max_model_len}; raise it")
        return self.num_conversations


def run_arms(args: argparse.Namespace) -> int:
    """Every arm's conversations in turn (and the restart arm's returning turn); exit status 1 on errors."""
    from pagedllm.bench.serve import server_settings
    from pagedllm.models.paths import resolve_model_path
    from pagedllm.tokenizer import Tokenizer

    load = load_from_args(args)
    arms = parse_arms(args.arm)
    roles = _target_arms(args)
    if args.restart_arm and args.restart_arm not in [a.name for a in arms]:
        raise ConfigError(f"--restart-arm {args.restart_arm!r} is not one of the arms ({', '.join(a.name for a in arms)})")
    if args.pool_multiple <= 0:
        raise ConfigError(f"--pool-multiple must be > 0, got {args.pool_multiple}")
    plan = Plan(args, load, Tokenizer.load(resolve_model_path(args.model)))
    settings = server_settings(args, plan.max_model_len)
    results, restart = [], None
    with tempfile.TemporaryDirectory(prefix="pagedllm-multiturn-", dir=args.kv_dir_root) as root:
        for arm in arms:
            kv_dir = fresh_dir(root, arm.name) if arm.uses_kv_dir else None
            result, histories = run_arm(args, arm, settings, plan, kv_dir)
            results.append(result)
            if arm.name == args.restart_arm:
                restart = run_restart(args, arm, settings, load, histories, kv_dir, root)
    env = report.environment()
    print(format_report(results, restart, load, plan.num_conversations, env, roles))
    if args.json:
        report.write_json(args.json, {
            "load": asdict(load), "num_conversations": plan.num_conversations, "settings": settings.to_json(),
            "env": env, "results": results, "restart": restart,
        })
    failed = any(r["errors"] for r in results) or (restart is not None and any(
        restart[k]["errors"] for k in ("restarted", "cold")))
    return 1 if failed else 0


def run_arm(args: argparse.Namespace, arm: ServerArm, settings, plan: Plan,
            kv_dir: str | None) -> tuple[dict, list[list[dict]]]:
    """One arm's server through all T turns of every conversation: (its result, the conversations)."""
    from pagedllm.bench.serve import warm_up

    load = plan.load
    with ArmServer(arm, settings, kv_dir, args) as server:
        num_conversations = plan.fix_conversations(server.pool)
        if args.warmup:
            run_async(warm_up(server.base_url, settings.served_model_name, settings.max_model_len))
        histories: list[list[dict]] = [[] for _ in range(num_conversations)]
        phase = run_async(run_phase(server.base_url, settings.served_model_name, load, histories,
                                      range(load.num_turns), args.metrics_interval))
        result = {**server.describe(), **phase}
        result["kv_vs_pool"] = ratio(phase["conversation_tokens"], server.pool.num_tokens if server.pool else None)
    print(format_arm_line(result), file=sys.stderr, flush=True)
    return result, histories


def run_restart(args: argparse.Namespace, arm: ServerArm, settings, load: ConversationLoad,
                histories: list[list[dict]], kv_dir: str | None, root: str) -> dict:
    """The returning turn on a restarted server (same ``{kv_dir}``), then on a cold one (empty dir)."""
    from pagedllm.bench.serve import warm_up

    returning = range(load.num_turns, load.num_turns + 1)
    phases = {}
    for label, directory in (("restarted", kv_dir), ("cold", fresh_dir(root, f"{arm.name}.cold") if kv_dir else None)):
        with ArmServer(arm, settings, directory, args, label=f"{arm.name}-{label}") as server:
            if args.warmup:
                run_async(warm_up(server.base_url, settings.served_model_name, settings.max_model_len))
            conversations = [list(h) for h in histories]  # both servers get the very same requests
            phases[label] = {**server.describe(), **run_async(run_phase(
                server.base_url, settings.served_model_name, load, conversations, returning, args.metrics_interval))}
        print(f"restart: {format_arm_line(phases[label])}", file=sys.stderr, flush=True)
    return {"arm": arm.name, "kv_dir_reused": kv_dir is not None, **phases}


def _target_arms(args: argparse.Namespace) -> tuple[str, str, str]:
    names = tuple(n.strip() for n in args.target_arms.split(","))
    if len(names) != 3 or not all(names):
        raise ConfigError(f"--target-arms takes OFF,ON,UNLIMITED (three arm names), got {args.target_arms!r}")
    return names


# ---- the report ---------------------------------------------------------------------


def target_ratios(results: list[dict], roles: tuple[str, str, str]) -> dict:
    """The issue's three ratios from the arms in the roles (off, on, unlimited); None where an arm is missing.

    hit_rate_vs_unlimited: on's hit rate / unlimited's (target >= 0.9);
    ttft_later_off_over_on: mean TTFT of turns >= 2, off / on (target >= 3);
    tok_s_on_over_off: output tok/s, on / off (target >= 1).
    """
    by_name = {r["arm"]: r for r in results}
    off, on, unlimited = (by_name.get(name) for name in roles)

    def hit_rate(r: dict | None) -> float | None:
        return (r["prefix_cache"] or {}).get("hit_rate") if r else None

    def ttft_later(r: dict | None) -> float | None:
        return (r["ttft_later_ms"] or {}).get("mean") if r else None

    return {
        "hit_rate_vs_unlimited": ratio(hit_rate(on), hit_rate(unlimited)),
        "ttft_later_off_over_on": ratio(ttft_later(off), ttft_later(on)),
        "tok_s_on_over_off": ratio(on["output_tokens_per_s"] if on else None, off["output_tokens_per_s"] if off else None),
    }


def restart_ratios(restart: dict) -> dict:
    """Returning-turn TTFT cold / restarted (target >= 3) and the restarted server's disk-tier hit rate."""
    restarted, cold = restart["restarted"], restart["cold"]
    hits = restarted["prefix_cache"] or {}
    return {
        "ttft_cold_over_restarted": ratio((cold["ttft_later_ms"] or {}).get("mean"),
                                          (restarted["ttft_later_ms"] or {}).get("mean")),
        "disk_hit_rate": (hits.get("tier_hit_rates") or {}).get("disk"),
        "hit_rate_restarted": hits.get("hit_rate"),
        "hit_rate_cold": (cold["prefix_cache"] or {}).get("hit_rate"),
    }


def _hit_cells(prefix: dict | None) -> list:
    if not prefix:
        return ["-", "-", "-"]
    tiers = " ".join(f"{t} {report.pct(r)}" for t, r in prefix["tier_hit_rates"].items()) or "-"
    return [report.pct(prefix["hit_rate"]), report.pct(prefix["device_hit_rate"]), tiers]


def _ttft_cells(stats: dict | None) -> list:
    return [stats.get(k) for k in ("mean", "p50", "p90")] if stats else [None] * 3


ARM_HEADERS = (
    "arm", "KV pool tokens", "conv. tokens", "x pool", "turns ok", "hit rate", "device", "tiers",
    "TTFT t1 mean", "p50", "p90", "TTFT t>=2 mean", "p50", "p90", "output tok/s", "peak running",
    "preemptions", "load 1m",
)


def arm_row(r: dict) -> list:
    metrics = r.get("server_metrics") or {}
    pool = r.get("kv_pool") or {}
    return [
        r["arm"], pool.get("num_tokens"), r["conversation_tokens"], r.get("kv_vs_pool"),
        f"{r['turns_completed']}/{r['turns_sent']}", *_hit_cells(r["prefix_cache"]),
        *_ttft_cells(r["ttft_turn1_ms"]), *_ttft_cells(r["ttft_later_ms"]), r["output_tokens_per_s"],
        _count(metrics.get("peak_running")), _count(metrics.get("preemptions")), r["loadavg_1m"],
    ]


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def format_arm_line(r: dict) -> str:
    later = r["ttft_later_ms"] or {}
    hit = (r["prefix_cache"] or {}).get("hit_rate")
    return (f"{r['label']}: {r['turns_completed']}/{r['turns_sent']} turns, hit rate {report.pct(hit)}, "
            f"TTFT turns>=2 mean {later.get('mean', float('nan')):.0f} ms, {r['output_tokens_per_s'] or 0:.1f} tok/s")


def format_report(results: list[dict], restart: dict | None, load: ConversationLoad, num_conversations: int,
                  env: dict, roles: tuple[str, str, str]) -> str:
    title = (f"Multi-turn chat: {num_conversations} conversations x {load.num_turns} turns, "
             f"{load.user_words} words per user message, {load.max_tokens} tokens per answer, "
             f"{load.max_concurrency} turns in flight (TTFT in ms)")
    lines = [report.format_table(ARM_HEADERS, [arm_row(r) for r in results], title=title)]
    lines += [f"  {r['arm']}: {' '.join(r['arm_flags']) or '(no extra flags)'}" for r in results]
    ratios = target_ratios(results, roles)
    off, on, unlimited = roles
    lines.append(
        f"targets: hit rate {on}/{unlimited} {_x(ratios['hit_rate_vs_unlimited'])} (>= 0.90); "
        f"mean TTFT turns>=2 {off}/{on} {_x(ratios['ttft_later_off_over_on'])} (>= 3); "
        f"output tok/s {on}/{off} {_x(ratios['tok_s_on_over_off'])} (>= 1)"
    )
    lines += reference_warnings(results, unlimited)
    if restart is not None:
        lines.append(format_restart(restart))
    lines.append(machine_line(env))
    lines += [f"  {r['arm']} error: {e}" for r in results for e in r["error_samples"]]
    return "\n".join(lines)


def reference_warnings(results: list[dict], unlimited: str) -> list[str]:
    """Lines saying when the reference arm was not unlimited: its pool held less than the
    conversations, or it preempted."""
    ref = next((r for r in results if r["arm"] == unlimited), None)
    if ref is None:
        return []
    warnings = []
    if ref.get("kv_vs_pool") is not None and ref["kv_vs_pool"] > 1:
        warnings.append(f"warning: arm {unlimited}'s pool holds less than the conversations "
                        f"({ref['kv_vs_pool']:.2f}x it); the hit-rate reference is not unlimited")
    preemptions = (ref.get("server_metrics") or {}).get("preemptions")
    if preemptions:
        warnings.append(f"warning: arm {unlimited} preempted {preemptions:.0f} times")
    return warnings


def format_restart(restart: dict) -> str:
    rows = [[label, *_hit_cells(restart[label]["prefix_cache"]), *_ttft_cells(restart[label]["ttft_later_ms"]),
             f"{restart[label]['turns_completed']}/{restart[label]['turns_sent']}"]
            for label in ("restarted", "cold")]
    table = report.format_table(
        ["server", "hit rate", "device", "tiers", "TTFT mean", "p50", "p90", "turns ok"], rows,
        title=f"Restart of arm {restart['arm']}: each conversation's returning turn "
              f"({'same' if restart['kv_dir_reused'] else 'no'} {{kv_dir}} after the restart)",
    )
    r = restart_ratios(restart)
    errors = "".join(f"\n  {label} error: {e}" for label in ("restarted", "cold")
                     for e in restart[label]["error_samples"])
    return (f"{table}\ntargets: returning-turn TTFT cold/restarted {_x(r['ttft_cold_over_restarted'])} (>= 3); "
            f"disk-tier hit rate {report.pct(r['disk_hit_rate'])}{errors}")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
