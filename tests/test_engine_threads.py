"""The engine's default thread count leaves out cores another process keeps busy
(pagedllm.native.threads.engine_threads), measured against a real spinning process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pagedllm.native import threads

CPUS = threads.allowed_cpu_list()
needs_two_cores = pytest.mark.skipif(len(CPUS) < 2 or not os.path.exists("/proc/stat"),
                                     reason="needs 2 or more cores and /proc/stat")
SPIN = "import time\nt = time.time()\nwhile time.time() - t < 60: pass\n"


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-threads"))


@pytest.fixture
def thread_state():
    """torch's thread count, restored after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def spinner():
    """A process spinning on the last allowed CPU for the test's length."""
    cpu = CPUS[-1]
    proc = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\n" + SPIN])
    time.sleep(0.3)  # started and spinning
    yield cpu
    proc.kill()
    proc.wait()


def test_busy_share_of_two_proc_stat_samples():
    # user nice system idle iowait irq softirq steal (guest guest_nice are inside user)
    before = [100, 0, 50, 1000, 10, 0, 0, 0, 0, 0]
    assert threads.busy_share(before, [100, 0, 50, 1100, 10, 0, 0, 0, 0, 0]) == 0.0
    assert threads.busy_share(before, [180, 0, 70, 1100, 10, 0, 0, 0, 0, 0]) == pytest.approx(0.5)
    assert threads.busy_share(before, [150, 0, 50, 1100, 40, 0, 0, 10, 0, 0]) == pytest.approx(60 / 190)
    assert threads.busy_share(before, before) == 0.0  # no time passed


def test_engine_threads_leaves_out_the_busy_cores_it_is_told_of():
    if not CPUS:
        pytest.skip("no affinity mask here")
    assert threads.engine_threads({cpu: 0.0 for cpu in CPUS}) == len(CPUS)
    assert threads.engine_threads({CPUS[0]: 0.9}) == max(1, len(CPUS) - 1)
    assert threads.engine_threads({cpu: 1.0 for cpu in CPUS}) == 1  # never fewer than one
    assert threads.engine_threads({CPUS[0]: threads.BUSY_ABOVE}) == len(CPUS)  # half busy is still ours


@needs_two_cores
def test_a_core_a_spinning_process_holds_is_seen_busy(spinner):
    shares = threads.cpu_busy_shares(CPUS, window_s=0.3)
    assert shares[spinner] > 0.8
    assert 1 <= threads.engine_threads() <= len(CPUS) - 1


@needs_two_cores
def test_an_engine_beside_a_busy_core_runs_fewer_threads_unless_told(tiny_llama_dir, spinner, thread_state):
    from pagedllm import LLM, SamplingParams

    torch.set_num_threads(threads.allowed_cpus())
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128)
    assert 1 <= torch.get_num_threads() <= len(CPUS) - 1
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128,
        num_threads=len(CPUS))
    assert torch.get_num_threads() == len(CPUS)  # the user's count, busy core or not


def test_a_count_the_user_set_with_torch_is_left_alone(thread_state):
    if threads.allowed_cpus() < 2:
        pytest.skip("needs 2 or more cores")
    torch.set_num_threads(threads.allowed_cpus() - 1 if threads.allowed_cpus() > 2 else 1)
    user = torch.get_num_threads()
    assert threads.set_engine_threads() == user and torch.get_num_threads() == user


@needs_two_cores
def test_omp_num_threads_is_the_users_count(spinner, thread_state, monkeypatch):
    """OMP_NUM_THREADS set: the default count stays, busy core or not."""
    torch.set_num_threads(threads.allowed_cpus())
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads.allowed_cpus()))
    assert threads.set_engine_threads() == threads.allowed_cpus() == torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.set_engine_threads() <= len(CPUS) - 1  # the same call without it sees the spinner
