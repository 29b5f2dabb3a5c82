import os
import sys

# Without a GPU, Triton kernels run in its CPU interpreter. The mode is fixed
# when a kernel is defined, so it must be set before anything imports triton.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test`) each worker process takes one core's share of the
# machine: a worker's own torch and native kernels run on one thread unless a test asks
# for more, so two workers on two cores do not oversubscribe them. Servers and engines
# that tests start in their own processes keep their defaults.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

_kernels_reimported = False


def use_triton_interpreter() -> None:
    """Without CUDA, run Triton kernels in the interpreter. triton.jit picks interpreted or
    compiled mode when a kernel is defined, so kernel modules imported earlier in this process
    are dropped and re-imported -- once per process: a second purge would leave the test files
    collected before it holding classes that are no longer the ones in sys.modules."""
    global _kernels_reimported
    if torch.cuda.is_available() or _kernels_reimported:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    for name in [m for m in sys.modules if m.startswith("pagedllm.attention.kernels.")]:
        del sys.modules[name]
    sys.modules.pop("pagedllm.attention.triton_backend", None)
    _kernels_reimported = True


# Nothing may reach a model hub: the reference models load from local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# tests import helpers such as tests/attention_reference.py as top-level modules
sys.path.insert(0, os.path.dirname(__file__))

import functools  # noqa: E402


def skip_if_interpreter_too_old(triton) -> None:
    """Triton's CPU interpreter before 3.7 fails on a loop bound loaded from memory
    ("only 0-dimensional arrays can be converted to Python scalars"), which every
    kernel here has; compiled kernels on a GPU are not affected."""
    import pytest

    major_minor = tuple(int(part) for part in triton.__version__.split(".")[:2])
    if os.environ.get("TRITON_INTERPRET") == "1" and major_minor < (3, 7):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run the kernels; install triton>=3.7",
                    allow_module_level=True)

import pytest  # noqa: E402


class HFReference:
    """HF transformers on the default model's GGUF, fp32: the oracle for model outputs."""

    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pagedllm.models.paths import default_model_path

        path = default_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        self.model.eval()
        self.eos_token_id = self.tokenizer.eos_token_id

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one instance per session)
    def greedy(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        """Greedy continuation, stopping at EOS like the engine does (EOS included)."""
        ids = torch.tensor([list(prompt_ids)])
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=max_new_tokens, pad_token_id=self.eos_token_id,
            )
        return out[0, len(prompt_ids):].tolist()

    def beam(self, prompt_ids: list[int], width: int, max_new_tokens: int, length_penalty=1.0,
             early_stopping=False) -> list[list[int]]:
        ids = torch.tensor([list(prompt_ids)])
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
                num_return_sequences=width, max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                early_stopping=early_stopping, pad_token_id=self.eos_token_id,
            )
        result = []
        for row in out.tolist():
            gen = row[len(prompt_ids):]
            # generate pads finished beams after EOS; the hypothesis ends at its EOS
            if self.eos_token_id in gen:
                gen = gen[: gen.index(self.eos_token_id) + 1]
            result.append(gen)
        return result


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    return HFReference()


def make_tiny_default_tokenizer_llama(directory) -> None:
    """A 2-layer random-weight Llama in HF format (safetensors) with the default model's own
    tokenizer and chat template: fast to load and to run, while prompts, chat templating and
    token counts are exactly those of the default model."""
    import shutil
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.models.paths import default_model_path
    from pagedllm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model_path())
    for name in os.listdir(tokenizer.source):
        shutil.copy(Path(tokenizer.source) / name, Path(directory) / name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


@pytest.fixture(scope="session")
def tiny_default_tokenizer_model(tmp_path_factory):
    """Directory of :func:`make_tiny_default_tokenizer_llama`'s model, made once per session."""
    directory = tmp_path_factory.mktemp("tiny-llama-default-tokenizer")
    make_tiny_default_tokenizer_llama(directory)
    return directory
