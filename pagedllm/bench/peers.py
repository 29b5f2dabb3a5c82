"""The systems pagedllm is measured against, on the same workload and the same weights.

- HF transformers ``generate()`` in static batches (left padding), on the
  default model's GGUF dequantized by transformers; it runs in this process.
- vLLM (its CPU build) in another virtualenv: this file is also a small
  stand-alone script that the other python runs (``python peers.py vllm ...``),
  so only the standard library is imported at module level. vLLM cannot read
  the GGUF's tokenizer and config the way transformers does, so the model is
  exported once to an HF directory (safetensors + tokenizer files).
- llama.cpp (``llama-cpp-python`` built from source) in its own virtualenv,
  through the same script (``python peers.py llamacpp ...``), on the GGUF
  file itself: its C API driven directly (``llama_batch`` over several
  sequences, greedy argmax), so one step decodes every running request, as
  llama.cpp's server does with its slots.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# vLLM CPU settings that keep it on this machine's cores and off the network;
# an explicit value in the caller's environment wins.
VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}


def resolve_dtype_name(dtype: str) -> str:
    """pagedllm's ``auto`` is float32 on CPU; every backend of a comparison gets the same."""
    return "float32" if dtype in (None, "auto") else dtype


# ---- HF transformers --------------------------------------------------------------


def load_hf_model(model: str | None, dtype: str):
    """(model, tokenizer) from a GGUF file (default: the default model) or an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.models.paths import resolve_model_path

    path = resolve_model_path(model)
    torch_dtype = getattr(torch, resolve_dtype_name(dtype))
    if path.suffix == ".gguf":
        kwargs = {"gguf_file": path.name}
        where = path.parent
    else:
        kwargs, where = {}, path
    tokenizer = AutoTokenizer.from_pretrained(str(where), **kwargs)
    hf_model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch_dtype, **kwargs)
    hf_model.eval()
    return hf_model, tokenizer


def run_hf(
    workload, model: str | None, dtype: str, batch_size: int, num_threads: int | None = None, warmup: bool = True
):
    """Static batches of ``batch_size`` prompts in workload order, left-padded; exactly output_len new tokens."""
    import torch

    from pagedllm.bench.throughput import ThroughputResult
    from pagedllm.bench.workloads import WARMUP_OUTPUT_LEN, warmup_prompts

    if num_threads:
        torch.set_num_threads(num_threads)
    start = time.perf_counter()
    hf_model, tokenizer = load_hf_model(model, dtype)
    load_s = time.perf_counter() - start
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    for prompt in warmup_prompts() if warmup else []:
        _hf_generate(hf_model, [prompt], WARMUP_OUTPUT_LEN, pad_id)
    num_output, num_padded_slots, num_real_slots = 0, 0, 0
    prompts = workload.prompt_token_ids
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        new_tokens = _hf_generate(hf_model, batch, workload.output_len, pad_id)
        num_output += new_tokens.numel()
        longest = max(len(p) for p in batch)
        num_padded_slots += len(batch) * (longest + workload.output_len)
        num_real_slots += sum(len(p) for p in batch) + len(batch) * workload.output_len
    wall_s = time.perf_counter() - start
    return ThroughputResult(
        backend="hf",
        dtype=resolve_dtype_name(dtype),
        num_requests=len(prompts),
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=num_output,
        wall_s=wall_s,
        load_s=load_s,
        extra={
            "hf_batch_size": batch_size,
            # KV slots spent on left padding, the static-batching waste.
            "kv_padding_fraction": 1 - num_real_slots / num_padded_slots,
            "transformers": _version("transformers"),
        },
    )


def _hf_generate(hf_model, batch: list[list[int]], num_new: int, pad_id: int):
    """New token ids [len(batch), num_new] of a left-padded greedy generate."""
    import torch

    longest = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, prompt in enumerate(batch):
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            pad_token_id=pad_id,
        )
    return out[:, longest:]


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


# ---- vLLM ---------------------------------------------------------------------------


def export_hf_dir(model: str | None) -> Path:
    """An HF directory of ``model`` for vLLM: the directory itself, or a one-time export of a GGUF."""
    from pagedllm.models.paths import cache_dir, resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        return path
    target = cache_dir() / "hf-export" / path.stem
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    from safetensors.torch import save_file

    hf_model, tokenizer = load_hf_model(str(path), "float32")
    target.mkdir(parents=True, exist_ok=True)
    # transformers refuses save_pretrained on a GGUF-loaded model, though the
    # weights are already dequantized: write them and a config without the
    # quantization entry by hand.
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tensors = {
        name: tensor.detach().contiguous().clone()
        for name, tensor in hf_model.state_dict().items()
        if not (name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False))
    }
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(target))
    hf_model.generation_config.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target


def vllm_env(num_cpus: int | None = None) -> dict:
    from pagedllm.native.threads import without_pagedllm_defaults

    env = without_pagedllm_defaults(dict(os.environ))
    cpus = num_cpus or os.cpu_count() or 1
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cpus - 1}")
    for key, value in VLLM_CPU_ENV.items():
        env.setdefault(key, value)
    return env


def run_vllm(workload, python: str, model: str | None, dtype: str, max_num_seqs: int = 256):
    """Run the workload through vLLM under ``python`` (another virtualenv) in a subprocess."""
    data = _run_vllm_script(workload, python, model, dtype, ["--max-num-seqs", str(max_num_seqs)])
    extra = {"vllm": data.get("vllm_version"), "omp_threads_bind": vllm_env()["VLLM_CPU_OMP_THREADS_BIND"]}
    return _peer_throughput("vllm", data, extra)


def _peer_throughput(backend: str, data: dict, extra: dict):
    """A peer script's throughput JSON as a ThroughputResult."""
    from pagedllm.bench.throughput import ThroughputResult

    return ThroughputResult(
        backend=backend,
        dtype=data["dtype"],
        num_requests=data["num_requests"],
        prompt_tokens=data["prompt_tokens"],
        output_tokens=data["output_tokens"],
        wall_s=data["wall_s"],
        load_s=data["load_s"],
        extra=extra,
    )


