"""``pagedllm serve``: load the engine, serve the OpenAI API with uvicorn.

Shutdown on SIGTERM or SIGINT: stop accepting connections, let in-flight
requests finish for up to ``--drain-timeout`` seconds, abort the rest (their
KV blocks are freed), stop the engine thread and exit 0. A second SIGINT
skips the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading

import uvicorn

from pagedllm.engine.async_engine import DEFAULT_MAX_WAITING, AsyncLLMEngine

logger = logging.getLogger("pagedllm.server")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    from pagedllm.cli import add_engine_arguments

    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/*")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's name)")
    g.add_argument(
        "--max-waiting",
        type=_non_negative_int,
        default=DEFAULT_MAX_WAITING,
        help="requests that may queue beyond --max-num-seqs; more get HTTP 503",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run on after SIGTERM/SIGINT before they are aborted",
    )
    g.add_argument("--log-level", default="info", choices=list(LOG_LEVELS))
    g.add_argument(
        "--dashboard", action=argparse.BooleanOptionalAction, default=True,
        help="serve the live KV-cache map at /dashboard (same API-key rule as /v1)",
    )


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class _Server(uvicorn.Server):
    """uvicorn's server, but a signal means "shut down and exit 0", not "re-raise"."""

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        self._install_handlers()

    @contextlib.contextmanager
    def capture_signals(self):
        previous = self._install_handlers()
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _install_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            logger.info("received %s: draining in-flight requests", signal.Signals(sig).name)
            self.should_exit = True


def run(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config_from_args
    from pagedllm.server.app import build_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("pagedllm").setLevel(args.log_level.upper())
    config = engine_config_from_args(args)
    engine = AsyncLLMEngine.from_config(config, max_waiting=args.max_waiting)
    served_name = args.served_model_name or engine.model_name
    app = build_app(
        engine, served_model_name=served_name, api_key=args.api_key, max_waiting=args.max_waiting,
        dashboard=args.dashboard,
    )
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=max(0.0, args.drain_timeout),
        access_log=args.log_level == "debug",
    )
    server = _Server(uv_config)

    async def serve() -> None:
        logger.info("serving %s at http://%s:%d/v1 (OpenAI API)", served_name, _display_host(args.host), args.port)
        if args.dashboard:
            logger.info("KV-cache dashboard at http://%s:%d/dashboard", _display_host(args.host), args.port)
        try:
            await server.serve()
        finally:
            # uvicorn has drained or cancelled every request by now; abort leftovers, stop the thread.
            await engine.shutdown(drain_timeout=0.0)
        logger.info("stopped")

    asyncio.run(serve())
    return 0 if server.started else 1


def _display_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
