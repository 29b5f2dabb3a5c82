"""The llama.cpp peer of ``bench latency`` / ``bench throughput``.

Fast: a missing virtualenv is skipped with a line saying so, the continuous
batching loop that drives llama.cpp's C API keeps every sequence's positions
and slots straight. Slow, only where llama-cpp-python's virtualenv is named by
``PAGEDLLM_LLAMACPP_PYTHON``: the harness really runs it on the default GGUF.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pagedllm.bench import peers, throughput
from pagedllm.bench.workloads import random_workload
from pagedllm.cli import main
from pagedllm.errors import ConfigError

LLAMACPP_PYTHON = os.environ.get(peers.LLAMACPP_PYTHON_ENV)


def test_a_missing_llamacpp_virtualenv_is_skipped_with_a_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(peers.LLAMACPP_PYTHON_ENV, raising=False)
    assert peers.find_llamacpp_python(None) == (
        None, f"no llama.cpp virtualenv: pass --llamacpp-python PATH or set ${peers.LLAMACPP_PYTHON_ENV}")
    missing = str(tmp_path / "nowhere" / "python")
    assert not throughput.llamacpp_available(argparse.Namespace(llamacpp_python=missing))
    assert f"skipping llamacpp: llama.cpp's python {missing!r} does not exist" in capsys.readouterr().err
    monkeypatch.setenv(peers.LLAMACPP_PYTHON_ENV, missing)
    assert peers.find_llamacpp_python(None)[0] is None
    real = tmp_path / "python"
    real.write_text("")
    assert peers.find_llamacpp_python(str(real)) == (str(real), None)


def test_backend_llamacpp_without_its_virtualenv_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv(peers.LLAMACPP_PYTHON_ENV, raising=False)
    args = argparse.Namespace(backend="llamacpp", llamacpp_python=None, model=None)
    with pytest.raises(ConfigError, match="--llamacpp-python"):
        throughput.run_backend(args, random_workload(1, (4, 4), 2))


def test_the_peer_runs_gguf_files_only(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="GGUF files only"):
        peers.llamacpp_gguf(str(tmp_path))
    assert peers.llamacpp_gguf(None).suffix == ".gguf"  # the default model's file


class RecordingRunner:
    """Stands in for llama.cpp's context in the batching loop: checks what each decode
    call asks for and answers with a token derived from the input (no model)."""

    batch_tokens = 24

    def __init__(self) -> None:
        self.positions: dict[int, list[int]] = {}  # slot -> positions fed since it was last freed
        self.num_calls = 0

    def decode(self, entries):
        assert 0 < len(entries) <= self.batch_tokens
        self.num_calls += 1
        outputs = []
        for token, pos, slot, wants in entries:
            seen = self.positions.setdefault(slot, [])
            assert pos == len(seen), f"slot {slot}: position {pos} after {len(seen)} tokens"
            seen.append(pos)
            if wants:
                outputs.append((token * 7 + pos) % 1000)
        return outputs

    def free_slot(self, slot: int) -> None:
        assert slot in self.positions
        del self.positions[slot]


def test_the_batching_loop_keeps_positions_and_slots_straight():
    runner = RecordingRunner()
    prompts = [[1] * n for n in (5, 9, 3, 7, 11, 2)]
    made: list[int] = []
    num_new = peers._llamacpp_generate(runner, prompts, output_len=4, num_slots=3, on_token=made.append)
    assert num_new == 6 * 4 and sorted(made) == sorted(list(range(6)) * 4)
    assert runner.positions == {}  # every slot freed when its request finished
    # 3 slots: the first three prompts share step one, later prompts join as slots free up.
    assert runner.num_calls < 6 * 4


@pytest.mark.slow
@pytest.mark.skipif(not LLAMACPP_PYTHON, reason=f"set {peers.LLAMACPP_PYTHON_ENV} to llama-cpp-python's python")
def test_latency_and_throughput_run_llamacpp_on_the_same_gguf(tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--compare", "pagedllm,llamacpp", "--input-len", "16", "--output-len", "4",
                 "--runs", "2", "--num-kv-blocks", "32", "--no-warmup", "--json", str(out)]) == 0
    ours, peer = json.loads(out.read_text())["results"]
    assert (ours["backend"], peer["backend"]) == ("pagedllm", "llamacpp")
    assert peer["gguf"] == str(peers.llamacpp_gguf(None)) and peer["threads"] >= 1
    for run in peer["runs"]:
        assert len(run["inter_token_s"]) == 3 and run["e2e_s"] >= run["ttft_s"] > 0
    random_workload(5, (12, 40), 3, seed=4).save(tmp_path / "w5.json")
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--workload", str(tmp_path / "w5.json"), "--compare", "pagedllm,llamacpp",
                 "--llamacpp-slots", "2", "--num-kv-blocks", "64", "--no-warmup", "--json", str(out)]) == 0
    ours, peer = json.loads(out.read_text())["results"]
    assert peer["backend"] == "llamacpp" and peer["output_tokens"] == ours["output_tokens"] == 15
    assert peer["prompt_tokens"] == ours["prompt_tokens"] and peer["slots"] == 2
    assert "Q4_1" in peer["dtype"] and peer["llama_cpp_python"] == "0.3.36"