def run_vllm_latency(workload, python: str, model: str | None, dtype: str) -> tuple[list[dict], str | None]:
    """Time each prompt of ``workload`` alone through vLLM's engine step loop, in a
    subprocess under ``python``. Returns one dict per run (the keys of
    :func:`pagedllm.bench.latency.time_one_request`) and vLLM's version."""
    data = _run_vllm_script(workload, python, model, dtype, ["--mode", "latency", "--max-num-seqs", "8"])
    return data["runs"], data.get("vllm_version")


def _run_vllm_script(workload, python: str, model: str | None, dtype: str, extra_args: list[str],
                     sample_rss: bool = False) -> dict:
    """This file's ``vllm`` command under ``python`` on ``workload``; returns its JSON result
    (with ``peak_rss_bytes``, the peak summed over its process tree, when ``sample_rss``)."""
    import tempfile

    from pagedllm.bench import stopping
    from pagedllm.errors import ConfigError

    if not Path(python).exists():
        raise ConfigError(f"--peer-python {python!r} does not exist")
    model_dir = export_hf_dir(model)
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-") as tmp:
        workload_file, out_file = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        workload.save(workload_file)
        cmd = [
            python, str(Path(__file__).resolve()), "vllm",
            "--model-dir", str(model_dir), "--workload", str(workload_file), "--out", str(out_file),
            "--dtype", resolve_dtype_name(dtype), "--max-model-len", str(_round_up(workload.max_seq_len, 256)),
            *extra_args,
        ]
        # Run from the temporary directory so that the repository is not importable
        # as a package shadowing anything in the other virtualenv.
        env = vllm_env()
        if "--rope-scaling" in extra_args:
            # vLLM checks max_model_len against max_position_embeddings unscaled for YaRN and llama3.
            env.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
        # its own process group, killed with its workers if the bench is stopped meanwhile
        with tempfile.TemporaryFile("w+") as err, stopping.process_group(
            cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=env, cwd=tmp
        ) as proc:
            if sample_rss:
                peak_rss = _wait_sampling_rss(proc)
            else:
                proc.wait()
            err.seek(0)
            stderr = err.read()
        if proc.returncode != 0 or not out_file.is_file():
            raise ConfigError(f"the vLLM run failed (exit {proc.returncode}):\n{stderr[-4000:]}")
        result = json.loads(out_file.read_text())
        if sample_rss:
            result["peak_rss_bytes"] = peak_rss
        return result


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (0 for any that is gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def _wait_sampling_rss(proc: subprocess.Popen, interval_s: float = 0.1) -> int:
    """Wait for ``proc``; the peak of its process tree's resident memory meanwhile."""
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(interval_s)
    return peak


def run_vllm_beam(prompt: list[int], python: str, model: str | None, dtype: str, beam_width: int,
                  max_tokens: int, rope_scaling: dict | None, max_model_len: int) -> dict:
    """vLLM's ``LLM.beam_search`` over ``prompt`` (width, new tokens, rope scaling as pagedllm's run),
    in a subprocess under ``python``; its wall time, the time to its first beam step (the prompt's
    prefill), and the peak resident memory of its processes (the engine core runs in a child)."""
    from pagedllm.bench.workloads import Workload

    extra = ["--mode", "beam", "--beam-width", str(beam_width), "--max-model-len", str(max_model_len)]
    if rope_scaling is not None:
        extra += ["--rope-scaling", json.dumps(rope_scaling)]
    return _run_vllm_script(Workload("beam", [list(prompt)], max_tokens), python, model, dtype, extra,
                            sample_rss=True)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def default_max_model_len(workload) -> int:
    """The ``max_model_len`` vLLM is given for ``workload``: its longest request, rounded up to 256."""
    return _round_up(workload.max_seq_len, 256)


# ---- vLLM's OpenAI server -------------------------------------------------------------


def vllm_server_command(python: str, model_dir: Path, settings, host: str, port: int) -> list[str]:
    """vLLM's OpenAI server started with ``settings`` (a ``serve.ServerSettings``), the
    same values ``pagedllm serve`` gets. vLLM keeps its own KV block size (128 on CPU)."""
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", settings.served_model_name,
        "--dtype", settings.dtype,
        "--max-model-len", str(settings.max_model_len),
        "--kv-cache-memory-bytes", str(settings.kv_cache_bytes),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
        "--enable-prefix-caching" if settings.enable_prefix_caching else "--no-enable-prefix-caching",
        "--seed", "0",
        "--host", host,
        "--port", str(port),
        # pagedllm serve writes no access log unless --log-level debug
        "--disable-uvicorn-access-log",
    ]


