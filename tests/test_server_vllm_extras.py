"""vLLM's request extras and server flags on a real server (the official openai client):
chat_template_kwargs, the chat template's extra variables, on /v1/chat/completions and /tokenize
(a --chat-template that reads them) and on LLM.chat, where names the request sets another way are
refused; return_tokens_as_token_ids, as a server flag and per request; add_special_tokens (on a
tokenizer that adds a BOS); priority (this server has only first come, first served); and the
flags vLLM's command lines carry (--enable-auto-tool-choice --tool-call-parser hermes,
--response-role, --disable-fastapi-docs, --disable-uvicorn-access-log,
--enable-prompt-tokens-details, --chat-template-content-format string); a request's own chat_template
on a server that trusts it; request_id and X-Request-Id headers; documents for the template."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_fixture import ServerProcess

from pagedllm.chat import template_kwargs
from pagedllm.errors import RequestError

TEMPLATE = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}[no thinking]{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{{ greeting | default('hello') }}, assistant:")
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _with_bos(model: Path, directory: Path) -> Path:
    """A copy of ``model`` whose tokenizer puts a BOS (<|endoftext|>, id 0) before every text it
    encodes with special tokens, as many models' tokenizers do: add_special_tokens then counts."""
    for entry in model.iterdir():
        shutil.copy(entry, directory / entry.name)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


@pytest.fixture(scope="module")
def server(tiny_default_tokenizer_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(TEMPLATE)
    model = _with_bos(Path(tiny_default_tokenizer_model), tmp_path_factory.mktemp("tiny-with-bos"))
    proc = ServerProcess(str(model), "--served-model-name", "tiny", "--num-kv-blocks", "128",
                         "--max-num-seqs", "4", "--max-model-len", "256", "--chat-template", str(template),
                         "--return-tokens-as-token-ids", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--response-role", "model", "--disable-fastapi-docs", "--disable-uvicorn-access-log",
                         "--enable-prompt-tokens-details", "--trust-request-chat-template",
                         "--chat-template-content-format", "string", "--enable-request-id-headers")
    try:
        yield proc.wait_ready()
    finally:
        code = proc.stop()
    assert code == 0, proc.log()


def _rendered(server, **body) -> str:
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES, **body}, timeout=30).json()["tokens"]
    return httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]


def test_the_template_sees_the_kwargs(server):
    assert _rendered(server) == "user: Name a colour.\nhello, assistant:"
    assert _rendered(server, chat_template_kwargs={"greeting": "ahoy", "enable_thinking": False}) == (
        "[no thinking]user: Name a colour.\nahoy, assistant:")


def test_a_chat_completion_renders_with_them(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = {"greeting": "a much longer greeting than hello", "enable_thinking": False}
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    given = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0,
                                           extra_body={"chat_template_kwargs": kwargs})
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": kwargs},
                        timeout=30).json()["count"]
    assert given.usage.prompt_tokens == tokens > plain.usage.prompt_tokens


@pytest.mark.parametrize("kwargs, says", [
    ({"messages": []}, "'messages' is set by the request itself"),
    ({"add_generation_prompt": False}, "'add_generation_prompt' is set by the request itself"),
    ({"not a name": 1}, "is not a template variable name"),
    ({f"v{i}": i for i in range(65)}, "at most 64 names"),
])
def test_names_the_request_sets_another_way_are_a_400(server, kwargs, says):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template_kwargs": kwargs})
    assert info.value.body["param"] == "chat_template_kwargs" and says in info.value.body["message"]


def test_the_offline_api_checks_them_the_same_way():
    assert template_kwargs(None) == {} and template_kwargs({"enable_thinking": True}) == {"enable_thinking": True}
    for bad in ({"tools": []}, {"1x": 0}, ["greeting"]):
        with pytest.raises(RequestError) as info:
            template_kwargs(bad)
        assert info.value.param == "chat_template_kwargs"


