"""Server arms: the same load against ``pagedllm serve`` started once per named set of flags.

An arm is written ``NAME=FLAGS``, e.g. ``--arm 'int8=--kv-cache-dtype int8'``. Every
arm's server gets the flags the arms share (a :class:`serve.ServerSettings`) and then
its own FLAGS, so a flag given in both takes the arm's value (argparse keeps the last).
``{kv_dir}`` inside FLAGS becomes a fresh, empty directory of this arm (under
``--kv-dir-root``), removed when the benchmark ends; a restart of the arm reuses it.

Arms run one after another in the order given, each server stopped before the next
starts, so they never share the machine. Figures of one invocation compare; the
first arm is the one the ratios divide by.

What a server is sized to comes from the server itself: the ``hello`` event of its
``/dashboard/feed`` carries the resolved KV pool (blocks, block size). Counters come
from its Prometheus ``/metrics`` (read before and after the load, so warm-up requests
do not count).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from pagedllm.bench import report
from pagedllm.bench.stopping import run_async
from pagedllm.errors import ConfigError

KV_DIR = "{kv_dir}"


@dataclass(frozen=True)
class ServerArm:
    """One arm: its name and the ``pagedllm serve`` flags it adds (``{kv_dir}`` unresolved)."""

    name: str
    flags: tuple[str, ...]

    @property
    def uses_kv_dir(self) -> bool:
        return any(KV_DIR in flag for flag in self.flags)

    def resolved_flags(self, kv_dir: str | None) -> list[str]:
        """The flags with ``{kv_dir}`` replaced; ``kv_dir`` is needed only when they name it."""
        if self.uses_kv_dir and kv_dir is None:
            raise ValueError(f"arm {self.name!r} needs a kv_dir")
        return [flag.replace(KV_DIR, kv_dir) if kv_dir is not None else flag for flag in self.flags]


def parse_arm(text: str) -> ServerArm:
    """``NAME=FLAGS`` -> ServerArm; FLAGS are split as a shell would (quotes kept together)."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(
            f"--arm {text!r}: write NAME=FLAGS, NAME of letters, digits, '-' or '_' "
            "(e.g. --arm 'int8=--kv-cache-dtype int8'; FLAGS may be empty: --arm 'base=')"
        )
    try:
        parts = tuple(shlex.split(flags))
    except ValueError as exc:
        raise ConfigError(f"--arm {text!r}: its flags do not parse ({exc})") from exc
    for flag in parts:
        if flag in ("--host", "--port", "--served-model-name"):
            raise ConfigError(f"--arm {text!r}: {flag} is set by the benchmark, not by an arm")
    return ServerArm(name, parts)


def parse_arms(texts: list[str]) -> list[ServerArm]:
    arms = [parse_arm(t) for t in texts]
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ConfigError(f"--arm names must differ, got {', '.join(names)}")
    return arms


@dataclass(frozen=True)
class KVPool:
    """A server's device KV pool as it resolved it: ``num_blocks`` blocks of ``block_size`` tokens."""

    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def to_json(self) -> dict:
        return {"num_blocks": self.num_blocks, "block_size": self.block_size, "num_tokens": self.num_tokens}


async def read_kv_pool(client, base_url: str) -> KVPool | None:
    """The pool from the ``hello`` event of ``/dashboard/feed``; None when the server has no dashboard."""
    from pagedllm.bench.serve import sse_chunks

    try:
        async with client.stream("GET", f"{base_url}/dashboard/feed") as response:
            if response.status_code != 200:
                return None
            async for event in sse_chunks(response):
                settings = event.get("settings") or {}
                return KVPool(int(settings["num_kv_blocks"]), int(settings["block_size"]))
    except (KeyError, TypeError, ValueError):
        return None
    return None


def parse_counters(text: str) -> dict[str, float]:
    """The counters and gauges of a Prometheus text page by short name: the server's prefix and
    ``_total`` dropped, a ``tier`` label appended as ``name:tier``; samples summed over other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.rsplit(":", 1)[-1]
            if name.endswith(("_bucket", "_created", "_sum", "_count")):
                continue
            name = name.removesuffix("_total")
            if "tier" in sample.labels:
                name = f"{name}:{sample.labels['tier']}"
            values[name] = values.get(name, 0.0) + sample.value
    return values


async def read_counters(client, base_url: str) -> dict[str, float]:
    """:func:`parse_counters` of the server's ``/metrics``; empty when it has none."""
    try:
        response = await client.get(f"{base_url}/metrics")
        return parse_counters(response.text) if response.status_code == 200 else {}
    except Exception:  # noqa: BLE001 - a server without usable metrics reports no hit rates
        return {}


