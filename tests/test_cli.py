"""The `pagedllm` command as users run it: a real subprocess on the default model."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pagedllm.cli import build_parser, engine_config_from_args, parse_size


def run_cli(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", *args],
        input=stdin, capture_output=True, text=True, timeout=timeout,
    )


def test_size_parsing():
    assert parse_size("1048576") == 2**20
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 500 * 10**6
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


def test_every_subcommand_is_registered():
    parser = build_parser()
    for command in ("generate", "chat", "serve", "bench"):
        with pytest.raises(SystemExit) as info:
            parser.parse_args([command, "--help"])
        assert info.value.code == 0


def test_engine_flags_reach_the_engine_config():
    args = build_parser().parse_args(["generate", "hi", "--num-headroom-tokens", "0", "--max-num-seqs", "8"])
    config = engine_config_from_args(args)
    assert config.num_headroom_tokens == 0 and config.max_num_seqs == 8
    default = engine_config_from_args(build_parser().parse_args(["generate", "hi"]))
    assert default.num_headroom_tokens == 16
    assert default.async_scheduling is None  # decided by the engine: on where CUDA graphs run
    for flag, value in (("--async-scheduling", True), ("--no-async-scheduling", False)):
        assert engine_config_from_args(build_parser().parse_args(["serve", flag])).async_scheduling is value


def test_bad_flags_fail_fast_with_a_clear_message():
    bad_block = run_cli("generate", "hi", "--block-size", "7")
    assert bad_block.returncode == 2 and "block-size" in bad_block.stderr
    bad_temp = run_cli("generate", "hi", "--temperature", "-1")
    assert bad_temp.returncode == 2 and "temperature" in bad_temp.stderr
    missing = run_cli("generate", "hi", "--model", "/nonexistent/model.gguf")
    assert missing.returncode == 2 and "nonexistent" in missing.stderr
    assert "Traceback" not in bad_temp.stderr + missing.stderr


def test_serve_on_a_port_in_use_fails_before_loading_the_model():
    """The address is bound first: a port another socket listens on is a clear error (exit 2)
    before the model loads, not an uvicorn bind error after it; an unknown host likewise."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        taken = run_cli("serve", "--port", str(port), "--kv-cache-memory", "64MiB", timeout=120)
    assert taken.returncode == 2, taken.stderr
    assert f"cannot serve on 127.0.0.1:{port}" in taken.stderr and "--port" in taken.stderr
    assert "engine ready" not in taken.stderr and "Traceback" not in taken.stderr
    unknown = run_cli("serve", "--host", "no-such-host.invalid", "--kv-cache-memory", "64MiB", timeout=120)
    assert unknown.returncode == 2 and "cannot serve on no-such-host.invalid" in unknown.stderr
    assert "engine ready" not in unknown.stderr


@pytest.mark.parametrize(("args", "words"), [
    (["serve", "--drain-timeout", "nan"], "--drain-timeout: must be a finite number >= 0, got nan"),
    (["bench", "throughput", "--num-prompts", "0"], "--num-prompts: must be >= 1, got 0"),
    (["bench", "throughput", "--output-len", "-2"], "--output-len: must be >= 1, got -2"),
])
def test_out_of_range_numbers_are_usage_errors(args, words):
    bad = run_cli(*args, timeout=120)
    assert bad.returncode == 2 and words in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize(("port", "words"), [("99999", "0-65535, got 99999"), ("-1", "0-65535, got -1"),
                                             ("http", "a port is a whole number, got 'http'")])
def test_a_port_out_of_range_is_a_usage_error(port, words):
    bad = run_cli("serve", "--port", port, timeout=120)
    assert bad.returncode == 2 and "--port" in bad.stderr and words in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_serve_on_port_zero_names_the_port_it_took(tiny_default_tokenizer_model):
    """``--port 0``: the OS picks a free port, the log line names it, and the server answers there."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "serve", str(tiny_default_tokenizer_model), "--port", "0",
         "--kv-cache-memory", "64MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        port = None
        deadline = time.monotonic() + 240
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"the server exited with {proc.wait()}"
            match = re.search(r"serving \S+ at http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(match.group(1)) if match else None
        assert port and port != 0
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10.0).json()
        assert models["data"][0]["id"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.stdout.close()
        code = proc.wait(60)
    assert code == 0


@pytest.mark.slow
def test_generate_prints_the_greedy_completion():
    result = run_cli("generate", "The capital of France is", "--max-tokens", "8", "--kv-cache-memory", "64MiB")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is")
    assert "Paris" in result.stdout


@pytest.mark.slow
def test_chat_streams_replies_and_keeps_the_conversation():
    result = run_cli("chat", "--temperature", "0", "--max-tokens", "24", "--kv-cache-memory", "64MiB",
                     stdin="What is the capital of France?\nAnd of Italy?\n")
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(replies) >= 2
    assert "Paris" in result.stdout and "Rome" in result.stdout
