"""The two production scenarios as benchmarks: many chat sessions against a real
server (`bench sessions`) and wide beam search over a long prompt (`bench beam`)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from server_fixture import REPO_ROOT, free_port

from pagedllm.bench import beam, sessions
from pagedllm.errors import ConfigError


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "bench", *argv],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
    )


# ---- bad input ------------------------------------------------------------------


def test_sessions_against_an_unreachable_server_exit_non_zero_with_one_line():
    done = _cli("sessions", "--base-url", f"http://127.0.0.1:{free_port()}", "--sessions", "2")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach an OpenAI-compatible server" in lines[0], done.stderr


def test_bad_session_load_is_a_config_error():
    with pytest.raises(ConfigError, match="--disconnect-share"):
        sessions.SessionLoad(disconnect_share=1.5).check()
    with pytest.raises(ConfigError, match="--sessions"):
        sessions.SessionLoad(num_sessions=0).check()


def test_beam_budget_counts_and_refusal_names_the_numbers():
    budget = beam.BeamBudget(block_size=16, prompt_len=4000, beam_width=8, max_tokens=32)
    assert (budget.prompt_blocks, budget.new_blocks, budget.shared_bound) == (250, 2, 274)
    assert budget.unshared_blocks == 8 * 252
    budget.check_fits(274)
    with pytest.raises(ConfigError) as info:
        budget.check_fits(273)
    message = str(info.value)
    assert "needs up to 274 KV blocks" in message and "250 for the prompt + 8 x (2 + 1)" in message
    assert "has 273" in message


def test_beam_that_cannot_fit_is_refused_before_the_model_loads():
    done = _cli("beam", "--prompt-len", "4000", "--max-tokens", "32", "--num-kv-blocks", "100")
    assert done.returncode == 2
    assert "needs up to 274 KV blocks" in done.stderr and "has 100" in done.stderr
    assert "Traceback" not in done.stderr


def test_beam_past_the_trained_context_gets_yarn_unless_told():
    args = _parse(beam, ["--prompt-len", "32768"])
    scaling = beam.default_rope_scaling(args, 32768 + 32)
    assert scaling == {"rope_type": "yarn", "factor": 5.0, "original_max_position_embeddings": 8192}
    assert beam.default_rope_scaling(args, 8192) is None
    given = _parse(beam, ["--rope-scaling", '{"rope_type": "linear", "factor": 4}'])
    assert beam.default_rope_scaling(given, 32768) == {"rope_type": "linear", "factor": 4}


# ---- the scenarios, small: sessions on the default model, beam on a small random one ----


@pytest.mark.slow
def test_sessions_against_a_real_server_leak_no_blocks():
    """32 two-turn sessions, a quarter leaving mid-answer, in a KV cache smaller than
    their final conversations (about 32 x 170 tokens in 256 x 16 slots = 4096)."""
    args = _parse(sessions, [
        "--sessions", "32", "--turns", "2", "--user-words", "24", "--max-tokens", "24",
        "--think-time", "0.2", "--disconnect-share", "0.25", "--num-kv-blocks", "256",
        "--max-num-seqs", "64", "--max-model-len", "1024",
    ])
    load = sessions.SessionLoad(32, 2, 24, 24, 0.2, 0.25)
    result = sessions.run_launched(args, load, "paged")
    outcome = result["sessions"]
    assert outcome["errored"] == 0 and outcome["refused"] == 0, result["errors"]
    assert outcome["disconnected"] > 0
    assert outcome["completed"] + outcome["disconnected"] == 32
    # every completed session finished both turns; a leaver may have finished its first
    assert 2 * outcome["completed"] <= result["turns_completed"] <= 2 * outcome["completed"] + outcome["disconnected"]
    assert result["idle_after_load"] and result["leaked_blocks"] == 0
    assert result["peak_running"] > 1 and result["ttft_ms"] is not None
    assert result["server_rss"]["peak_bytes"] > 0


@pytest.mark.slow
def test_beam_8_over_a_4k_prompt_shares_the_prompt_blocks(tiny_default_tokenizer_model):
    # The prompt is random token ids and the beams ignore EOS, so the block counts do not depend
    # on the weights: conftest's 2-layer random Llama (the default model's vocabulary and context).
    budget = beam.BeamBudget(block_size=16, prompt_len=4096, beam_width=8, max_tokens=4)
    args = _parse(beam, ["--model", str(tiny_default_tokenizer_model), "--prompt-len", "4096", "--max-tokens", "4",
                         "--kv-cache-memory", "1GiB", "--max-model-len", "4100"])
    from pagedllm.cli import engine_config_from_args

    result = beam.run_beam(engine_config_from_args(args), budget)
    bound = budget.prompt_blocks + 8 * (budget.new_blocks + 1)
    assert result["peak_used_blocks"] <= 1.1 * bound, result
    assert result["peak_used_blocks"] >= budget.prompt_blocks
    assert result["num_hypotheses"] == 8 and result["new_tokens_best"] == 4
    assert result["kv_empty_after"]


def test_beam_compare_rejects_unknown_backends_and_a_missing_peer():
    done = _cli("beam", "--prompt-len", "64", "--compare", "pagedllm,tgi")
    assert done.returncode == 2 and "choose from pagedllm, vllm" in done.stderr
    env_free = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "bench", "beam", "--prompt-len", "64", "--compare", "vllm"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PAGEDLLM_VLLM_PYTHON"},
    )
    assert env_free.returncode == 2 and "--peer-python" in env_free.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PAGEDLLM_VLLM_PYTHON"),
                    reason="set PAGEDLLM_VLLM_PYTHON to vLLM's python")
def test_beam_vllm_peer_runs_the_same_prompt_and_width(tmp_path):
    import json

    out = tmp_path / "beam.json"
    done = _cli("beam", "--beam-width", "2", "--prompt-len", "200", "--max-tokens", "3", "--kv-cache-memory", "64MiB",
                "--compare", "pagedllm,vllm", "--json", str(out), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    ours, peer = data["pagedllm"], data["vllm"]
    assert ours["num_hypotheses"] == peer["num_hypotheses"] == 2
    assert ours["new_tokens_best"] == peer["new_tokens_best"] == 3
    assert peer["num_steps"] == 3 and peer["wall_s"] >= peer["prefill_s"] > 0
    assert peer["peak_rss_bytes"] > 0
    assert "vLLM / pagedllm" in done.stdout


def test_sessions_server_command_forwards_the_kv_prefault_choice():
    for argv, expected in (([], None), (["--kv-cache-prefault"], "--kv-cache-prefault"),
                           (["--no-kv-cache-prefault"], "--no-kv-cache-prefault")):
        command = sessions.serve_command(_parse(sessions, argv), "paged", 8000)
        flags = [c for c in command if "prefault" in c]
        assert flags == ([] if expected is None else [expected])