def test_logprobs_name_tokens_by_id_as_the_server_flag_says_unless_the_request_does(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    by_id = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=3, temperature=0,
                                      logprobs=2)
    texts = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=3, temperature=0,
                                      logprobs=2, extra_body={"return_tokens_as_token_ids": False})
    ids = [int(t.removeprefix("token_id:")) for t in by_id.choices[0].logprobs.tokens]
    pieces = [httpx.post(f"{server.base_url}/detokenize", json={"tokens": [t]}, timeout=30).json()["prompt"] for t in ids]
    assert texts.choices[0].logprobs.tokens == pieces and "".join(pieces) == texts.choices[0].text
    assert all(k.startswith("token_id:") for top in by_id.choices[0].logprobs.top_logprobs for k in top)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2)
    assert all(c.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in c.top_logprobs)
               for c in chat.choices[0].logprobs.content)


def test_a_tool_call_parser_pagedllm_does_not_have_stops_the_start_up(tiny_default_tokenizer_model):
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", str(tiny_default_tokenizer_model),
                           "--tool-call-parser", "mistral"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tool-call-parser" in done.stderr and "hermes" in done.stderr


def test_add_special_tokens_as_vllm_defaults_them(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with_bos = client.completions.create(model="tiny", prompt="hello", max_tokens=1)
    without = client.completions.create(model="tiny", prompt="hello", max_tokens=1,
                                        extra_body={"add_special_tokens": False})
    assert (with_bos.usage.prompt_tokens, without.usage.prompt_tokens) == (2, 1)  # BOS + "hello"; "hello"
    rendered = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["count"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    chat_bos = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                              extra_body={"add_special_tokens": True})
    assert (chat.usage.prompt_tokens, chat_bos.usage.prompt_tokens) == (rendered, rendered + 1)


def test_the_response_role_and_no_docs(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices[0].message.role == "model"
    first = next(iter(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=True)))
    assert first.choices[0].delta.role == "model"
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.base_url}{path}", timeout=30).status_code == 404


def test_priority_other_than_0_is_a_400(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body={"priority": 0}).choices
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body={"priority": 5})
    assert info.value.body["param"] == "priority" and "first come, first served" in info.value.body["message"]


def test_custom_logits_processors_are_a_400_and_vllm_xargs_are_checked(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    for route in ("completions", "chat"):
        create = (lambda **kw: client.completions.create(prompt="hi", **kw)) if route == "completions" else (
            lambda **kw: client.chat.completions.create(messages=MESSAGES, **kw))
        with pytest.raises(openai.BadRequestError) as info:
            create(model="tiny", max_tokens=1, extra_body={"logits_processors": ["my.module:Processor"]})
        assert info.value.body["param"] == "logits_processors" and "no custom logits processors" in info.value.body["message"]
        # an empty list asks for nothing; vllm_xargs are checked and carried (SamplingParams.extra_args)
        assert create(model="tiny", max_tokens=1, extra_body={"logits_processors": [], "vllm_xargs": {"k": [1, "a"]}})
        with pytest.raises(openai.BadRequestError) as info:
            create(model="tiny", max_tokens=1, extra_body={"vllm_xargs": {"k": 2**70}})
        assert info.value.body["param"] == "vllm_xargs" and "2**64" in info.value.body["message"]


def test_a_trusting_server_renders_a_requests_own_chat_template(server):
    own = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    assert _rendered(server, chat_template=own) == "<<Name a colour.>>"
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                          extra_body={"chat_template": own})
    count = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES, "chat_template": own},
                       timeout=30).json()["count"]
    assert chat.usage.prompt_tokens == count


