"""Code written for vLLM runs on pagedllm with the import changed.

The slow tests are written the way vLLM's quickstart writes them; the fast ones
pin the translation of vLLM's engine arguments, the serve flags, the HTTP
options (CORS, chat template, generation defaults, max_logprobs) and that
docs/vllm-compat.md is what the code accepts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import json
import logging
import re
import ssl
import time

import httpx
import openai
import pytest
from server_fixture import FakeEngine, ServerProcess

from pagedllm import EngineConfig, vllm_compat
from pagedllm.cli import build_parser, engine_config_from_args
from pagedllm.config import IGNORED_ARGS, NO_OP_VALUES, translate_engine_args
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.errors import ConfigError, RequestError
from pagedllm.generation_config import default_sampling_fields
from pagedllm.kv.memory_budget import MemorySnapshot, kv_bytes_for_utilization
from pagedllm.models.paths import default_model_path
from pagedllm.sampling_params import SamplingParams
from pagedllm.server import launcher
from pagedllm.server.app import CorsSettings, build_app

GIB = 2**30


# ---------------------------------------------------------------------------
# Engine arguments
# ---------------------------------------------------------------------------


def test_vllm_units_and_spellings_become_engine_config_fields():
    config = EngineConfig(swap_space=4, kv_cache_memory_bytes=3 * 2**20, num_gpu_blocks_override=7,
                          dtype="half", max_logprobs=-1, gpu_memory_utilization=0.9)
    assert config.swap_space_bytes == 4 * GIB and config.swap_space == 4.0
    assert (config.kv_cache_memory, config.num_kv_blocks) == (3 * 2**20, 7)
    assert (config.dtype, config.max_logprobs, config.gpu_memory_utilization) == ("float16", None, 0.9)
    assert EngineConfig(swap_space=0.5).swap_space_bytes == GIB // 2
    # replace() passes fields by their own names and keeps the bytes as they are
    assert dataclasses.replace(config, seed=3).swap_space_bytes == 4 * GIB
    import torch

    assert EngineConfig(dtype=torch.bfloat16).dtype == "bfloat16" and EngineConfig(dtype="float").dtype == "float32"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpu_memory_utilisation": 0.9}, "did you mean 'gpu_memory_utilization'"),
        ({"swap_spaces": 4}, "did you mean 'swap_space'"),
        ({"max_num_seq": 8}, "did you mean 'max_num_seqs'"),
        ({"zzz_not_a_thing": 1}, "docs/vllm-compat.md"),
    ],
)
def test_unknown_engine_argument_names_it_and_the_closest_known_one(kwargs, message):
    (name,) = kwargs
    with pytest.raises(ConfigError, match=f"unknown engine argument '{name}'") as info:
        EngineConfig(**kwargs)
    assert message in str(info.value)


def test_unknown_argument_to_llm_fails_before_loading_a_model():
    from pagedllm import LLM

    start = time.monotonic()
    with pytest.raises(ConfigError, match="did you mean 'enforce_eager'"):
        LLM(model="/nonexistent.gguf", enforce_eagre=True)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"quantization": "awq"}, "quantization='awq'"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype='fp4'"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb=4"),
        ({"enable_lora": True}, "enable_lora=True"),
        ({"tokenizer": "/other/tokenizer"}, "tokenizer='/other/tokenizer'"),
    ],
)
def test_unsupported_values_of_known_arguments_say_not_supported_yet(kwargs, name):
    with pytest.raises(ConfigError, match="not supported yet") as info:
        EngineConfig(**kwargs)
    assert name in str(info.value)


def test_values_that_mean_what_pagedllm_does_are_accepted():
    config = EngineConfig(model="m.gguf", tensor_parallel_size=1, quantization=None, kv_cache_dtype="auto",
                          pipeline_parallel_size=1, cpu_offload_gb=0, enable_chunked_prefill=True,
                          tokenizer="m.gguf", load_format="gguf", enable_prefix_caching=False, seed=7,
                          enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256)
    assert (config.enable_prefix_caching, config.seed, config.max_num_seqs) == (False, 7, 8)
    assert (config.max_num_batched_tokens, config.max_model_len, config.enforce_eager) == (512, 256, True)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"swap_space": -1}, "swap_space"),
        ({"swap_space": "4GiB"}, "swap_space"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
        ({"max_logprobs": -2}, "max_logprobs"),
        ({"swap_space": 1, "swap_space_bytes": GIB}, "give one"),
        ({"kv_cache_memory": 10, "kv_cache_memory_bytes": 10}, "give one"),
        ({"preemption_mode": "swap"}, "swap_space"),
    ],
)
def test_bad_memory_arguments_are_config_errors(kwargs, param):
    with pytest.raises(ConfigError, match=param):
        EngineConfig(**kwargs)


def test_arguments_without_meaning_are_logged_once_each(caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        config = EngineConfig(trust_remote_code=True, tokenizer_mode="auto", disable_log_stats=True)
    lines = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(lines) == 3
    for name in ("trust_remote_code", "tokenizer_mode", "disable_log_stats"):
        assert sum(name in line for line in lines) == 1
    assert config == EngineConfig()


def test_every_accepted_name_is_known_and_nothing_else():
    for name in IGNORED_ARGS:
        assert translate_engine_args({name: True}) == {}
    for name, values in NO_OP_VALUES.items():
        assert translate_engine_args({name: values[0]}) == {}


# ---------------------------------------------------------------------------
# gpu_memory_utilization and max_logprobs
# ---------------------------------------------------------------------------


def test_kv_budget_is_the_share_left_after_weights_and_activations():
    snapshot = MemorySnapshot(memory_for_engine=80 * GIB, used_by_engine=10 * GIB, free=70 * GIB)
    assert kv_bytes_for_utilization(0.5, snapshot, activation_reserve=GIB) == 29 * GIB
    with pytest.raises(ConfigError, match="weights and runtime already take 10.00 GiB"):
        kv_bytes_for_utilization(0.1, snapshot, activation_reserve=GIB)
    crowded = MemorySnapshot(memory_for_engine=80 * GIB, used_by_engine=10 * GIB, free=20 * GIB)
    with pytest.raises(ConfigError, match="only 20.00 GiB is free"):
        kv_bytes_for_utilization(0.9, crowded, activation_reserve=GIB)


def test_max_logprobs_becomes_the_engines_request_limit():
    # LLMEngine's default limits come from the config; checked without a model here
    from pagedllm.limits import RequestLimits

    params = SamplingParams(logprobs=6)
    params.check_limits(RequestLimits(max_logprobs=6), vocab_size=100)
    with pytest.raises(RequestError, match="must be <= 5") as info:
        params.check_limits(RequestLimits(max_logprobs=EngineConfig(max_logprobs=5).max_logprobs), vocab_size=100)
    assert info.value.param == "logprobs"
    assert EngineConfig(max_logprobs=-1).max_logprobs is None
    with pytest.raises(ConfigError, match="max_logprobs"):
        EngineConfig(max_logprobs=0)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_serve_takes_the_model_positionally_and_vllm_flags():
    args = _serve_args("model.gguf", "--gpu-memory-utilization", "0.8", "--swap-space", "4",
                       "--kv-cache-memory-bytes", "1GiB", "--max-logprobs", "7", "--trust-remote-code",
                       "--tensor-parallel-size", "1", "--num-gpu-blocks-override", "64", "--dtype", "half")
    assert launcher._model_argument(args) == "model.gguf"
    config = engine_config_from_args(args)
    assert (config.gpu_memory_utilization, config.swap_space_bytes, config.kv_cache_memory) == (0.8, 4 * GIB, GIB)
    assert (config.max_logprobs, config.num_kv_blocks, config.dtype) == (7, 64, "float16")
    assert launcher.limits_from_args(args)[0].max_logprobs == 7  # the server's request limit agrees
    assert engine_config_from_args(_serve_args("--swap-space", "512MiB")).swap_space_bytes == 512 * 2**20
    assert launcher._model_argument(_serve_args("--model", "a.gguf")) == "a.gguf"
    assert launcher._model_argument(_serve_args("a.gguf", "--model", "a.gguf")) == "a.gguf"
    with pytest.raises(ConfigError, match="given twice"):
        launcher._model_argument(_serve_args("a.gguf", "--model", "b.gguf"))
    with pytest.raises(ConfigError, match="not supported yet"):
        engine_config_from_args(_serve_args("--pipeline-parallel-size", "2"))


def test_serve_tls_cors_and_chat_template_flags(tmp_path):
    with pytest.raises(ConfigError, match="both --ssl-keyfile and --ssl-certfile"):
        launcher._tls_files(_serve_args("--ssl-keyfile", "k.pem"))
    with pytest.raises(ConfigError, match="no such file"):
        launcher._tls_files(_serve_args("--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"))
    with pytest.raises(ConfigError, match="--ssl-cert-reqs needs --ssl-keyfile"):
        launcher._tls_files(_serve_args("--ssl-cert-reqs", "2"))
    with pytest.raises(ConfigError, match="--ssl-cert-reqs 2 needs --ssl-ca-certs"):
        launcher._tls_files(_serve_args("--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"))
    files = [tmp_path / name for name in ("k.pem", "c.pem", "ca.pem")]
    for f in files:
        f.write_text("-")
    tls = launcher._tls_files(_serve_args("--ssl-keyfile", str(files[0]), "--ssl-certfile", str(files[1]),
                                          "--ssl-ca-certs", str(files[2]), "--ssl-cert-reqs", "2"))
    assert tls["ssl_cert_reqs"] == 2 and tls["ssl_ca_certs"] == str(files[2])
    assert launcher._cors_settings(_serve_args()) is None
    cors = launcher._cors_settings(_serve_args("--allowed-origins", '["https://a.example"]', "--allow-credentials"))
    assert cors == CorsSettings(("https://a.example",), ("*",), ("*",), True)
    listed = launcher._cors_settings(_serve_args("--allowed-origins", "https://a.example, https://b.example",
                                                 "--allowed-methods", "GET,POST"))
    assert listed.allowed_origins == ("https://a.example", "https://b.example")
    assert listed.allowed_methods == ("GET", "POST")
    with pytest.raises(ConfigError, match="--allowed-origins"):
        launcher._cors_settings(_serve_args("--allow-credentials"))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert launcher.load_chat_template(str(template)) == template.read_text()
    assert launcher.load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        launcher.load_chat_template("missing.jinja")


# ---------------------------------------------------------------------------
# --generation-config
# ---------------------------------------------------------------------------


def test_generation_config_from_a_folder_or_vllm_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64, "do_sample": True, "eos_token_id": 2}
    ))
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    assert default_sampling_fields(tmp_path, "auto") == expected
    assert default_sampling_fields(default_model_path(), str(tmp_path)) == expected
    assert default_sampling_fields(tmp_path, "vllm") == {}
    with pytest.raises(ConfigError, match="not 'auto', 'vllm' or a folder"):
        default_sampling_fields(tmp_path, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no generation_config.json"):
        default_sampling_fields(default_model_path(), str(tmp_path / ".."))


def test_override_generation_config_sets_keys_over_the_defaults(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    override = {"temperature": 0.2, "max_new_tokens": 16, "do_sample": True}
    assert default_sampling_fields(tmp_path, "auto", override) == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 16}
    assert "do_sample ignored" in caplog.text  # vLLM reads six keys; the others are named, not fatal
    assert default_sampling_fields(tmp_path, "vllm", override) == {"temperature": 0.2, "max_tokens": 16}
    with pytest.raises(ConfigError, match="must be numbers"):
        default_sampling_fields(tmp_path, "vllm", {"temperature": "warm"})
    with pytest.raises(ConfigError, match="override_generation_config must be a dict"):
        EngineConfig(override_generation_config=[("temperature", 0.2)])


def test_override_generation_config_reaches_the_default_sampling_params():
    from pagedllm import LLM

    llm = LLM(kv_cache_memory=64 * 2**20, override_generation_config={"temperature": 0.3, "top_k": 7})
    params = llm.get_default_sampling_params()
    assert params.temperature == 0.3 and params.top_k == 7


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"guided_decoding_backend": "xgrammar"}, None),
    ({"guided_decoding_backend": "auto"}, None),
    ({"structured_outputs_config": {"backend": "xgrammar"}}, None),
    ({"structured_outputs_config": {}}, None),
    ({"guided_decoding_backend": "outlines"}, "use 'auto' or 'xgrammar', got 'outlines'"),
    ({"structured_outputs_config": {"backend": "guidance"}}, "use 'auto' or 'xgrammar', got 'guidance'"),
    ({"structured_outputs_config": {"backend": "xgrammar", "reasoning_parser": "deepseek_r1"}},
     "only 'backend' is supported here, got ['reasoning_parser']"),
])
def test_the_structured_outputs_backend_is_xgrammar_or_refused(kwargs, error):
    if error is None:
        EngineConfig(**kwargs)
    else:
        with pytest.raises(ConfigError, match=re.escape(error)):
            EngineConfig(**kwargs)


def test_generation_config_from_gguf_metadata(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_uint32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert default_sampling_fields(path, "auto") == {"temperature": 0.25, "top_k": 40, "repetition_penalty": 1.5}
    assert default_sampling_fields(default_model_path(), "auto") == {}  # SmolLM2's GGUF sets none


# ---------------------------------------------------------------------------
# The HTTP app over a fake engine: CORS, chat template, defaults, max_logprobs
# ---------------------------------------------------------------------------


class RecordingEngine(FakeEngine):
    """The fake engine, remembering the params and prompt of every request."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[list[int], object]] = []

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        self.seen.append((list(prompt["prompt_token_ids"]), params))
        super().add_request(request_id, prompt, params, **kwargs)


