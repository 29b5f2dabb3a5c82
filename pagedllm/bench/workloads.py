"""Benchmark workloads: prompts as token ids plus a fixed output length.

Every benchmark sends prompts as token ids, so that every backend (pagedllm,
HF transformers, vLLM, an HTTP server) sees exactly the same tokens, and asks
for exactly ``output_len`` new tokens each (greedy, ``ignore_eos``).

Sources: a workload JSON file (the shape of ``shared/workloads/w64.json``),
a JSONL dataset (one ``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}``
per line) or random token ids.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pagedllm.cli import bounded
from pagedllm.errors import ConfigError

# SmolLM2's vocabulary; random prompts stay inside it.
DEFAULT_VOCAB_SIZE = 49152
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4


@dataclass
class Workload:
    """``prompt_token_ids[i]`` is request i's prompt; every request generates ``output_len`` tokens."""

    name: str
    prompt_token_ids: list[list[int]]
    output_len: int
    ignore_eos: bool = True

    @property
    def num_requests(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the workload asks for (exact, as every request ignores EOS)."""
        return self.num_requests * self.output_len

    @property
    def max_seq_len(self) -> int:
        return max(len(p) for p in self.prompt_token_ids) + self.output_len

    def subset(self, num_requests: int | None) -> Workload:
        if num_requests is None or num_requests >= self.num_requests:
            return self
        return Workload(
            f"{self.name}[:{num_requests}]", self.prompt_token_ids[:num_requests], self.output_len, self.ignore_eos
        )

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "output_len": self.output_len,
            "ignore_eos": self.ignore_eos,
            "prompt_token_ids": self.prompt_token_ids,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    def describe(self) -> str:
        lens = [len(p) for p in self.prompt_token_ids]
        return (
            f"{self.name}: {self.num_requests} requests, prompts {min(lens)}-{max(lens)} tokens "
            f"({self.num_prompt_tokens} in all), {self.output_len} output tokens each"
        )


def default_workload_path() -> Path:
    """``shared/workloads/w64.json`` beside the repository (it may not exist)."""
    repo_root = Path(__file__).resolve().parents[2]
    return repo_root.parent / "shared" / "workloads" / "w64.json"


def load_workload(path: str | Path, output_len: int | None = None) -> Workload:
    """Read a workload JSON file; ``output_len`` overrides the file's."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"workload file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
        prompts = [list(map(int, p)) for p in data["prompt_token_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path} is not a workload file: it needs 'prompt_token_ids' (a list of lists of ints)"
        ) from exc
    out_len = output_len if output_len is not None else int(data.get("output_len", 128))
    name = data.get("name") or path.stem
    return _checked(Workload(name, prompts, out_len, bool(data.get("ignore_eos", True))))


def load_jsonl_dataset(path: str | Path, output_len: int, tokenizer=None) -> Workload:
    """One request per line: ``prompt_token_ids`` or ``prompt`` (text, needs ``tokenizer``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"dataset file {str(path)!r} does not exist")
    prompts: list[list[int]] = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path}:{line_no} is not JSON") from exc
        if "prompt_token_ids" in record:
            prompts.append([int(t) for t in record["prompt_token_ids"]])
        elif "prompt" in record:
            if tokenizer is None:
                tokenizer = _default_tokenizer()
            prompts.append(tokenizer.encode(record["prompt"]))
        else:
            raise ConfigError(f"{path}:{line_no} needs 'prompt_token_ids' or 'prompt'")
    return _checked(Workload(path.stem, prompts, output_len))


def random_workload(
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len: int,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Workload:
    """Prompt lengths uniform in ``input_len_range`` (inclusive), token ids uniform in the vocabulary."""
    low, high = input_len_range
    if not 1 <= low <= high:
        raise ConfigError(f"input length range {low}:{high} must satisfy 1 <= A <= B")
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(rng.randint(low, high))] for _ in range(num_prompts)
    ]
    return _checked(Workload(f"random-{num_prompts}x{low}:{high}", prompts, output_len))


def warmup_prompts(count: int = 3, max_len: int | None = None, seed: int = 1234) -> list[list[int]]:
    """A few prompts of growing length (16, 64, 256, ...) that touch the prefill and decode
    paths at several shapes before timing starts (the first calls of a shape are slow)."""
    rng = random.Random(seed)
    lengths = [WARMUP_PROMPT_LEN * 4**i for i in range(count)]
    if max_len is not None:
        lengths = [max(1, min(n, max_len)) for n in lengths]
    return [[rng.randrange(DEFAULT_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def _checked(workload: Workload) -> Workload:
    if workload.num_requests == 0:
        raise ConfigError(f"workload {workload.name!r} has no prompts")
    if workload.output_len < 1:
        raise ConfigError(f"output length must be >= 1, got {workload.output_len}")
    if any(len(p) == 0 for p in workload.prompt_token_ids):
        raise ConfigError(f"workload {workload.name!r} has an empty prompt")
    return workload


def _default_tokenizer():
    from pagedllm.models.paths import default_model_path
    from pagedllm.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path())


# ---- command-line options ---------------------------------------------------


def parse_range(text: str) -> tuple[int, int]:
    """'32:512' -> (32, 512); '128' -> (128, 128)."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B (two integers)") from exc
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"{text!r} must be A:B with 1 <= A <= B")
    return parts[0], parts[1]


_positive_int = bounded(int, 1)


def add_workload_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_workload: bool,
    default_num_prompts: int,
    default_output_len: int | None,
    with_seed: bool,
) -> None:
    """``--workload`` / ``--dataset`` and the random-dataset knobs.

    With ``default_workload`` the shared W64 file is used when neither
    ``--workload`` nor ``--dataset`` is given (and it exists).
    """
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", default=None, help="workload JSON file (prompt_token_ids, output_len)")
    g.add_argument(
        "--dataset", default=None,
        help="'random', or a JSONL file with prompt_token_ids or prompt per line",
    )
    g.add_argument("--num-prompts", type=_positive_int, default=None, help=f"number of requests (random: {default_num_prompts}; files: a prefix)")
    g.add_argument("--input-len-range", type=parse_range, default=None, help="random prompt lengths A:B, inclusive")
    g.add_argument("--input-len", type=_positive_int, default=None, help="random prompt length (same as A:A)")
    g.add_argument("--output-len", type=_positive_int, default=default_output_len, help="new tokens per request")
    if with_seed:
        g.add_argument("--seed", type=int, default=0, help="seed of the random dataset and arrivals")
    parser.set_defaults(_default_workload=default_workload, _default_num_prompts=default_num_prompts)


def workload_from_args(args: argparse.Namespace) -> Workload:
    """Build the workload that the workload options describe."""
    if args.workload and args.dataset:
        raise ConfigError("give either --workload or --dataset, not both")
    path = args.workload
    if path is None and args.dataset is None and args._default_workload and default_workload_path().is_file():
        path = default_workload_path()
    if path is not None:
        return load_workload(path, args.output_len).subset(args.num_prompts)
    output_len = args.output_len if args.output_len is not None else 128
    if args.dataset not in (None, "random"):
        return load_jsonl_dataset(args.dataset, output_len).subset(args.num_prompts)
    if args.input_len is not None:
        length_range = (args.input_len, args.input_len)
    else:
        length_range = args.input_len_range or (32, 512)
    num_prompts = args.num_prompts if args.num_prompts is not None else args._default_num_prompts
    return random_workload(num_prompts, length_range, output_len, seed=args.seed)
