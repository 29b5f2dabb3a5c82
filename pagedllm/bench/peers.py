"""The systems pagedllm is measured against, on the same workload and the same weights.

- HF transformers ``generate()`` in static batches (left padding), on the
  default model's GGUF dequantized by transformers; it runs in this process.
- vLLM (its CPU build) in another virtualenv: this file is also a small
  stand-alone script that the other python runs (``python peers.py vllm ...``),
  so only the standard library is imported at module level. vLLM cannot read
  the GGUF's tokenizer and config the way transformers does, so the model is
  exported once to an HF directory (safetensors + tokenizer files).
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
    from pagedllm.bench.throughput import ThroughputResult

    data = _run_vllm_script(workload, python, model, dtype, ["--max-num-seqs", str(max_num_seqs)])
    return ThroughputResult(
        backend="vllm",
        dtype=data["dtype"],
        num_requests=data["num_requests"],
        prompt_tokens=data["prompt_tokens"],
        output_tokens=data["output_tokens"],
        wall_s=data["wall_s"],
        load_s=data["load_s"],
        extra={"vllm": data.get("vllm_version"), "omp_threads_bind": vllm_env()["VLLM_CPU_OMP_THREADS_BIND"]},
    )


def run_vllm_latency(workload, python: str, model: str | None, dtype: str) -> tuple[list[dict], str | None]:
    """Time each prompt of ``workload`` alone through vLLM's engine step loop, in a
    subprocess under ``python``. Returns one dict per run (the keys of
    :func:`pagedllm.bench.latency.time_one_request`) and vLLM's version."""
    data = _run_vllm_script(workload, python, model, dtype, ["--mode", "latency", "--max-num-seqs", "8"])
    return data["runs"], data.get("vllm_version")


def _run_vllm_script(workload, python: str, model: str | None, dtype: str, extra_args: list[str]) -> dict:
    """This file's ``vllm`` command under ``python`` on ``workload``; returns its JSON result."""
    import tempfile

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
        done = subprocess.run(cmd, capture_output=True, text=True, env=vllm_env(), cwd=tmp)
        if done.returncode != 0 or not out_file.is_file():
            raise ConfigError(f"the vLLM run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out_file.read_text())


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


def _vllm_main(argv: list[str]) -> int:
    """Inside vLLM's virtualenv: load, warm up, time the workload, write a JSON result."""
    parser = argparse.ArgumentParser(prog="peers.py vllm")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--mode", choices=["throughput", "latency"], default="throughput")
    args = parser.parse_args(argv)

    # This script's folder holds modules (cli, report, ...) that must not shadow vLLM's imports.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(here)]
    import vllm
    from vllm import LLM, SamplingParams

    workload = json.loads(Path(args.workload).read_text())
    prompts = [{"prompt_token_ids": list(p)} for p in workload["prompt_token_ids"]]
    output_len = int(workload["output_len"])

    start = time.perf_counter()
    llm = LLM(
        model=args.model_dir, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, seed=0,
    )
    load_s = time.perf_counter() - start
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(100, 116))}] * 4, warm, use_tqdm=False)

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if args.mode == "latency":
        runs = [_vllm_time_one(llm.llm_engine, f"run-{i}", p, params, output_len) for i, p in enumerate(prompts)]
        Path(args.out).write_text(json.dumps({"runs": runs, "vllm_version": getattr(vllm, "__version__", None)}))
        return 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    result = {
        "dtype": args.dtype,
        "num_requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
        "wall_s": wall_s,
        "load_s": load_s,
        "vllm_version": getattr(vllm, "__version__", None),
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


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


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "vllm":
        sys.exit("usage: python peers.py vllm --model-dir DIR --workload FILE --out FILE [--dtype D]")
    sys.exit(_vllm_main(sys.argv[2:]))