def vllm_server_env(num_cpus: int | None = None) -> dict:
    """:func:`vllm_env` without ``VLLM_CPU_KVCACHE_SPACE``: that setting (whole GiB) would
    override ``--kv-cache-memory-bytes``, the KV size matched to pagedllm's."""
    env = vllm_env(num_cpus)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def _vllm_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="peers.py vllm")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--mode", choices=["throughput", "latency", "beam"], default="throughput")
    parser.add_argument("--beam-width", type=int, default=8, help="beam mode: the width")
    parser.add_argument("--rope-scaling", default=None, help="beam mode: an HF rope_scaling dict as JSON")
    return parser.parse_args(argv)


def _vllm_main(argv: list[str]) -> int:
    """Inside vLLM's virtualenv: load, warm up, time the workload, write a JSON result."""
    args = _vllm_args(argv)
    # This script's folder holds modules (cli, report, ...) that must not shadow vLLM's imports.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(here)]
    import vllm
    from vllm import SamplingParams

    workload = json.loads(Path(args.workload).read_text())
    prompts = [{"prompt_token_ids": list(p)} for p in workload["prompt_token_ids"]]
    output_len = int(workload["output_len"])
    llm, load_s, kwargs = _vllm_load(args)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if args.mode == "beam":
        result = {**_vllm_beam(llm, prompts[0], args.beam_width, output_len), "load_s": load_s, "kwargs": kwargs}
    elif args.mode == "latency":
        result = {"runs": [_vllm_time_one(llm.llm_engine, f"run-{i}", p, params, output_len)
                           for i, p in enumerate(prompts)]}
    else:
        result = {"dtype": args.dtype, **_vllm_throughput(llm, prompts, params), "load_s": load_s}
    result["vllm_version"] = getattr(vllm, "__version__", None)
    Path(args.out).write_text(json.dumps(result))
    return 0


def _vllm_load(args: argparse.Namespace):
    """(the warmed-up ``vllm.LLM``, its load seconds, the extra keyword arguments it got)."""
    from vllm import LLM, SamplingParams

    kwargs = {}
    if args.rope_scaling:
        # transformers 5 keeps rope settings in rope_parameters, rope_theta among them.
        config = json.loads((Path(args.model_dir) / "config.json").read_text())
        theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        kwargs["hf_overrides"] = {"rope_parameters": {"rope_theta": theta, **json.loads(args.rope_scaling)}}
    start = time.perf_counter()
    llm = LLM(
        model=args.model_dir, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, seed=0, **kwargs,
    )
    load_s = time.perf_counter() - start
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(100, 116))}] * 4, warm, use_tqdm=False)
    return llm, load_s, kwargs