def _with_app(check, fake: FakeEngine | None = None, **app_options):
    async def main():
        engine = AsyncLLMEngine(fake or FakeEngine())
        app = build_app(engine, **app_options)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                await check(client)
        finally:
            await engine.shutdown(0)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_cors_headers_only_when_enabled():
    preflight = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST"}

    async def off(client):
        r = await client.get("/health", headers={"Origin": "https://a.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = await client.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers

    async def on(client):
        r = await client.get("/health", headers={"Origin": "https://a.example"})
        assert r.headers["access-control-allow-origin"] == "https://a.example"
        r = await client.options("/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://a.example"
        other = await client.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers

    _with_app(off)
    _with_app(on, cors=CorsSettings(allowed_origins=("https://a.example",)))


def test_chat_template_override_and_generation_defaults_reach_requests():
    fake = RecordingEngine()
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"

    async def check(client):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0.9})
        assert r.status_code == 200

    class TemplateTokenizer(type(fake.tokenizer)):
        def apply_chat_template(self, messages, add_generation_prompt=True, chat_template=None):
            import jinja2

            return jinja2.Template(chat_template).render(messages=messages)

    fake.tokenizer = TemplateTokenizer()
    _with_app(check, fake, chat_template=template, default_sampling={"temperature": 0.3, "top_k": 5, "max_tokens": 9})
    (chat_ids, chat_params), (_, completion_params) = fake.seen
    assert fake.tokenizer.decode(chat_ids) == "<<hi>>"
    assert (chat_params.temperature, chat_params.top_k, chat_params.max_tokens) == (0.3, 5, 2)
    # a field the request sets wins over the default
    assert (completion_params.temperature, completion_params.top_k) == (0.9, 5)


# ---------------------------------------------------------------------------
# docs/vllm-compat.md
# ---------------------------------------------------------------------------


def test_the_compat_table_is_current():
    assert vllm_compat.DOC_PATH.read_text() == vllm_compat.render(), (
        "docs/vllm-compat.md is out of date: run python -m pagedllm.vllm_compat --write"
    )


def test_the_compat_table_matches_what_the_code_accepts():
    for row in vllm_compat.engine_rows():
        if row.status == vllm_compat.MISSING:
            with pytest.raises(ConfigError, match="unknown engine argument"):
                EngineConfig(**{row.name: None})
        else:
            value = NO_OP_VALUES[row.name][0] if row.name in NO_OP_VALUES else _default_of(row.name)
            EngineConfig(**{row.name: value})
    parser = vllm_compat.serve_parser()
    for row in vllm_compat.serve_rows():
        if row.name.startswith("--") and row.status != vllm_compat.MISSING:
            action = next(a for a in parser._actions if row.name in a.option_strings)
            assert action.help != "==SUPPRESS==", row.name
    statuses = {r.name: r.status for r in vllm_compat.serve_rows()}
    for flag in ("MODEL (positional)", "--ssl-keyfile", "--allowed-origins", "--chat-template",
                 "--generation-config", "--root-path", "--uvicorn-log-level", "--gpu-memory-utilization"):
        assert statuses[flag] != vllm_compat.MISSING, flag


def _default_of(name: str):
    from pagedllm.config import RENAMED_ARGS

    if name in IGNORED_ARGS:
        return "anything"
    defaults = {"swap_space": 0, "kv_cache_memory_bytes": 2**20, "num_gpu_blocks_override": 8,
                "gpu_memory_utilization": 0.9, "guided_decoding_backend": "xgrammar",
                "structured_outputs_config": {"backend": "xgrammar"}}
    if name in defaults:
        return defaults[name]
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == RENAMED_ARGS.get(name, name))
    return field.default