def test_request_ids_name_the_response_and_come_back_in_a_header(server):
    url = f"{server.base_url}/v1/completions"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    named = httpx.post(url, json={**body, "request_id": "job-7.a"}, timeout=60)
    assert named.json()["id"] == "cmpl-job-7.a" and len(named.headers["x-request-id"]) == 32  # a new one
    headed = httpx.post(url, json={**body, "request_id": "job-7.a"}, headers={"X-Request-Id": "from-header"}, timeout=60)
    assert headed.json()["id"] == "cmpl-from-header" and headed.headers["x-request-id"] == "from-header"
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "request_id": "c1"})
    assert chat.json()["id"] == "chatcmpl-c1"
    bad = httpx.post(url, json={**body, "request_id": "has space"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_vllms_openai_content_format_stops_the_start_up(tiny_default_tokenizer_model):
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", str(tiny_default_tokenizer_model),
                           "--chat-template-content-format", "openai"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--chat-template-content-format" in done.stderr


def test_documents_reach_the_template(server):
    documents = [{"title": "Paint", "text": "Ochre is a colour."}, {"title": "Sky", "text": "Blue."}]
    assert _rendered(server, documents=documents) == (
        "[Paint: Ochre is a colour.][Sky: Blue.]user: Name a colour.\nhello, assistant:")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    given = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                           extra_body={"documents": documents})
    assert given.usage.prompt_tokens > plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                       extra_body={"documents": [{"title": 3}]})
    assert info.value.body["param"] == "documents"


def test_documents_are_checked_before_a_template_sees_them():
    from pagedllm.chat import MAX_DOCUMENTS, check_documents

    assert check_documents([{"title": "a", "text": "b"}]) == [{"title": "a", "text": "b"}]
    for bad, param in (("text", "documents"), ([{"title": 1}], "documents[0]"), ([{}, ["x"]], "documents[1]"),
                       ([{}] * (MAX_DOCUMENTS + 1), "documents")):
        with pytest.raises(RequestError) as info:
            check_documents(bad)
        assert info.value.param == param


MIDDLEWARE = '''
from starlette.middleware.base import BaseHTTPMiddleware


class Stamp(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        response = await call_next(request)
        response.headers["x-stamp"] = "class"
        return response


async def count(request, call_next):
    response = await call_next(request)
    response.headers["x-path"] = request.url.path
    return response


NOT_MIDDLEWARE = 42
'''


def test_middleware_as_vllm_adds_it(tiny_default_tokenizer_model, tmp_path, monkeypatch):
    """--middleware, repeated: a class is added with app.add_middleware, an async function as an HTTP
    middleware; both see every response, the API's included."""
    (tmp_path / "my_middleware.py").write_text(MIDDLEWARE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{Path(__file__).resolve().parent.parent}")
    proc = ServerProcess(str(tiny_default_tokenizer_model), "--num-kv-blocks", "64", "--max-num-seqs", "2",
                         "--max-model-len", "128", "--middleware", "my_middleware.Stamp",
                         "--middleware", "my_middleware.count")
    try:
        proc.wait_ready()
        models = httpx.get(f"{proc.base_url}/v1/models", timeout=30)
        assert models.status_code == 200
        assert models.headers["x-stamp"] == "class" and models.headers["x-path"] == "/v1/models"
        done = httpx.post(f"{proc.base_url}/v1/completions",
                          json={"model": models.json()["data"][0]["id"], "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert done.status_code == 200 and done.headers["x-stamp"] == "class"
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize(("path", "says"), [("my_middleware.Missing", "cannot import it"),
                                            ("no_such_module_here.X", "cannot import it"),
                                            ("my_middleware.NOT_MIDDLEWARE", "is a int"),
                                            ("Stamp", "give an import path")])
def test_a_middleware_that_is_not_one_stops_the_start_up(tiny_default_tokenizer_model, tmp_path, path, says):
    (tmp_path / "my_middleware.py").write_text(MIDDLEWARE)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parent.parent}"}
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", str(tiny_default_tokenizer_model),
                           "--middleware", path], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "--middleware" in done.stderr and says in done.stderr, done.stderr
    assert "engine ready" not in done.stderr