def _vllm_throughput(llm, prompts: list[dict], params) -> dict:
    """Every prompt in one ``llm.generate``: counts and wall time."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "num_requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
        "wall_s": time.perf_counter() - start,
    }


def _vllm_beam(llm, prompt: dict, beam_width: int, max_tokens: int) -> dict:
    """``llm.beam_search`` over one prompt; wall time and the end of its first beam step."""
    from vllm.sampling_params import BeamSearchParams

    step_ends: list[float] = []
    beam_step = llm._beam_search_step  # one call per new token; the first includes the prefill

    def timed_step(*args, **kwargs):
        out = beam_step(*args, **kwargs)
        step_ends.append(time.perf_counter())
        return out

    llm._beam_search_step = timed_step
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.beam_search([prompt], params)
    wall_s = time.perf_counter() - start
    sequences = outputs[0].sequences
    return {
        "wall_s": wall_s,
        "prefill_s": step_ends[0] - start if step_ends else None,
        "num_steps": len(step_ends),
        "num_hypotheses": len(sequences),
        "new_tokens_best": len(sequences[0].tokens) - len(prompt["prompt_token_ids"]) if sequences else 0,
    }


def _vllm_time_one(engine, request_id: str, prompt: dict, params, output_len: int) -> dict:
    """vLLM's counterpart of ``latency.time_one_request``: one request alone, stamped per
    token. It repeats that function's arithmetic because this file runs in vLLM's
    virtualenv, where pagedllm cannot be imported."""
    stamps: list[float] = []
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            now = time.perf_counter()
            stamps += [now] * (len(output.outputs[0].token_ids) - len(stamps))
    if len(stamps) != output_len:
        raise RuntimeError(f"request {request_id} produced {len(stamps)} tokens, expected {output_len}")
    decode_s = stamps[-1] - stamps[0]
    return {
        "ttft_s": stamps[0] - start,
        "tpot_s": decode_s / (len(stamps) - 1) if len(stamps) > 1 else None,
        "decode_tokens_per_s": (len(stamps) - 1) / decode_s if decode_s > 0 else None,
        "e2e_s": stamps[-1] - start,
        "inter_token_s": [b - a for a, b in zip(stamps, stamps[1:])],
    }


# ---- llama.cpp ------------------------------------------------------------------------

# Environment variable naming the python of llama-cpp-python's virtualenv.
LLAMACPP_PYTHON_ENV = "PAGEDLLM_LLAMACPP_PYTHON"
DEFAULT_LLAMACPP_SLOTS = 32
# Written next to the virtualenv's python by whoever built llama-cpp-python: the build flags.
LLAMACPP_BUILD_FLAGS_FILE = "BUILD_FLAGS.txt"


def find_llamacpp_python(explicit: str | None) -> tuple[str | None, str | None]:
    """(python of llama-cpp-python's virtualenv, None), or (None, why the peer is skipped)."""
    python = explicit or os.environ.get(LLAMACPP_PYTHON_ENV)
    if not python:
        return None, f"no llama.cpp virtualenv: pass --llamacpp-python PATH or set ${LLAMACPP_PYTHON_ENV}"
    if not Path(python).exists():
        return None, f"llama.cpp's python {python!r} does not exist"
    return python, None


def llamacpp_gguf(model: str | None) -> Path:
    """The GGUF file llama.cpp runs: the one pagedllm loads (default: the default model)."""
    from pagedllm.errors import ConfigError
    from pagedllm.models.paths import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix != ".gguf":
        raise ConfigError(f"the llama.cpp peer runs GGUF files only; {str(path)!r} is an HF directory")
    return path


def bench_threads(num_threads: int | None) -> int:
    """The thread count every backend of a comparison gets: --num-threads, else pagedllm's
    default (one per CPU of this process's affinity mask)."""
    from pagedllm.native.threads import allowed_cpus

    return num_threads or allowed_cpus()


def run_llamacpp(workload, python: str, model: str | None, num_threads: int | None, num_slots: int):
    """The workload through llama.cpp with ``num_slots`` sequences decoded together."""
    data = _run_llamacpp_script(workload, python, model, num_threads, ["--slots", str(num_slots)])
    keys = ("llama_cpp_python", "threads", "slots", "build_flags", "system_info", "gguf")
    return _peer_throughput("llamacpp", data, {key: data[key] for key in keys})


def run_llamacpp_latency(workload, python: str, model: str | None, num_threads: int | None) -> dict:
    """Each prompt alone through llama.cpp, stamped per token; the JSON of the script's latency mode."""
    return _run_llamacpp_script(workload, python, model, num_threads, ["--mode", "latency", "--slots", "1"])


def _run_llamacpp_script(workload, python: str, model: str | None, num_threads: int | None, extra_args: list[str]) -> dict:
    import tempfile

    from pagedllm.errors import ConfigError
    from pagedllm.native.threads import without_pagedllm_defaults

    gguf = llamacpp_gguf(model)
    with tempfile.TemporaryDirectory(prefix="pagedllm-llamacpp-") as tmp:
        workload_file, out_file = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        workload.save(workload_file)
        cmd = [
            python, str(Path(__file__).resolve()), "llamacpp", "--gguf", str(gguf), "--workload", str(workload_file),
            "--out", str(out_file), "--threads", str(bench_threads(num_threads)), *extra_args,
        ]
        env = without_pagedllm_defaults(dict(os.environ))
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if done.returncode != 0 or not out_file.is_file():
            raise ConfigError(f"the llama.cpp run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out_file.read_text())


class _LlamaCppRunner:
    """Inside llama-cpp-python's virtualenv: one model and context, greedy decoding of many
    sequences per ``llama_decode`` call. Sequence ``s`` of the context is slot ``s``; a
    finished request's slot is emptied (``llama_memory_seq_rm``) and taken by the next."""

    def __init__(self, gguf: str, num_slots: int, ctx_per_slot: int, num_threads: int, batch_tokens: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(gguf.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        ctx_params = lc.llama_context_default_params()
        ctx_params.n_ctx = num_slots * ctx_per_slot
        ctx_params.n_seq_max = num_slots
        ctx_params.n_batch = ctx_params.n_ubatch = batch_tokens
        ctx_params.n_threads = ctx_params.n_threads_batch = num_threads
        # One KV buffer for all sequences: llama.cpp then batches a prompt with other
        # sequences' decode tokens in one ubatch (its split per-sequence cache would not).
        ctx_params.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch_tokens = batch_tokens
        self.batch = lc.llama_batch_init(batch_tokens, 0, num_slots)
        self.memory = lc.llama_get_memory(self.ctx)

    def describe(self) -> str:
        import ctypes

        buf = ctypes.create_string_buffer(256)
        self.lc.llama_model_desc(self.model, buf, len(buf))
        return buf.value.decode()

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One ``llama_decode`` of (token, position, slot, wants_logits) entries; the greedy
        next token of each entry that wants logits, in order."""
        import numpy as np

        batch = self.batch
        for i, (token, pos, slot, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0] = slot
            batch.logits[i] = wants
        batch.n_tokens = len(entries)
        status = self.lc.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with {status}")
        out = []
        for i, (_, _, _, wants) in enumerate(entries):
            if wants:
                logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                out.append(int(logits.argmax()))
        return out

    def free_slot(self, slot: int) -> None:
        self.lc.llama_memory_seq_rm(self.memory, slot, -1, -1)


class _Slot:
    """A request running in one llama.cpp sequence: its next input is ``last_token`` at ``position``."""

    def __init__(self, request: int, prompt_len: int) -> None:
        self.request = request
        self.prompt_len = prompt_len
        self.last_token = -1  # set by the first decode, before it is ever read
        self.num_new = 0

    @property
    def position(self) -> int:
        return self.prompt_len + self.num_new - 1  # the newest token's position


def _llamacpp_generate(runner: _LlamaCppRunner, prompts: list[list[int]], output_len: int, num_slots: int,
                       on_token=None) -> int:
    """Continuous batching over ``num_slots`` slots: each step decodes every running
    sequence's last token plus as many waiting prompts as fit; ``output_len`` new tokens
    each (EOS ignored). Returns the number of new tokens; ``on_token(request)`` per token."""
    from collections import deque

    waiting = deque(enumerate(prompts))
    free = list(range(num_slots - 1, -1, -1))
    running: dict[int, _Slot] = {}  # llama.cpp sequence id -> its request
    num_new = 0
    while waiting or running:
        order = list(running)
        entries = [(running[s].last_token, running[s].position, s, True) for s in order]
        while waiting and free and len(entries) + len(waiting[0][1]) <= runner.batch_tokens:
            request, prompt = waiting.popleft()
            slot = free.pop()
            entries += [(t, pos, slot, pos == len(prompt) - 1) for pos, t in enumerate(prompt)]
            running[slot] = _Slot(request, len(prompt))
            order.append(slot)
        for slot, token in zip(order, runner.decode(entries)):
            state = running[slot]
            state.last_token, state.num_new = token, state.num_new + 1
            num_new += 1
            if on_token is not None:
                on_token(state.request)
            if state.num_new == output_len:
                del running[slot]
                runner.free_slot(slot)
                free.append(slot)
    return num_new


def _llamacpp_main(argv: list[str]) -> int:
    """Inside llama-cpp-python's virtualenv: load the GGUF, warm up, time the workload, write JSON."""
    parser = argparse.ArgumentParser(prog="peers.py llamacpp")
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--slots", type=int, default=DEFAULT_LLAMACPP_SLOTS)
    parser.add_argument("--mode", choices=["throughput", "latency", "beam"], default="throughput")
    parser.add_argument("--beam-width", type=int, default=8, help="beam mode: the width")
    parser.add_argument("--rope-scaling", default=None, help="beam mode: an HF rope_scaling dict as JSON")
    args = parser.parse_args(argv)
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(here)]
    import llama_cpp

    workload = json.loads(Path(args.workload).read_text())
    prompts = [list(p) for p in workload["prompt_token_ids"]]
    output_len = int(workload["output_len"])
    longest = max(len(p) for p in prompts) + output_len
    start = time.perf_counter()
    runner = _LlamaCppRunner(args.gguf, args.slots, _round_up(longest, 256), args.threads,
                             batch_tokens=max(2048, _round_up(max(len(p) for p in prompts) + args.slots, 256)))
    load_s = time.perf_counter() - start
    _llamacpp_generate(runner, [list(range(100, 116))] * min(4, args.slots), 4, args.slots)  # warm-up
    flags_file = Path(sys.executable).parent.parent / LLAMACPP_BUILD_FLAGS_FILE
    info = {
        "llama_cpp_python": llama_cpp.__version__,
        "dtype": runner.describe(),
        "threads": args.threads,
        "slots": args.slots,
        "gguf": args.gguf,
        "build_flags": flags_file.read_text().strip() if flags_file.is_file() else None,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "load_s": load_s,
    }
    if args.mode == "latency":
        runs = [_llamacpp_time_one(runner, p, output_len) for p in prompts]
        Path(args.out).write_text(json.dumps({**info, "runs": runs}))
        return 0
    start = time.perf_counter()
    num_new = _llamacpp_generate(runner, prompts, output_len, args.slots)
    wall_s = time.perf_counter() - start
    result = {**info, "num_requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
              "output_tokens": num_new, "wall_s": wall_s}
    Path(args.out).write_text(json.dumps(result))
    return 0


def _llamacpp_time_one(runner: _LlamaCppRunner, prompt: list[int], output_len: int) -> dict:
    """llama.cpp's counterpart of ``latency.time_one_request`` (same keys, same arithmetic)."""
    stamps: list[float] = []
    start = time.perf_counter()
    _llamacpp_generate(runner, [prompt], output_len, 1, on_token=lambda _: stamps.append(time.perf_counter()))
    decode_s = stamps[-1] - stamps[0]
    return {
        "ttft_s": stamps[0] - start,
        "tpot_s": decode_s / (len(stamps) - 1) if len(stamps) > 1 else None,
        "decode_tokens_per_s": (len(stamps) - 1) / decode_s if decode_s > 0 else None,
        "e2e_s": stamps[-1] - start,
        "inter_token_s": [b - a for a, b in zip(stamps, stamps[1:])],
    }


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("vllm", "llamacpp"):
        sys.exit("usage: python peers.py vllm --model-dir DIR --workload FILE --out FILE [--dtype D]\n"
                 "       python peers.py llamacpp --gguf FILE --workload FILE --out FILE [--threads N]")
    sys.exit((_vllm_main if sys.argv[1] == "vllm" else _llamacpp_main)(sys.argv[2:]))