def tier_names(counters: dict[str, float]) -> list[str]:
    """The tiers named by ``kv_tier_hits:TIER`` counters, sorted."""
    return sorted(key.split(":", 1)[1] for key in counters if key.startswith("kv_tier_hits:"))


def prefix_hits(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """Prefix-cache figures of the load between two counter readings, in prompt tokens.

    ``prefix_cache_hits`` counts tokens found in the device pool and ``kv_tier_hits:TIER``
    those brought back from a slower tier, so a token is a hit of exactly one of them;
    ``hit_rate`` is their sum over the tokens looked up. None when the server does not
    count queries (no such metric, or prefix caching off).
    """

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta("prefix_cache_queries")
    if "prefix_cache_queries" not in after or queries <= 0:
        return None
    device = delta("prefix_cache_hits")
    tiers = {tier: delta(f"kv_tier_hits:{tier}") for tier in tier_names(after)}
    return {
        "queries": queries,
        "device_hits": device,
        "tier_hits": tiers,
        "hit_rate": (device + sum(tiers.values())) / queries,
        "device_hit_rate": device / queries,
        "tier_hit_rates": {tier: hits / queries for tier, hits in tiers.items()},
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


# ---- one arm's server -------------------------------------------------------------


class ArmServer:
    """``pagedllm serve`` for one arm on a free port, ready to take load inside the ``with`` block.

    ``base_url`` and ``command`` are set from construction (a port free then) and move to
    another port if that one is taken before the server binds it
    (:func:`pagedllm.bench.serve.start_server`); ``startup_s`` (process start until
    ``/v1/models`` answers) and ``pool`` (None without a dashboard) are set on entering.
    """

    def __init__(self, arm: ServerArm, settings, kv_dir: str | None, args: argparse.Namespace,
                 label: str | None = None) -> None:
        from pagedllm.bench.serve import free_port

        self.arm = arm
        self.label = label or arm.name
        self.kv_dir = kv_dir
        self.settings = settings
        self.args = args
        self.startup_s: float | None = None
        self.pool: KVPool | None = None
        self._process = None
        self._host = "127.0.0.1"
        self._set_port(free_port(self._host))

    def _set_port(self, port: int) -> None:
        """Serve on ``port``: the base URL and the command that serves there."""
        from pagedllm.bench.serve import ServerLaunch, pagedllm_server_command

        self._port = port
        self.base_url = f"http://{self._host}:{port}"
        self.command = pagedllm_server_command(self.settings, self._host, port) + self.arm.resolved_flags(self.kv_dir)
        package_root = str(Path(__file__).resolve().parents[2])  # ``-m pagedllm.cli`` runs this copy
        self.launch = ServerLaunch(self.command, dict(os.environ), package_root)

    def __enter__(self) -> ArmServer:
        from pagedllm.bench.serve import start_server

        log_dir = self.args.server_log_dir
        log_path = Path(log_dir) / f"pagedllm-{self.label}.log" if log_dir else None

        def launch_on(port: int):
            self._set_port(port)
            print(f"starting arm {self.label}: {shlex.join(self.command)}", file=sys.stderr, flush=True)
            return self.launch

        self._process, self.base_url, self.startup_s = start_server(
            f"pagedllm serve (arm {self.label})", launch_on, self.settings.served_model_name,
            self.args.startup_timeout, log_path, self._host, port=self._port,
        )
        try:
            self.pool = run_async(self._read_pool())
        except BaseException:
            self._process.stop()
            raise
        print(f"arm {self.label} answered after {self.startup_s:.1f} s; KV pool {self.pool}",
              file=sys.stderr, flush=True)
        return self

    async def _read_pool(self) -> KVPool | None:
        import httpx

        async with httpx.AsyncClient(timeout=30.0) as client:
            return await read_kv_pool(client, self.base_url)

    def __exit__(self, *exc_info) -> None:
        self._process.stop()

    def describe(self) -> dict:
        return {
            "arm": self.arm.name,
            "label": self.label,
            "arm_flags": list(self.arm.flags),
            "server_command": shlex.join(self.command),
            "startup_s": self.startup_s,
            "kv_pool": self.pool.to_json() if self.pool else None,
        }


def loadavg_1m() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_line(env: dict) -> str:
    """One line naming the machine class and load of a run."""
    isa = env.get("native_isa") or "-"
    flags = [f for f in env.get("cpu_isa_flags", []) if f.startswith(("avx512", "amx", "avx2"))]
    return (
        f"machine: {env.get('cpu_model') or env.get('machine')}, native ISA {isa} "
        f"({' '.join(flags) or 'no AVX2/AVX-512/AMX flags'}), {env.get('cpus_allowed')} CPUs, "
        f"load average (1 min) {_round(env.get('loadavg_1m'))}"
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# ---- single-turn load per arm (``bench serve --arm ...``) ----------------------------


def run_serve_arms(args: argparse.Namespace, workload) -> int:
    """The serve load against one started server per arm; ratios to the first arm."""
    import tempfile

    from pagedllm.bench.serve import run_load, settings_from_args, warm_up

    arms = parse_arms(args.arm)
    settings = settings_from_args(args, workload)
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-arms-", dir=args.kv_dir_root) as root:
        for arm in arms:
            kv_dir = fresh_dir(root, arm.name) if arm.uses_kv_dir else None
            with ArmServer(arm, settings, kv_dir, args) as server:
                if args.warmup:
                    run_async(warm_up(server.base_url, settings.served_model_name, settings.max_model_len))
                result = run_async(run_load(
                    server.base_url, settings.served_model_name, workload, args.request_rate, args.max_concurrency,
                    seed=args.seed, timeout_s=args.timeout, metrics_interval_s=args.metrics_interval,
                ))
                results.append({**server.describe(), **result, "loadavg_1m": loadavg_1m()})
            print(f"arm {arm.name}: {result['completed']}/{result['num_requests']} ok, "
                  f"{result['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr, flush=True)
    env = report.environment()
    print(format_serve_arms(results, workload.describe(), env))
    if args.json:
        report.write_json(args.json, {
            "workload": workload.describe(), "settings": settings.to_json(), "env": env, "results": results,
        })
    return 0 if all(r["errors"] == 0 for r in results) else 1


def fresh_dir(root: str, name: str) -> str:
    """A new empty directory ``root/name``."""
    path = Path(root) / name
    path.mkdir()
    return str(path)


def serve_arm_rows(results: list[dict]) -> list[list]:
    """One row per arm: pool, completions, throughput, peak running, and ratios to the first arm."""
    base = results[0]

    def peak(r: dict, key: str) -> int | None:
        value = (r.get("server_metrics") or {}).get(key)
        return None if value is None else round(value)

    def running(r: dict) -> int | None:
        """The sampled peak, or the server's exact one where it has it: each arm's server is
        started for it, so its peak since start is this run's."""
        seen = [v for v in (peak(r, "peak_running"), peak(r, "peak_running_since_start")) if v is not None]
        return max(seen) if seen else None

    rows = []
    for r in results:
        pool = r.get("kv_pool") or {}
        ttft = r.get("ttft_ms") or {}
        rows.append([
            r["arm"], pool.get("num_blocks"), pool.get("num_tokens"), f"{r['completed']}/{r['num_requests']}",
            r["output_tokens_per_s"], ttft.get("mean"), running(r), peak(r, "peak_waiting"),
            peak(r, "preemptions"), ratio(pool.get("num_tokens"), (base.get("kv_pool") or {}).get("num_tokens")),
            ratio(running(r), running(base)),
            ratio(r["output_tokens_per_s"], base["output_tokens_per_s"]), r.get("loadavg_1m"),
        ])
    return rows


SERVE_ARM_HEADERS = (
    "arm", "KV blocks", "KV tokens", "ok", "output tok/s", "TTFT mean ms", "peak running", "peak waiting",
    "preemptions", "tokens x first", "peak running x first", "tok/s x first", "load 1m",
)


def format_serve_arms(results: list[dict], workload: str, env: dict) -> str:
    table = report.format_table(SERVE_ARM_HEADERS, serve_arm_rows(results), title=f"Serving per arm: {workload}")
    flags = "\n".join(f"  {r['arm']}: {' '.join(r['arm_flags']) or '(no extra flags)'}" for r in results)
    errors = "".join(f"\n  {r['arm']} error: {e}" for r in results for e in r["error_samples"])
    return f"{table}\narm flags:\n{flags}\n{machine_line(env)}{errors}"