# ---------------------------------------------------------------------------
# End to end, as a vLLM user writes it
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_vllm_quickstart_runs_with_the_import_changed(caplog):
    from pagedllm import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams
    from pagedllm.sampling_params import BeamSearchParams  # was: vllm.sampling_params

    model = str(default_model_path())
    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=0)
    caplog.set_level(logging.INFO, logger="pagedllm")
    llm = LLM(model=model, gpu_memory_utilization=UTILIZATION, swap_space=1, max_model_len=512, max_num_seqs=8,
              enforce_eager=True, trust_remote_code=True, seed=0, max_logprobs=5)

    outputs = llm.generate(prompts, sampling_params)
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        generated_text = output.outputs[0].text
        assert generated_text and output.outputs[0].finish_reason in ("stop", "length")

    chat = llm.chat([{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in chat[0].outputs[0].text

    beams = llm.beam_search([{"prompt": "The capital of France is"}], BeamSearchParams(beam_width=2, max_tokens=8))
    best = beams[0].sequences[0]
    assert best.text.startswith("The capital of France is") and len(beams[0].sequences) == 2
    assert best.text == "The capital of France is" + beams[0].outputs[0].text

    # the swap pool is the GiB asked for, to one block
    engine = llm.llm_engine
    kv = engine.kv_cache
    per_block = 2 * engine.model_config.num_layers * kv.block_size * engine.model_config.num_kv_heads \
        * engine.model_config.head_dim * kv.layers[0][0].element_size()
    assert GIB - per_block < kv.num_cpu_blocks * per_block <= GIB
    # the KV cache is the share of the RAM other processes leave, less what the engine held
    # then (weights and runtime) and an activation reserve, rounded down to whole blocks
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpu_memory_utilization=")]
    kv_budget, memory_for_engine, used, reserve = (int(n) for n in re.findall(r"(?<![.\d])\d{4,}", line))
    assert kv_budget == int(UTILIZATION * memory_for_engine) - used - reserve
    assert kv.num_blocks == kv_budget // per_block and kv.num_blocks * per_block != 4 * GIB
    assert used < memory_for_engine <= _mem_total() + used

    # max_logprobs is enforced; up to it, logprobs come back
    with pytest.raises(RequestError, match="must be <= 5"):
        llm.generate("Hi", SamplingParams(logprobs=6, max_tokens=2))
    (out,) = llm.generate("Hi", SamplingParams(logprobs=5, max_tokens=2))
    assert all(len(position) >= 5 for position in out.outputs[0].logprobs)


UTILIZATION = 0.5


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024


def _make_certificates(directory):
    """A CA, and a server certificate for 127.0.0.1 and a client certificate signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pagedllm test CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                    x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pagedllm test client")]))
        .issuer_name(ca_name).public_key(client_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = {name: directory / f"{name}.pem" for name in ("ca", "cert", "key", "client_cert", "client_key")}
    paths["ca"].write_bytes(ca_cert.public_bytes(pem))
    paths["cert"].write_bytes(server_cert.public_bytes(pem))
    paths["client_cert"].write_bytes(client_cert.public_bytes(pem))
    for name, key in (("key", server_key), ("client_key", client_key)):
        paths[name].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


@pytest.mark.slow
def test_serve_https_with_the_official_client(tmp_path, tiny_default_tokenizer_model):
    # TLS, CORS, --root-path, a --chat-template file and the positional model argument do not
    # depend on the weights: conftest's 2-layer random Llama with the default model's tokenizer.
    certs = _make_certificates(tmp_path)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:")
    server = ServerProcess(
        str(tiny_default_tokenizer_model), "--ssl-keyfile", str(certs["key"]), "--ssl-certfile", str(certs["cert"]),
        "--num-kv-blocks", "256", "--max-num-seqs", "4", "--chat-template", str(template),
        "--allowed-origins", '["https://app.example"]', "--root-path", "/api", "--uvicorn-log-level", "warning",
    )
    https = f"https://127.0.0.1:{server.port}"
    trusted = ssl.create_default_context(cafile=str(certs["ca"]))
    try:
        _wait_healthy(server, https, trusted)
        client = openai.OpenAI(base_url=f"{https}/v1", api_key="unused", max_retries=0, timeout=120,
                               http_client=httpx.Client(verify=trusted))
        completion = client.completions.create(model=tiny_default_tokenizer_model.name, prompt="The capital of France is",
                                               max_tokens=4, temperature=0)
        assert completion.choices[0].text
        tokens = httpx.post(f"{https}/tokenize", verify=trusted,
                            json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
        detok = httpx.post(f"{https}/detokenize", verify=trusted, json={"tokens": tokens}).json()
        assert detok["prompt"] == "Q: Hi\nA:"  # the --chat-template file, not the model's ChatML
        cors = httpx.get(f"{https}/health", verify=trusted, headers={"Origin": "https://app.example"})
        assert cors.headers["access-control-allow-origin"] == "https://app.example"
        assert httpx.get(f"{https}/openapi.json", verify=trusted).json()["servers"] == [{"url": "/api"}]
        # plain HTTP is refused, and so is HTTPS without trusting the test CA
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
        untrusting = openai.OpenAI(base_url=f"{https}/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.APIConnectionError):
            untrusting.models.list()
    finally:
        # `client` still holds an idle keep-alive TLS connection: closing it must not wait for
        # a close_notify the client never sends (asyncio's 30 s SSL shutdown timeout)
        stopping = time.monotonic()
        code = server.stop()
        stop_s = time.monotonic() - stopping
    assert code == 0, server.log()
    assert stop_s < 10, f"SIGTERM took {stop_s:.1f} s with an idle HTTPS client connected\n{server.log()}"


def _wait_healthy(server: ServerProcess, url: str, trusted: ssl.SSLContext, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{url}/health", verify=trusted, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.kill()
    raise RuntimeError(f"the server did not become healthy over HTTPS in {timeout} s:\n{server.log()}")


@pytest.mark.slow
def test_serve_requires_client_certificates_with_ssl_cert_reqs_2(tmp_path, tiny_default_tokenizer_model):
    """Mutual TLS as vLLM's --ssl-cert-reqs 2: a client with a certificate the CA signed gets in, one
    without is refused in the handshake."""
    certs = _make_certificates(tmp_path)
    server = ServerProcess(
        str(tiny_default_tokenizer_model), "--ssl-keyfile", str(certs["key"]), "--ssl-certfile", str(certs["cert"]),
        "--ssl-ca-certs", str(certs["ca"]), "--ssl-cert-reqs", "2", "--num-kv-blocks", "64", "--max-num-seqs", "2",
    )
    https = f"https://127.0.0.1:{server.port}"
    with_cert = ssl.create_default_context(cafile=str(certs["ca"]))
    with_cert.load_cert_chain(str(certs["client_cert"]), str(certs["client_key"]))
    without = ssl.create_default_context(cafile=str(certs["ca"]))
    try:
        _wait_healthy(server, https, with_cert)
        assert httpx.get(f"{https}/v1/models", verify=with_cert, timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{https}/v1/models", verify=without, timeout=10)
    finally:
        assert server.stop() == 0, server.log()
