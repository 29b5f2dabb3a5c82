"""One-shot CUDA check of the Triton attention backend and the engine on it.

Parts (each guarded: a failure is recorded in the JSON and the others still run):

  kernel_check      write_kv and the decode/varlen kernels at full size against the
                    dense float64 oracle (bf16, 32 q / 8 kv heads, head dim 128,
                    block sizes 16 and 32, contexts up to 2048; plus fp16 and fp32).
  decode_bandwidth  paged decode at batch 64 x context 4096: K/V bytes read per
                    second, against a device-to-device copy and against
                    scaled_dot_product_attention on the same K/V stored contiguously.
  engine_greedy     the default model through ``pagedllm.LLM`` on CUDA (bf16, and
                    fp32) against a CPU fp32 run: greedy token agreement.
  w64_throughput    workload W64 with CUDA graphs on and off: output tokens/s.
  w64_profile       W64 with CUDA graphs under cProfile: host time per engine step.
  kv_quant          quantized KV (int8, fp8_e4m3, fp8_e5m2) in the Triton kernels: write_kv
                    codes and scales against the torch quantizer, decode (planned and
                    forced split-K) and mixed prefill against dense attention over the
                    dequantized rows; then W64-like decode (batch 64, the default model's
                    heads, W64's contexts) and the bandwidth shape timed with each 8-bit
                    format against the unquantized bf16 cache, plus a decode tiling sweep.
  w64_kv_quant      W64 through the engine with --kv-cache-dtype auto / int8 / fp8_e4m3:
                    output tok/s and greedy agreement with auto (skipped while the engine
                    does not accept the formats).

Usage: ``python benchmarks/gpu_check.py --out gpu_check.json`` on a CUDA machine.
``--interpret`` runs everything small on the CPU under Triton's interpreter
(timings are then meaningless); ``--skip-engine`` skips the engine parts and
``--parts`` names the parts to run, so a run can be split over two machines' calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# --workload default: ../shared/workloads/w64.json from the working directory,
# else the same path beside or inside the repository.
WORKLOAD_CANDIDATES = [
    Path("../shared/workloads/w64.json"),
    REPO_ROOT.parent / "shared" / "workloads" / "w64.json",
    REPO_ROOT / "shared" / "workloads" / "w64.json",
]

# Short splits and a high program target so tiny shapes still take the split-K path.
SMALL_SPLITS = {"min_split_tokens": 32, "target_programs": 64}

PARTS = ("kernel_check", "decode_bandwidth", "engine_greedy", "w64_throughput", "w64_profile", "kv_quant",
         "w64_kv_quant")

# Top logprobs kept from the CPU reference, to size the gap where a CUDA run diverges.
GAP_TOP_K = 5

GREEDY_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain what a hash table is in one paragraph.",
    "List three primary colors:",
    "Once upon a time, in a small village,",
    "Translate 'good morning' into Spanish.",
    "What is 17 multiplied by 23?",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON figures")
    parser.add_argument("--workload", default=None, help="W64 workload JSON (default ../shared/workloads/w64.json)")
    parser.add_argument("--model", default=None,
                        help="model path for the engine parts (default: the default model's package)")
    parser.add_argument("--interpret", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--skip-engine", action="store_true", help="skip the end-to-end engine parts")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--time-budget", type=float, default=280.0, help="seconds; later parts are skipped past it")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return args


class Clock:
    """Times a callable: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, torch, device: str):
        self.torch = torch
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def median_ms(self, fn, *, warmup: int, reps: int, inner: int = 1) -> float:
        """Median over ``reps`` of the mean time of ``inner`` back-to-back calls.

        Several calls per timed span keep the GPU queue full, so host launch
        overhead does not count as device time.
        """
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / inner)
            else:
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / inner)
        times.sort()
        return times[len(times) // 2]


# ---------------------------------------------------------------- (a) kernels


# (atol, rtol): a case passes when |out - ref| <= atol + rtol * |ref| everywhere.
TOLERANCE = {"float32": (2e-4, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (2e-2, 2e-2)}


def kernel_check(ctx: dict) -> dict:
    torch = ctx["torch"]
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    if ctx["interpret"]:
        dims = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 32}
        shapes, dtypes, block_sizes = _kernel_shapes(torch, max_ctx=100, batch=3), ["float32", "bfloat16"], [16]
        extra_dtypes = []
    else:
        dims = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
        shapes, dtypes, block_sizes = _kernel_shapes(torch, max_ctx=2048, batch=8), ["bfloat16"], [8, 16, 32]
        extra_dtypes = ["float16", "float32"]
    # Short splits on the tiny shapes so the split-K path runs there too.
    backend = TritonAttentionBackend(**SMALL_SPLITS) if ctx["interpret"] else TritonAttentionBackend()
    plan = [(kind, dtype, bs, None) for dtype in dtypes for bs in block_sizes for kind in shapes]
    plan += [("decode", "bfloat16", 16, splits) for splits in (1, 3)]  # forced split counts
    plan += [(kind, dtype, 16, None) for dtype in extra_dtypes for kind in shapes]
    cases = []
    for seed, (kind, dtype, block_size, splits) in enumerate(plan):
        name = f"{kind} {dtype} bs{block_size}" + (f" {splits}-split" if splits else "")
        t0 = time.perf_counter()
        try:
            case = _attention_case(ctx, backend, shapes[kind], dims, getattr(torch, dtype), block_size, seed, splits)
            case["ok"] = case.pop("excess") <= 0
        except Exception as exc:  # noqa: BLE001 - every failure is a reported result
            case = {"ok": False, "error": _describe(exc)}
        cases.append({"case": name, **case, "atol_rtol": TOLERANCE[dtype], "seconds": round(time.perf_counter() - t0, 3)})
    return {"ok": all(c["ok"] for c in cases), "cases": cases}


def _kernel_shapes(torch, *, max_ctx: int, batch: int) -> dict[str, list[tuple[int, int]]]:
    """(context_len, query_len) per sequence for a decode batch and a mixed batch."""
    gen = torch.Generator().manual_seed(0)

    def rand_len(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    return {
        "decode": [(rand_len(0, max_ctx - 1), 1) for _ in range(batch - 1)] + [(max_ctx - 1, 1)],
        # a fresh prefill, prefix hits starting mid-sequence, and decode rows together
        "mixed": [
            (0, max_ctx // 4),
            (max_ctx // 2 + 3, max_ctx // 8),
            (rand_len(1, max_ctx // 2), rand_len(2, max_ctx // 8)),
            (max_ctx - 1, 1),
            (rand_len(1, max_ctx - 1), 1),
        ],
    }


def _attention_case(ctx, backend, specs, dims, dtype, block_size, seed, splits) -> dict:
    """write_kv then attention on a random shuffled paged batch, against the dense oracle.

    ``splits`` forces the decode kernel's split count; ``None`` goes through
    ``backend.forward`` (its own dispatch and split plan).
    """
    torch = ctx["torch"]
    from attention_reference import make_paged_batch, naive_attention

    from pagedllm.attention.kernels.paged_decode import paged_decode

    b = make_paged_batch(specs, block_size=block_size, dtype=dtype, device=ctx["device"],
                         num_padding_tokens=2, seed=seed, **dims)
    md, kv_heads, head_dim = b.metadata, dims["num_kv_heads"], dims["head_dim"]
    expect_k = b.k_cache.clone().view(-1, kv_heads, head_dim)  # [num_slots, KH, D]
    backend.write_kv(b.new_key, b.new_value, b.k_cache, b.v_cache, md.slot_mapping)
    keep = md.slot_mapping >= 0
    expect_k[md.slot_mapping[keep]] = b.new_key[keep]
    write_exact = bool(torch.equal(expect_k, b.k_cache.view(-1, kv_heads, head_dim)))
    if splits is None:
        out = backend.forward(b.query, b.k_cache, b.v_cache, md, b.scale)
        used = backend.num_decode_splits(md, kv_heads, b.query.device) if md.is_decode_only else 0
    else:
        out = torch.zeros_like(b.query)
        paged_decode(b.query, b.k_cache, b.v_cache, md.block_tables, md.seq_lens,
                     md.query_start_loc, b.scale, splits, out)
        used = splits
    n = sum(md.query_lens_host)
    ref = naive_attention(b.query, b)[:n].float()
    diff = (out[:n].float() - ref).abs()
    atol, rtol = TOLERANCE[_dtype_name(dtype)]
    excess = (diff - atol - rtol * ref.abs()).max().item()
    padding_zero = bool(torch.count_nonzero(out[n:]) == 0)
    if not (write_exact and padding_zero):
        excess = math.inf
    return {"max_abs_err": diff.max().item(), "excess": excess, "write_kv_exact": write_exact,
            "padding_rows_zero": padding_zero, "num_splits": used}


# ------------------------------------------------------- (b) decode bandwidth


def decode_bandwidth(ctx: dict) -> dict:
    torch = ctx["torch"]
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    tiny, clock = ctx["interpret"], ctx["clock"]
    if tiny:
        shape = {"batch": 2, "context": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
        block_sizes, timing = [16], {"warmup": 1, "reps": 2, "inner": 1}
    else:
        shape = {"batch": 64, "context": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
        block_sizes, timing = [16, 32], {"warmup": 5, "reps": 15, "inner": 10}
    batch, head_dim = shape["batch"], shape["head_dim"]
    kv_bytes = 2 * batch * shape["context"] * shape["num_kv_heads"] * head_dim * 2  # K and V, bf16
    result: dict = {"shape": {**shape, "dtype": "bfloat16"}, "kv_bytes": kv_bytes, "runs": []}
    result["copy_gbs"] = _copy_bandwidth(ctx, kv_bytes, timing)

    # Dense K/V: [B, KH, S, D]; the paged caches below hold the same numbers.
    dense = _dense_decode_inputs(ctx, shape)
    sdpa, result["sdpa_mode"] = _sdpa_decode(torch, dense)
    sdpa_ms = clock.median_ms(sdpa, **timing)
    result.update({"sdpa_ms": sdpa_ms, "sdpa_gbs": kv_bytes / sdpa_ms / 1e6})
    expected = sdpa().view(batch, shape["num_heads"], head_dim)

    default_backend = TritonAttentionBackend(**SMALL_SPLITS) if tiny else TritonAttentionBackend()
    plans = [(bs, default_backend) for bs in block_sizes]
    plans.append((block_sizes[0], TritonAttentionBackend(max_num_splits=1)))  # split-K off, for contrast
    for block_size, backend in plans:
        run = _time_paged_decode(ctx, backend, dense, block_size, expected, timing)
        gbs = kv_bytes / run["ms"] / 1e6
        run.update({"gbs": gbs, "pct_of_copy": 100 * gbs / result["copy_gbs"], "speedup_vs_sdpa": sdpa_ms / run["ms"]})
        result["runs"].append(run)
    result["ok"] = all(r["max_abs_err_vs_sdpa"] < 3e-2 for r in result["runs"])
    result["tiling_sweep"] = _tiling_sweep(ctx, dense, expected, timing, kv_bytes)
    result["split_sweep"] = _split_sweep(ctx, timing)
    return result


def _split_sweep(ctx: dict, timing: dict) -> list[dict]:
    """Decode GB/s per forced split count at several batch sizes, against the planned count.

    Smaller batches get longer contexts so the K/V read stays well above the L2
    size; the point is where splitting starts to pay, to tune the split plan.
    """
    from pagedllm.attention.kernels.paged_decode import paged_decode
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    torch = ctx["torch"]
    if ctx["interpret"]:
        cases, split_counts = [(2, 128)], [1, 2]
        dims = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
    else:
        cases, split_counts = [(4, 16384), (16, 8192), (32, 4096), (64, 4096), (128, 2048)], [1, 2, 4, 8, 16]
        dims = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    planner = TritonAttentionBackend()
    sweep = []
    for batch, context in cases:
        shape = {"batch": batch, "context": context, **dims}
        kv_bytes = 2 * batch * context * dims["num_kv_heads"] * dims["head_dim"] * 2
        query, k_cache, v_cache, md = _paged_decode_inputs(ctx, _dense_decode_inputs(ctx, shape), 16)
        out = torch.empty_like(query)
        scale = 1.0 / math.sqrt(dims["head_dim"])
        entry = {"batch": batch, "context": context, "kv_bytes": kv_bytes,
                 "planned_splits": planner.num_decode_splits(md, dims["num_kv_heads"], query.device), "gbs": {}}
        for splits in split_counts:
            args = (query, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale, splits, out)
            ms = ctx["clock"].median_ms(lambda args=args: paged_decode(*args), **timing)
            entry["gbs"][splits] = round(kv_bytes / ms / 1e6, 1)
        entry["best_splits"] = max(entry["gbs"], key=entry["gbs"].get)
        sweep.append(entry)
    return sweep


def _tiling_sweep(ctx: dict, dense: dict, expected, timing: dict, kv_bytes: int) -> list[dict]:
    """Decode GB/s for other launch shapes (block size 16, planned splits), to tune defaults."""
    from pagedllm.attention.kernels.paged_decode import DecodeTiling
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    if ctx["interpret"]:
        tilings = [DecodeTiling(block_n=32)]
    else:
        tilings = [DecodeTiling(block_n=n, num_warps=w) for n in (32, 64, 128) for w in (4, 8)]
        tilings += [DecodeTiling(block_n=64, num_stages=3), DecodeTiling(block_n=128, num_warps=8, num_stages=3)]
    sweep = []
    for tiling in tilings:
        entry = {"block_n": tiling.block_n, "num_warps": tiling.num_warps, "num_stages": tiling.num_stages}
        try:
            backend = TritonAttentionBackend(decode_tiling=tiling)
            run = _time_paged_decode(ctx, backend, dense, 16, expected, timing)
            entry.update(run, gbs=kv_bytes / run["ms"] / 1e6, ok=run["max_abs_err_vs_sdpa"] < 3e-2)
        except Exception as exc:  # noqa: BLE001 - a shape that does not fit is a result too
            entry.update(ok=False, error=_describe(exc))
        sweep.append(entry)
    return sweep


def _time_paged_decode(ctx: dict, backend, dense: dict, block_size: int, expected, timing: dict) -> dict:
    """Median ms of one decode forward over a paged copy of ``dense``, and its error."""
    query, k_cache, v_cache, md = _paged_decode_inputs(ctx, dense, block_size)
    scale = dense["scale"]
    out = backend.forward(query, k_cache, v_cache, md, scale)
    return {
        "block_size": block_size,
        "num_splits": backend.num_decode_splits(md, k_cache.shape[2], query.device),
        "ms": ctx["clock"].median_ms(lambda: backend.forward(query, k_cache, v_cache, md, scale), **timing),
        "max_abs_err_vs_sdpa": (out.float() - expected.float()).abs().max().item(),
    }


def _copy_bandwidth(ctx: dict, num_bytes: int, timing: dict) -> float:
    """GB/s of a device-to-device copy of ``num_bytes``, counting reads and writes."""
    src = ctx["torch"].randn(num_bytes // 4, device=ctx["device"])
    dst = ctx["torch"].empty_like(src)
    ms = ctx["clock"].median_ms(lambda: dst.copy_(src), **timing)
    return 2 * num_bytes / ms / 1e6


def _dense_decode_inputs(ctx: dict, shape: dict) -> dict:
    torch, device = ctx["torch"], ctx["device"]
    b, h, kh, s, d = (shape[k] for k in ("batch", "num_heads", "num_kv_heads", "context", "head_dim"))
    return {
        "q": torch.randn(b, h, 1, d, device=device, dtype=torch.bfloat16),  # [B, H, 1, D]
        "k": torch.randn(b, kh, s, d, device=device, dtype=torch.bfloat16),  # [B, KH, S, D]
        "v": torch.randn(b, kh, s, d, device=device, dtype=torch.bfloat16),
        "scale": 1.0 / math.sqrt(d),
    }


def _sdpa_decode(torch, dense: dict):
    """(callable, mode): SDPA over the dense K/V, sharing KV heads if torch can."""
    import torch.nn.functional as F

    q, k, v, scale = dense["q"], dense["k"], dense["v"], dense["scale"]

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    try:
        gqa()
        return gqa, "enable_gqa"
    except (TypeError, RuntimeError):
        # Older torch has no enable_gqa: expanded K/V read group-times the bytes.
        group = q.shape[1] // k.shape[1]
        k_wide, v_wide = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return (lambda: F.scaled_dot_product_attention(q, k_wide, v_wide, scale=scale)), f"expanded K/V ({group}x bytes)"


def _paged_decode_inputs(ctx: dict, dense: dict, block_size: int):
    """The dense K/V scattered into shuffled cache blocks, and decode metadata."""
    torch, device = ctx["torch"], ctx["device"]
    from pagedllm.attention.base import AttentionMetadata

    batch, num_kv_heads, context, head_dim = dense["k"].shape
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq + 1  # block 0 stays unused
    gen = torch.Generator().manual_seed(block_size)
    block_tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_seq)
    block_tables = block_tables.to(torch.int32).to(device)  # [B, blocks_per_seq]
    # Sequence b's token t lives in block table[b, t // block_size] at offset t % block_size.
    k_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    flat = block_tables.long().flatten()
    for cache, src in ((k_cache, dense["k"]), (v_cache, dense["v"])):
        cache[flat] = src.permute(0, 2, 1, 3).reshape(-1, block_size, num_kv_heads, head_dim)
    query = dense["q"].view(batch, -1, head_dim)  # [B, H, D]
    md = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
        block_tables=block_tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=context,
        seq_lens_host=[context] * batch,
        query_lens_host=[1] * batch,
    )
    return query, k_cache, v_cache, md


# ------------------------------------------------------------ (c) and (d)


def _generate_tokens(ctx: dict, prompts, max_tokens: int, logprobs: int | None = None,
                     **llm_kwargs) -> tuple[list[list[int]], dict]:
    """Greedy tokens per prompt, and run info (with per-position top logprobs if asked)."""
    from pagedllm import LLM, SamplingParams

    torch = ctx["torch"]
    t0 = time.perf_counter()
    llm = LLM(model=ctx["model"], **llm_kwargs)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    info = {"load_s": round(load_s, 2), "generate_s": round(gen_s, 2), "attention_backend": _backend_name(llm)}
    if logprobs:
        info["logprobs"] = [[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                            for o in outputs]
    del llm, outputs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens, info


def engine_greedy(ctx: dict) -> dict:
    tiny = ctx["interpret"]
    prompts = GREEDY_PROMPTS[:2] if tiny else GREEDY_PROMPTS
    max_tokens = 4 if tiny else 32
    device = ctx["device"]
    reference, ref_info = _generate_tokens(ctx, prompts, max_tokens, logprobs=GAP_TOP_K, dtype="float32",
                                           device="cpu")
    ref_logprobs = ref_info.pop("logprobs")
    result: dict = {"prompts": len(prompts), "max_tokens": max_tokens, "cpu_fp32": ref_info, "runs": []}
    # On the CPU the default backend would be the torch one; ask for the kernels.
    backend = {"attention_backend": "triton"} if tiny else {}
    for dtype in ("bfloat16", "float32"):
        try:
            tokens, info = _generate_tokens(ctx, prompts, max_tokens, dtype=dtype, device=device, **backend)
        except Exception as exc:  # noqa: BLE001
            result["runs"].append({"dtype": dtype, "ok": False, "error": _describe(exc)})
            continue
        divergences = [_first_divergence(a, b) for a, b in zip(tokens, reference, strict=True)]
        mismatched = [
            {"prompt": i, "first_divergence": d, "cpu": reference[i][d: d + 3], "cuda": tokens[i][d: d + 3],
             "cpu_fp32_logprob_gap": _logprob_gap(ref_logprobs[i], d, reference[i], tokens[i])}
            for i, d in enumerate(divergences) if d is not None
        ]
        result["runs"].append({
            "dtype": dtype, "ok": True, "exact_matches": len(prompts) - len(mismatched),
            "mismatches": mismatched, **info,
        })
        if tiny:
            break
    # bf16 near-ties are expected; fp32 on CUDA should match the CPU exactly or nearly.
    result["ok"] = all(run["ok"] for run in result["runs"])
    return result


def _logprob_gap(positions: list[dict], at: int, cpu: list[int], cuda: list[int]) -> float | None:
    """How much likelier the CPU fp32 run found its token than the CUDA run's, at the divergence.

    A small gap is a near tie that reduced precision may flip; None when the
    CUDA token is outside the CPU's top ``GAP_TOP_K`` (or one run had ended).
    """
    if at >= min(len(cpu), len(cuda), len(positions)):
        return None
    top = positions[at]
    if cuda[at] not in top:
        return None
    return round(top[cpu[at]] - top[cuda[at]], 4)


def w64_throughput(ctx: dict, workload_path: str | None) -> dict:
    from pagedllm import SamplingParams

    tiny = ctx["interpret"]
    workload = _load_workload(workload_path)
    workload_path = workload["path"]
    prompt_ids = workload["prompt_token_ids"]
    max_tokens = workload.get("output_len", 128)
    if tiny:
        prompt_ids, max_tokens = [p[:16] for p in prompt_ids[:2]], 2
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    result: dict = {"workload": str(workload_path), "num_requests": len(prompts),
                    "prompt_tokens": sum(map(len, prompt_ids)), "max_tokens": max_tokens, "runs": []}
    # CUDA graphs with overlapped steps (the default), graphs alone, neither. On the CPU
    # (--interpret) overlap is off by default; turn it on so its path runs there too.
    configs = {"graphs + overlap": (False, True if tiny else None), "graphs": (False, False), "eager": (True, None)}
    # One untimed run first: Triton's compiled kernels are cached per process, so
    # without it the first timed configuration would pay for every compile.
    t0 = time.perf_counter()
    _, reference = _w64_run(ctx, prompts, params, *configs["graphs"])
    result["compile_run_s"] = round(time.perf_counter() - t0, 2)
    # The two graph configurations alternate, twice each: runs drift on a shared machine.
    order = ["graphs + overlap", "graphs", "graphs + overlap", "graphs", "eager"]
    same_tokens = True
    for name in order:
        enforce_eager, async_scheduling = configs[name]
        run: dict = {"config": name, "enforce_eager": enforce_eager, "async_scheduling": async_scheduling}
        try:
            info, tokens = _w64_run(ctx, prompts, params, enforce_eager, async_scheduling)
            run.update(info)
            run["ok"] = run["output_tokens"] == len(prompts) * max_tokens
            run["total_tok_s"] = (run["output_tokens"] + result["prompt_tokens"]) / run["seconds"]
            # Overlapping steps changes when tokens are read, never which.
            same_tokens = same_tokens and (tokens == reference or enforce_eager)
        except Exception as exc:  # noqa: BLE001
            run.update({"ok": False, "error": _describe(exc)})
        result["runs"].append(run)
    result["best_output_tok_s"] = {
        name: max((r["output_tok_s"] for r in result["runs"] if r["config"] == name and r["ok"]), default=None)
        for name in configs
    }
    result["overlap_same_tokens"] = same_tokens
    result["ok"] = all(r["ok"] for r in result["runs"]) and same_tokens
    return result


def _w64_run(ctx: dict, prompts: list[dict], params, enforce_eager: bool,
             async_scheduling: bool | None, **llm_kwargs) -> tuple[dict, list[list[int]]]:
    """Load the model, warm up, and time one full generate over ``prompts``: (figures, tokens)."""
    from pagedllm import LLM, SamplingParams

    torch, clock, tiny = ctx["torch"], ctx["clock"], ctx["interpret"]
    t0 = time.perf_counter()
    llm = LLM(model=ctx["model"], dtype="bfloat16", device=ctx["device"], enforce_eager=enforce_eager,
              async_scheduling=async_scheduling, **llm_kwargs)
    info = {"load_s": round(time.perf_counter() - t0, 2), "attention_backend": _backend_name(llm),
            "overlapped": llm.llm_engine.async_scheduling}
    # Warm-up: compile kernels and capture graphs outside the timed run.
    warm = SamplingParams(temperature=0, max_tokens=2 if tiny else 8, ignore_eos=True)
    llm.generate(prompts[: 1 if tiny else 8], warm, use_tqdm=False)
    clock.sync()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    clock.sync()
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    out_tokens = sum(map(len, tokens))
    info["overlapped_steps"] = llm.llm_engine.num_overlapped_steps
    del llm, outputs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {**info, "seconds": round(elapsed, 3), "output_tokens": out_tokens,
            "output_tok_s": out_tokens / elapsed}, tokens


def w64_profile(ctx: dict, workload_path: str | None) -> dict:
    """W64 with CUDA graphs once more under cProfile: where a step's host time goes."""
    import cProfile
    import io
    import pstats

    from pagedllm import LLM, SamplingParams

    prompt_ids = _load_workload(workload_path)["prompt_token_ids"]
    max_tokens = 2 if ctx["interpret"] else 128
    if ctx["interpret"]:
        prompt_ids = [p[:16] for p in prompt_ids[:2]]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    llm = LLM(model=ctx["model"], dtype="bfloat16", device=ctx["device"])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm: same shapes as the profiled run
    ctx["clock"].sync()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    ctx["clock"].sync()
    profiler.disable()
    elapsed = time.perf_counter() - t0
    stats = pstats.Stats(profiler)
    steps = next((v[1] for k, v in stats.stats.items() if k[2] == "execute" and "model_runner" in k[0]), None)
    tables = {}
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(35)
        tables[order] = text.getvalue().splitlines()
    del llm
    return {"ok": True, "seconds_profiled": round(elapsed, 3), "steps": steps,
            "ms_per_step": round(1e3 * elapsed / steps, 3) if steps else None, "top": tables}


# ------------------------------------------------------------ (e) quantized KV


KV_FORMAT_NAMES = ("int8", "fp8_e4m3", "fp8_e5m2")


def kv_quant(ctx: dict) -> dict:
    """Quantized-KV kernels against the oracle, then decode timed per KV format."""
    result = {"cases": _kv_quant_cases(ctx)}
    result["decode_timing"] = _kv_quant_decode_timing(ctx)
    result["ok"] = all(c["ok"] for c in result["cases"]) and all(
        run["ok"] for shape in result["decode_timing"] for run in shape["runs"]
    )
    return result


def _kv_quant_cases(ctx: dict) -> list[dict]:
    torch = ctx["torch"]
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    if ctx["interpret"]:
        dims = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 32}
        shapes, dtypes, block_sizes = _kernel_shapes(torch, max_ctx=100, batch=3), ["float32"], [16]
    else:
        dims = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
        shapes, dtypes, block_sizes = _kernel_shapes(torch, max_ctx=2048, batch=8), ["bfloat16", "float16"], [16, 32]
    backend = TritonAttentionBackend(**SMALL_SPLITS) if ctx["interpret"] else TritonAttentionBackend()
    plan = [(fmt, kind, dtype, bs, None) for fmt in KV_FORMAT_NAMES for dtype in dtypes for bs in block_sizes
            for kind in shapes]
    plan += [(fmt, "decode", dtypes[0], 16, 3) for fmt in KV_FORMAT_NAMES]  # forced split-K
    cases = []
    for seed, (fmt, kind, dtype, block_size, splits) in enumerate(plan):
        name = f"{fmt} {kind} {dtype} bs{block_size}" + (f" {splits}-split" if splits else "")
        t0 = time.perf_counter()
        try:
            case = _kv_quant_case(ctx, backend, fmt, shapes[kind], dims, getattr(torch, dtype), block_size, seed,
                                  splits)
        except Exception as exc:  # noqa: BLE001 - every failure is a reported result
            case = {"ok": False, "error": _describe(exc)}
        cases.append({"case": name, **case, "atol_rtol": TOLERANCE[dtype], "seconds": round(time.perf_counter() - t0, 3)})
    return cases


def _kv_quant_case(ctx, backend, fmt, specs, dims, dtype, block_size, seed, splits) -> dict:
    """write_kv into an 8-bit cache, attention, and the checks of one case."""
    torch = ctx["torch"]
    from attention_reference import naive_attention
    from kv_quant_reference import FORMATS, QuantizedBatch, quantize

    from pagedllm.attention.kernels.paged_decode import paged_decode

    cache_dtype = FORMATS[fmt]
    q = QuantizedBatch(specs, cache_dtype, device=ctx["device"], seed=seed, block_size=block_size, dtype=dtype,
                       num_padding_tokens=2, **dims)
    b, md = q.batch, q.batch.metadata
    if splits is None:
        out, ref, n = q.run(backend)
        used = backend.num_decode_splits(md, dims["num_kv_heads"], b.query.device) if md.is_decode_only else 0
    else:
        backend.write_kv(b.new_key, b.new_value, q.k_cache, q.v_cache, md.slot_mapping, q.k_scale, q.v_scale)
        out = torch.zeros_like(b.query)
        paged_decode(b.query, q.k_cache, q.v_cache, md.block_tables, md.seq_lens, md.query_start_loc, b.scale,
                     splits, out, None, q.k_scale, q.v_scale)
        ref, n, used = naive_attention(b.query, b), sum(md.query_lens_host), splits
    keep = md.slot_mapping >= 0
    slots = md.slot_mapping[keep]
    write_exact = True
    for new, cache, scales in ((b.new_key, q.k_cache, q.k_scale), (b.new_value, q.v_cache, q.v_scale)):
        codes, scale = quantize(new[keep], cache_dtype)
        stored = cache.view(torch.uint8).view(-1, *cache.shape[2:])[slots]
        write_exact &= bool(torch.equal(stored, codes.view(torch.uint8)))
        write_exact &= bool(torch.equal(scales.view(-1, cache.shape[2])[slots], scale))
    ref = ref[:n].float()
    diff = (out[:n].float() - ref).abs()
    atol, rtol = TOLERANCE[_dtype_name(dtype)]
    excess = (diff - atol - rtol * ref.abs()).max().item()
    padding_zero = bool(torch.count_nonzero(out[n:]) == 0)
    ok = excess <= 0 and write_exact and padding_zero
    return {"ok": ok, "max_abs_err": diff.max().item(), "write_kv_exact": write_exact,
            "padding_rows_zero": padding_zero, "num_splits": used}


def _kv_quant_decode_timing(ctx: dict) -> list[dict]:
    """Decode forward ms with a bf16 cache and each 8-bit one, on the same contexts.

    Shapes: "w64": batch 64 with the default model's heads (9 / 3, head dim 64)
    at W64's prompt lengths + 64 (halfway through its 128 output tokens);
    "bandwidth": batch 64 x 4096 with 32 / 8 heads of dim 128, as decode_bandwidth.
    """
    torch = ctx["torch"]
    if ctx["interpret"]:
        shapes = {"w64": ([40, 70], 4, 2, 32), "bandwidth": ([64, 64], 4, 2, 32)}
        timing = {"warmup": 1, "reps": 2, "inner": 1}
        tilings = [(32, 4)]
    else:
        try:
            prompt_lens = [len(p) for p in _load_workload(None)["prompt_token_ids"]]
        except FileNotFoundError:
            gen = torch.Generator().manual_seed(64)
            prompt_lens = torch.randint(32, 513, (64,), generator=gen).tolist()
        shapes = {"w64": ([n + 64 for n in prompt_lens], 9, 3, 64), "bandwidth": ([4096] * 64, 32, 8, 128)}
        timing = {"warmup": 5, "reps": 15, "inner": 10}
        tilings = [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)]
    report = []
    for name, (context_lens, num_heads, num_kv_heads, head_dim) in shapes.items():
        entry = {"shape": name, "batch": len(context_lens), "num_heads": num_heads, "num_kv_heads": num_kv_heads,
                 "head_dim": head_dim, "context_tokens": sum(context_lens), "runs": []}
        try:
            entry["runs"] = _time_kv_formats(ctx, context_lens, num_heads, num_kv_heads, head_dim, timing,
                                             tilings if name == "bandwidth" else [])
        except Exception as exc:  # noqa: BLE001
            entry["runs"] = [{"ok": False, "error": _describe(exc)}]
        report.append(entry)
    return report


def _time_kv_formats(ctx, context_lens, num_heads, num_kv_heads, head_dim, timing, tilings) -> list[dict]:
    """One decode timing per (format, tiling); every run beside the bf16 cache's of the same call."""
    import functools

    from kv_quant_reference import FORMATS, quantize

    from pagedllm.attention.kernels.paged_decode import DecodeTiling
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    query, k_cache, v_cache, md = _paged_decode_batch(ctx, context_lens, num_heads, num_kv_heads, head_dim, 16)
    scale = 1.0 / math.sqrt(head_dim)
    tokens = sum(context_lens)
    backend = TritonAttentionBackend()
    reference = backend.forward(query, k_cache, v_cache, md, scale)
    caches = {"bf16": (k_cache, v_cache, None, None)}
    for fmt in KV_FORMAT_NAMES:
        k_codes, k_scale = quantize(k_cache, FORMATS[fmt])  # [blocks, block_size, KH, D], [blocks, block_size, KH]
        v_codes, v_scale = quantize(v_cache, FORMATS[fmt])
        caches[fmt] = (k_codes, v_codes, k_scale, v_scale)
    plans = [(fmt, None) for fmt in caches]
    plans += [(fmt, DecodeTiling(block_n=n, num_warps=w)) for fmt in ("int8", "fp8_e4m3") for n, w in tilings]
    runs, bf16_ms = [], None
    for fmt, tiling in plans:
        k, v, ks, vs = caches[fmt]
        run_backend = TritonAttentionBackend(decode_tiling=tiling) if tiling else backend
        run = {"kv_format": fmt, "tiling": None if tiling is None else [tiling.block_n, tiling.num_warps],
               "num_splits": run_backend.num_decode_splits(md, num_kv_heads, query.device)}
        step = functools.partial(run_backend.forward, query, k, v, md, scale, ks, vs)
        try:
            out = step()
            ms = ctx["clock"].median_ms(step, **timing)
        except Exception as exc:  # noqa: BLE001 - a tiling that does not fit is a result too
            runs.append({**run, "ok": False, "error": _describe(exc)})
            continue
        bytes_read = 2 * tokens * num_kv_heads * (head_dim * k.element_size() + (2 if ks is not None else 0))
        bf16_ms = ms if fmt == "bf16" else bf16_ms
        err = (out.float() - reference.float()).abs().max().item()
        run.update({"ms": ms, "kv_bytes": bytes_read, "gbs": bytes_read / ms / 1e6,
                    "speedup_vs_bf16": bf16_ms / ms if bf16_ms else None,
                    "max_abs_err_vs_bf16_kv": err, "ok": math.isfinite(err) and err < 0.25})
        runs.append(run)
    return runs


def _paged_decode_batch(ctx, context_lens, num_heads, num_kv_heads, head_dim, block_size):
    """Random bf16 K/V for sequences of ``context_lens`` in shuffled blocks, and decode metadata."""
    torch, device = ctx["torch"], ctx["device"]
    from pagedllm.attention.base import AttentionMetadata

    blocks = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks) + 1  # block 0 stays unused
    gen = torch.Generator().manual_seed(sum(context_lens))
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(context_lens), max(blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor(order[start: start + n], dtype=torch.int32)
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
    batch = len(context_lens)
    query = torch.randn(batch, num_heads, head_dim, generator=gen).to(torch.bfloat16).to(device)  # [B, H, D]
    md = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=max(context_lens),
        seq_lens_host=list(context_lens),
        query_lens_host=[1] * batch,
    )
    return query, k_cache, v_cache, md


def w64_kv_quant(ctx: dict, workload_path: str | None) -> dict:
    """W64 through the engine per --kv-cache-dtype (CUDA graphs, default overlap)."""
    from pagedllm import SamplingParams
    from pagedllm.errors import ConfigError

    tiny = ctx["interpret"]
    prompt_ids = _load_workload(workload_path)["prompt_token_ids"]
    max_tokens = 2 if tiny else 128
    if tiny:
        prompt_ids = [p[:16] for p in prompt_ids[:2]]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    extra = {"attention_backend": "triton"} if tiny else {}
    result: dict = {"num_requests": len(prompts), "max_tokens": max_tokens, "runs": []}
    reference = None
    for kv_cache_dtype in ("auto", "int8", "fp8_e4m3"):
        try:
            info, tokens = _w64_run(ctx, prompts, params, False, None, kv_cache_dtype=kv_cache_dtype, **extra)
        except ConfigError as exc:
            result["runs"].append({"kv_cache_dtype": kv_cache_dtype, "skipped": True, "reason": str(exc)})
            continue
        except Exception as exc:  # noqa: BLE001
            result["runs"].append({"kv_cache_dtype": kv_cache_dtype, "ok": False, "error": _describe(exc)})
            continue
        reference = tokens if kv_cache_dtype == "auto" else reference
        same = None if reference is None else sum(a == b for a, b in zip(tokens, reference, strict=True))
        result["runs"].append({"kv_cache_dtype": kv_cache_dtype, "ok": True, **info,
                               "sequences_equal_to_auto": same})
    timed = [r for r in result["runs"] if r.get("ok")]
    if all(r.get("skipped") for r in result["runs"][1:]):
        result.update(skipped=True, reason="the engine accepts no 8-bit kv_cache_dtype yet")
    result["ok"] = all(r.get("ok") or r.get("skipped") for r in result["runs"]) and bool(timed)
    return result


# ------------------------------------------------------------------- helpers


def _load_workload(workload_path: str | None) -> dict:
    if workload_path is None:
        found = [p for p in WORKLOAD_CANDIDATES if p.is_file()]
        if not found:
            raise FileNotFoundError(f"no W64 workload at {[str(p) for p in WORKLOAD_CANDIDATES]}; pass --workload")
        workload_path = found[0]
    return {"path": str(workload_path), **json.loads(Path(workload_path).read_text())}


def _backend_name(llm) -> str | None:
    """The attention backend's name; it lives on the engine's worker."""
    engine = getattr(llm, "llm_engine", None)
    backend = getattr(getattr(engine, "worker", None), "attn_backend", None) or getattr(engine, "attn_backend", None)
    return getattr(backend, "name", None)


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _describe(exc: BaseException) -> str:
    tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
    return "".join(tail)[-1500:]


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _environment(torch, triton, device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update({"gpu": props.name, "sms": props.multi_processor_count,
                    "gpu_memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda})
    return env


def _summary_lines(report: dict) -> list[str]:
    lines = [f"{'part':<18} {'status':<8} figures"]

    def status(part: dict) -> str:
        return "skipped" if part.get("skipped") else ("ok" if part.get("ok") else "FAILED")

    kc = report["kernel_check"]
    figures = ""
    if "cases" in kc:
        bad = [c["case"] for c in kc["cases"] if not c["ok"]]
        worst = max((c.get("max_abs_err", 0.0) for c in kc["cases"]), default=0.0)
        figures = f"{len(kc['cases']) - len(bad)}/{len(kc['cases'])} cases pass, worst err {worst:.2e}"
        figures += f"; failing: {', '.join(bad)}" if bad else ""
    lines.append(f"{'kernel_check':<18} {status(kc):<8} {figures}")

    bw = report["decode_bandwidth"]
    for run in bw.get("runs", []):
        lines.append(
            f"{'decode_bandwidth':<18} {status(bw):<8} bs{run['block_size']} splits {run['num_splits']}: "
            f"{run['gbs']:.0f} GB/s = {run['pct_of_copy']:.0f}% of copy ({bw['copy_gbs']:.0f} GB/s), "
            f"{run['speedup_vs_sdpa']:.2f}x SDPA ({bw['sdpa_gbs']:.0f} GB/s)"
        )
    if not bw.get("runs"):
        lines.append(f"{'decode_bandwidth':<18} {status(bw):<8}")
    timed = [t for t in bw.get("tiling_sweep", []) if "gbs" in t]
    if timed:
        best = max(timed, key=lambda t: t["gbs"])
        lines.append(
            f"{'decode_tiling':<18} {'':<8} best of {len(timed)}: block_n {best['block_n']}, "
            f"{best['num_warps']} warps, {best['num_stages']} stages: {best['gbs']:.0f} GB/s"
        )

    eg = report["engine_greedy"]
    runs = eg.get("runs", [])
    figures = "; ".join(
        (f"{r['dtype']}: {r['exact_matches']}/{eg['prompts']} exact" + _gaps(r)) if r["ok"] else f"{r['dtype']}: error"
        for r in runs
    )
    lines.append(f"{'engine_greedy':<18} {status(eg):<8} {figures}")

    w64 = report["w64_throughput"]
    figures = "; ".join(
        f"{name}: " + (f"{best:.0f}" if best else "error")
        for name, best in w64.get("best_output_tok_s", {}).items()
    )
    figures = f"best out tok/s of each: {figures}" if figures else ""
    if "overlap_same_tokens" in w64:
        figures += f"; overlap gives the same tokens: {w64['overlap_same_tokens']}"
    lines.append(f"{'w64_throughput':<18} {status(w64):<8} {figures}")
    prof = report["w64_profile"]
    figures = f"{prof['ms_per_step']} ms per step over {prof['steps']} steps (profiled)" if prof.get("steps") else ""
    lines.append(f"{'w64_profile':<18} {status(prof):<8} {figures}")
    lines += _kv_quant_summary(report)
    for entry in bw.get("split_sweep", []):
        lines.append(f"{'decode_splits':<18} {'':<8} batch {entry['batch']} x {entry['context']}: planned "
                     f"{entry['planned_splits']}, best {entry['best_splits']}; GB/s by splits {entry['gbs']}")
    return lines


def _kv_quant_summary(report: dict) -> list[str]:
    kq, lines = report["kv_quant"], []
    state = "skipped" if kq.get("skipped") else ("ok" if kq.get("ok") else "FAILED")
    cases = kq.get("cases", [])
    bad = [c["case"] for c in cases if not c["ok"]]
    figures = f"{len(cases) - len(bad)}/{len(cases)} oracle cases pass" if cases else kq.get("error", "")[-200:]
    lines.append(f"{'kv_quant':<18} {state:<8} {figures}" + (f"; failing: {', '.join(bad)}" if bad else ""))
    for shape in kq.get("decode_timing", []):
        plain = [r for r in shape["runs"] if r.get("tiling") is None and "ms" in r]
        figures = ", ".join(f"{r['kv_format']} {r['ms']:.3f} ms ({r['gbs']:.0f} GB/s)" for r in plain)
        lines.append(f"{'kv_quant_decode':<18} {'':<8} {shape['shape']} batch {shape['batch']}: {figures}")
    w = report["w64_kv_quant"]
    figures = "; ".join(
        f"{r['kv_cache_dtype']}: " + (f"{r['output_tok_s']:.0f} out tok/s, {r['sequences_equal_to_auto']} equal"
                                      if r.get("ok") else ("skipped" if r.get("skipped") else "error"))
        for r in w.get("runs", []))
    state = "skipped" if w.get("skipped") else ("ok" if w.get("ok") else "FAILED")
    lines.append(f"{'w64_kv_quant':<18} {state:<8} {figures}")
    return lines


def _gaps(run: dict) -> str:
    gaps = [m["cpu_fp32_logprob_gap"] for m in run["mismatches"]]
    if not gaps:
        return ""
    return " (fp32 logprob gaps at divergence: " + ", ".join("n/a" if g is None else f"{g:.3f}" for g in gaps) + ")"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    sys.path.insert(0, str(REPO_ROOT))
    sys.path.insert(0, str(REPO_ROOT / "tests"))

    import torch
    import triton

    started = time.perf_counter()
    device = "cpu" if args.interpret else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --interpret to check this script on the CPU", file=sys.stderr)
        return 2
    ctx = {"torch": torch, "device": device, "interpret": args.interpret, "clock": Clock(torch, device),
           "model": args.model}
    report: dict = {"environment": _environment(torch, triton, device), "interpret": args.interpret}

    parts = [
        ("kernel_check", lambda: kernel_check(ctx), False),
        ("decode_bandwidth", lambda: decode_bandwidth(ctx), False),
        ("engine_greedy", lambda: engine_greedy(ctx), True),
        ("w64_throughput", lambda: w64_throughput(ctx, args.workload), True),
        ("w64_profile", lambda: w64_profile(ctx, args.workload), True),
        ("kv_quant", lambda: kv_quant(ctx), False),
        ("w64_kv_quant", lambda: w64_kv_quant(ctx, args.workload), True),
    ]
    for name, run, needs_engine in parts:
        elapsed = time.perf_counter() - started
        if name not in args.parts:
            report[name] = {"skipped": True, "reason": "not in --parts"}
        elif needs_engine and args.skip_engine:
            report[name] = {"skipped": True, "reason": "--skip-engine"}
        elif elapsed > args.time_budget:
            report[name] = {"skipped": True, "reason": f"time budget spent ({elapsed:.0f} s)"}
        else:
            t0 = time.perf_counter()
            try:
                report[name] = run()
            except Exception as exc:  # noqa: BLE001 - one part failing must not stop the rest
                report[name] = {"ok": False, "error": _describe(exc)}
            report[name]["seconds"] = round(time.perf_counter() - t0, 2)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))  # partial results survive a kill
    report["total_seconds"] = round(time.perf_counter() - started, 2)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print("\n".join(_summary_lines(report)))
    print(f"total {report['total_seconds']:.0f} s; figures in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
