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
import errno
import json
import logging
import signal
import socket
import threading
from pathlib import Path

import uvicorn

from pagedllm.cli import bounded
from pagedllm.engine.async_engine import DEFAULT_MAX_WAITING, AsyncLLMEngine
from pagedllm.errors import ConfigError
from pagedllm.limits import RequestLimits, ServerLimits

logger = logging.getLogger("pagedllm.server")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_positive_int = bounded(int, 0, above=True)
_positive_float = bounded(float, 0, above=True)
_non_negative_int = bounded(int, 0)
_seconds = bounded(float, 0)
_port = bounded(int, 0, 65535, subject="a port is")


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    from pagedllm.cli import add_engine_arguments

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF directory or .gguf file, as `vllm serve MODEL` (same as --model)")
    add_engine_arguments(parser)
    # A server keeps its KV pool for its whole life: resident from the start, the process's size
    # is what the operator plans for, and it stays flat under load.
    parser.set_defaults(kv_cache_prefault=True)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port (0: one the OS picks)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/*")
    g.add_argument("--middleware", action="append", default=[], metavar="IMPORT.PATH",
                   help="ASGI middleware to add, as vLLM's: a class (app.add_middleware) or an async function "
                   "(an HTTP middleware, @app.middleware('http')) named by its import path; repeatable")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's name)")
    g.add_argument(
        "--max-waiting",
        type=_non_negative_int,
        default=DEFAULT_MAX_WAITING,
        help="requests that may queue beyond --max-num-seqs; more get HTTP 503",
    )
    g.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=30.0,
        help="seconds in-flight requests may run on after SIGTERM/SIGINT before they are aborted",
    )
    g.add_argument("--log-level", default="info", choices=list(LOG_LEVELS))
    g.add_argument(
        "--dashboard", action=argparse.BooleanOptionalAction, default=True,
        help="serve the live KV-cache map at /dashboard (same API-key rule as /v1)",
    )
    _add_vllm_server_arguments(parser.add_argument_group("server (vLLM's flags)"))
    _add_limit_arguments(parser)


def _add_vllm_server_arguments(g) -> None:
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, or the template itself; replaces the model's")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:<id>' instead of its text (a request may ask too)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (refused otherwise: a template is code the "
                        "server runs; for trusted clients)")
    g.add_argument("--chat-template-content-format", choices=["auto", "string"], default="auto",
                   help="how message content reaches the template: text parts joined into one string (auto and "
                        "string alike; vLLM's 'openai' part lists are not available)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id (the request's own, or a new one)")
    g.add_argument("--response-role", default="assistant",
                   help="the role chat responses carry (default: assistant)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per request (there is none unless --log-level debug)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted as vLLM's: usage always carries prompt_tokens_details (cached tokens)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM's: tool calls are always parsed when tool_choice is auto")
    g.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                   help="the tool-call format: pagedllm parses Hermes' <tool_call>{...}</tool_call> only")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates")
    g.add_argument("--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=0,
                   help="client certificates, as Python's ssl module numbers it: 0 not asked for, 1 optional, "
                        "2 required (1 and 2 verify them against --ssl-ca-certs)")
    g.add_argument("--allowed-origins", type=_string_list, default=None,
                   help='turn CORS on for these origins: a JSON list (\'["https://a.example"]\') or comma-separated')
    g.add_argument("--allowed-methods", type=_string_list, default=None, help="CORS methods (default: all)")
    g.add_argument("--allowed-headers", type=_string_list, default=None, help="CORS headers (default: all)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--root-path", default=None, help="the path prefix a proxy serves this app under")
    g.add_argument("--uvicorn-log-level", default=None, choices=[*LOG_LEVELS, "trace"],
                   help="uvicorn's own log level (default: --log-level)")


def _string_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form) or comma-separated strings."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            value = json.loads(stripped)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{text!r} must be a JSON list of strings")
        return value
    return [part.strip() for part in stripped.split(",") if part.strip()]


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of RequestLimits and ServerLimits, defaulting to the dataclass's value."""
    r, s = RequestLimits(), ServerLimits()
    g = parser.add_argument_group("limits (per request / per client; past them: HTTP 400, 413 or 503)")
    g.add_argument("--max-n", type=_positive_int, default=r.max_n, help="most samples per prompt (n, best_of)")
    g.add_argument("--max-beam-width", type=_positive_int, default=r.max_beam_width, help="most beams of a beam search")
    g.add_argument("--max-stop", type=_positive_int, default=r.max_stop, help="most stop strings per request")
    g.add_argument("--max-stop-chars", type=_positive_int, default=r.max_stop_chars, help="longest stop string")
    g.add_argument("--max-stop-token-ids", type=_positive_int, default=r.max_stop_token_ids)
    g.add_argument("--max-logit-bias", type=_positive_int, default=r.max_logit_bias, help="most logit_bias entries")
    g.add_argument("--max-logprobs", type=_positive_int, default=r.max_logprobs, help="most top logprobs per token")
    g.add_argument("--max-body-bytes", type=_size, default=s.max_body_bytes,
                   help="largest request body, e.g. 4MiB (HTTP 413 past it)")
    g.add_argument("--max-prompts", type=_positive_int, default=s.max_prompts, help="most prompts per completion request")
    g.add_argument("--max-json-depth", type=_positive_int, default=s.max_json_depth, help="deepest nesting in a body")
    g.add_argument("--max-connections", type=_positive_int, default=s.max_connections,
                   help="most open HTTP connections; new ones past it get HTTP 503")
    g.add_argument("--stream-stall-timeout", type=_positive_float, default=s.stream_stall_timeout_s,
                   help="seconds a streaming client may take no data before its request is aborted")
    g.add_argument("--request-timeout", type=_positive_float, default=s.request_timeout_s,
                   help="seconds a request may run before it is aborted (default: no limit)")
    g.add_argument("--keep-alive-timeout", type=_positive_float, default=s.keep_alive_timeout_s,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--body-read-timeout", type=_positive_float, default=s.body_read_timeout_s,
                   help="seconds a client may take to send its request body")
    g.add_argument("--grammar-compile-timeout", type=_positive_float, default=s.grammar_compile_timeout_s,
                   help="seconds compiling one new grammar (JSON schema, regex, EBNF) may take")
    g.add_argument("--grammar-compile-memory", type=_size, default=s.grammar_compile_memory_bytes,
                   help="memory compiling one new grammar may take, e.g. 2GiB")


def limits_from_args(args: argparse.Namespace) -> tuple[RequestLimits, ServerLimits]:
    request = RequestLimits(
        max_n=args.max_n, max_beam_width=args.max_beam_width, max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars, max_stop_token_ids=args.max_stop_token_ids,
        max_logit_bias=args.max_logit_bias, max_logprobs=args.max_logprobs,
    )
    server = ServerLimits(
        max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts, max_json_depth=args.max_json_depth,
        max_connections=args.max_connections, stream_stall_timeout_s=args.stream_stall_timeout,
        request_timeout_s=args.request_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
        body_read_timeout_s=args.body_read_timeout, grammar_compile_timeout_s=args.grammar_compile_timeout,
        grammar_compile_memory_bytes=args.grammar_compile_memory,
    )
    return request, server


def _size(text: str) -> int:
    from pagedllm.cli import parse_size

    value = parse_size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text}")
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

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # uvicorn announces the address only for sockets it bound itself; the socket here was
        # bound before the model loaded, so say it the usual way ("Uvicorn running on ...").
        announce = getattr(self, "_log_started_message", None)
        if sockets and self.started and announce is not None:
            announce(sockets)

    async def shutdown(self, sockets=None) -> None:
        reaper = asyncio.create_task(self._abort_closed_tls_connections())
        try:
            await super().shutdown(sockets)
        finally:
            reaper.cancel()

    async def _abort_closed_tls_connections(self) -> None:
        """Drop TLS connections that uvicorn has closed but asyncio still holds open.

        Closing a TLS transport waits for the client's close_notify, up to 30 s
        (asyncio's SSL shutdown timeout), and an idle keep-alive client never
        sends one: one such client kept a stopping HTTPS server alive for 30 s.
        Once uvicorn has closed a connection (idle, or its last response sent)
        nothing more is owed on it, so its transport is aborted instead."""
        while True:
            await asyncio.sleep(0.1)
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if (transport is not None and transport.is_closing()
                        and transport.get_extra_info("sslcontext") is not None):
                    transport.abort()

    def _on_signal(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            logger.info("received %s: draining in-flight requests", signal.Signals(sig).name)
            self.should_exit = True


def run(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config_from_args

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("pagedllm").setLevel(args.log_level.upper())
    args.model = _model_argument(args)
    tls = _tls_files(args)
    chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    args.middleware = [import_middleware(path) for path in args.middleware]  # before the model loads
    config = engine_config_from_args(args)
    request_limits, server_limits = limits_from_args(args)
    # The address is taken before the model loads: a port in use is an error in a second, not
    # after the load, and no other process can take it meanwhile.
    listener = listen_socket(args.host, args.port)
    try:
        return _serve(args, config, tls, chat_template, request_limits, server_limits, listener)
    finally:
        listener.close()


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: one the OS picks), for uvicorn to listen on
    (IPv6 where the host has a colon, as uvicorn binds). A host or port that cannot be bound is a
    ConfigError that says which and why."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:  # socket.gaierror (an unknown host name) included
        sock.close()
        hint = ("stop what holds it or pick another --port" if getattr(exc, "errno", None) == errno.EADDRINUSE
                else "check --host and --port")
        raise ConfigError(f"cannot serve on {_display_host(host)}:{port}: {exc.strerror or exc}; {hint}") from None
    return sock


def _serve(args, config, tls, chat_template, request_limits, server_limits, listener: socket.socket) -> int:
    from pagedllm.server.app import build_app

    port = listener.getsockname()[1]
    engine = AsyncLLMEngine.from_config(config, max_waiting=args.max_waiting, limits=request_limits)
    served_name = args.served_model_name or engine.model_name
    app = build_app(
        engine,
        served_model_name=served_name,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        chat_template=chat_template,
        default_sampling=_default_sampling(engine, config),
        cors=_cors_settings(args),
        limits=server_limits,
        dashboard=args.dashboard,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        response_role=args.response_role,
        docs=not args.disable_fastapi_docs,
        trust_request_chat_template=args.trust_request_chat_template,
        request_id_headers=args.enable_request_id_headers,
    )
    for middleware in args.middleware:
        add_middleware(app, middleware)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=port,
        log_level=args.uvicorn_log_level or args.log_level,
        timeout_graceful_shutdown=max(0.0, args.drain_timeout),
        access_log=args.log_level == "debug" and not args.disable_uvicorn_access_log,
        root_path=args.root_path or "",
        **tls,
        # Past this many open connections (idle keep-alive ones included) uvicorn answers 503.
        limit_concurrency=server_limits.max_connections,
        timeout_keep_alive=server_limits.keep_alive_timeout_s,
    )
    server = _Server(uv_config)
    scheme = "https" if tls else "http"

    async def serve() -> None:
        logger.info("serving %s at %s://%s:%d%s/v1 (OpenAI API)", served_name, scheme,
                    _display_host(args.host), port, args.root_path or "")
        if args.dashboard:
            logger.info("KV-cache dashboard at %s://%s:%d%s/dashboard", scheme, _display_host(args.host),
                        port, args.root_path or "")
        try:
            await server.serve(sockets=[listener])
        finally:
            # uvicorn has drained or cancelled every request by now; abort leftovers, stop the thread.
            await engine.shutdown(drain_timeout=0.0)
        logger.info("stopped")

    asyncio.run(serve())
    return 0 if server.started else 1


def _model_argument(args: argparse.Namespace) -> str | None:
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ConfigError(f"the model is given twice ({args.model_tag!r} and --model {args.model!r}); give one")
    return args.model_tag if args.model_tag is not None else args.model


def _tls_files(args: argparse.Namespace) -> dict:
    """uvicorn's ssl_* settings; HTTPS needs both the key and the certificate."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.ssl_keyfile is None:
        for flag, value in (("--ssl-ca-certs", args.ssl_ca_certs), ("--ssl-cert-reqs", args.ssl_cert_reqs or None)):
            if value is not None:
                raise ConfigError(f"{flag} needs --ssl-keyfile and --ssl-certfile")
        return {}
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        raise ConfigError(f"--ssl-cert-reqs {args.ssl_cert_reqs} needs --ssl-ca-certs (the CAs that sign client "
                          "certificates)")
    files = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile}
    if args.ssl_ca_certs is not None:
        files["ssl_ca_certs"] = args.ssl_ca_certs
    for flag, path in files.items():
        if not Path(path).is_file():
            raise ConfigError(f"--{flag.replace('_', '-')} {path}: no such file")
    return {**files, "ssl_cert_reqs": args.ssl_cert_reqs} if args.ssl_cert_reqs else files


def _cors_settings(args: argparse.Namespace):
    from pagedllm.server.app import CorsSettings

    if args.allowed_origins is None:
        if args.allowed_methods or args.allowed_headers or args.allow_credentials:
            raise ConfigError("CORS is off until --allowed-origins names the origins to allow")
        return None
    default = CorsSettings()
    return CorsSettings(
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods or default.allowed_methods),
        allowed_headers=tuple(args.allowed_headers or default.allowed_headers),
        allow_credentials=args.allow_credentials,
    )


def _default_sampling(engine: AsyncLLMEngine, config) -> dict:
    from pagedllm.generation_config import default_sampling_fields

    defaults = default_sampling_fields(engine.engine.model_path, config.generation_config,
                                       config.override_generation_config)
    if defaults:
        logger.info("default sampling parameters from the generation config: %s", defaults)
    return defaults


def import_middleware(path: str):
    """``--middleware``'s ``package.module.name``: the class or async function it names; ConfigError
    when it cannot be imported or is neither."""
    import importlib
    import inspect

    module_name, _, attribute = path.rpartition(".")
    if not module_name:
        raise ConfigError(f"--middleware {path!r}: give an import path, module.name")
    try:
        value = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--middleware {path!r}: cannot import it: {exc}") from None
    if not (inspect.isclass(value) or inspect.iscoroutinefunction(value)):
        raise ConfigError(f"--middleware {path!r} is a {type(value).__name__}; it must be an ASGI middleware class "
                          "or an async function (request, call_next)")
    return value


def add_middleware(app, middleware) -> None:
    """Adds what :func:`import_middleware` returned, as vLLM does: a class with ``app.add_middleware``, a
    function as an HTTP middleware."""
    import inspect

    if inspect.isclass(middleware):
        app.add_middleware(middleware)
    else:
        app.middleware("http")(middleware)


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's contents, or the value itself when it is Jinja text."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _display_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
