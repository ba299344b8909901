"""The agent proxy under hostile and careless callers, over real HTTP: a body over the size
limit is a 413 before it is read (the proxy's memory stays flat under a 50 MB request), bad
bodies are 400s naming the field, a prompt longer than the context is refused before it is
rendered, a session's calls and history are capped, and a key's secret never leaves the
proxy."""

from __future__ import annotations

import json
import logging
import re
import select
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from rollstream.agent.proxy import AgentProxy
from rollstream.agent.proxy_wire import field_docs
from rollstream.config.tasks import ProxyConfig
from rollstream.models.tokenizer import build_char_tokenizer

BIG_BYTES = 50 << 20  # the size of the request that took the proxy to 10 GB
MAX_GROWTH_BYTES = 64 << 20  # what the proxy's peak memory may grow by while refusing it
USER = {"role": "user", "content": "hi"}


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _status_kb(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def _raw_post(url: str, key: str, *, declared: int | None, total: int,
              timeout_s: float = 20.0) -> tuple[int, dict]:
    """POST ``total`` bytes of one JSON body to ``url`` over a plain socket, with
    ``Content-Length: declared`` or chunked when None, stopping as soon as the server
    answers; its status and JSON body."""
    parts = urlsplit(url)
    head = f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n" \
           f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {declared}\r\n" if declared is not None else \
        "Transfer-Encoding: chunked\r\n"
    opening = b'{"model": "t", "messages": [{"role": "user", "content": "'
    piece = b"a" * (1 << 20)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.sendall(head.encode() + b"\r\n")
        sent = 0
        deadline = time.monotonic() + timeout_s
        while sent < total and not select.select([sock], [], [], 0)[0]:
            data = opening if sent == 0 else piece[:total - sent]
            if declared is None:
                data = f"{len(data):x}\r\n".encode() + data + b"\r\n"
            try:
                sock.sendall(data)
            except OSError:  # the server answered and closed
                break
            sent += len(data)
            if declared is not None and sent >= 1 << 20:
                break  # a server that waits for the rest of a declared body answers nothing
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {timeout_s} s; got {answer[:200]!r}")
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not chunk:
                break
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.split(b"\r\n\r\n", 1)[1] or b"{}")


def test_a_declared_50_mb_body_is_413_before_it_is_read(cli_proxy) -> None:
    url = f"{cli_proxy.base_url}/chat/completions"
    status, body = _raw_post(url, cli_proxy.keys[0], declared=BIG_BYTES, total=BIG_BYTES)
    assert status == 413, body
    assert body["error"]["param"] == "body" and "max_request_bytes" in body["error"]["message"]


def test_a_chunked_50_mb_body_is_cut_at_the_limit_and_memory_stays_flat(cli_proxy) -> None:
    pid, url = cli_proxy.pid, f"{cli_proxy.base_url}/chat/completions"
    before = _status_kb(pid, "VmRSS") << 10
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    status, body = _raw_post(url, cli_proxy.keys[0], declared=None, total=BIG_BYTES)
    peak = _status_kb(pid, "VmHWM") << 10
    assert status == 413 and body["error"]["param"] == "body", body
    assert peak - before < MAX_GROWTH_BYTES, f"peak {peak >> 20} MB from {before >> 20} MB"
    reply = httpx.post(url, json={"model": "t", "messages": [USER], "max_tokens": 2},
                       headers=_headers(cli_proxy.keys[0]), timeout=30)
    assert reply.status_code == 200, reply.text  # and it serves on


BAD_BODIES = [  # (body, the field the refusal must name)
    (b'{"messages": [', "body"),  # malformed JSON
    (b'["not", "an", "object"]', "body"),
    (b'{"messages": ["hi"]}', "messages.0"),  # a message that is not an object
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}]}',
     "messages.0.tool_calls.0.function"),  # a tool call without `function`
    (json.dumps({"messages": [USER], "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": [USER], "seed": "x"}).encode(), "seed"),
    (json.dumps({"messages": [USER], "n": 65}).encode(), "n"),
    (json.dumps({"messages": [USER], "temperature": -1}).encode(), "temperature"),
    (json.dumps({"messages": [USER], "top_k": 1 << 70}).encode(), "top_k"),
    (json.dumps({"messages": [USER], "stop": ["\n"]}).encode(), "stop"),
    (json.dumps({"messages": [USER], "frobnicate": 1}).encode(), "frobnicate"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "messages.0.role"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
     "messages.0.content.0.type"),
    (json.dumps({"messages": [USER], "tools": [{"type": "function"}]}).encode(),
     "tools.0.function"),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": 1' + b"0" * 5000 + b"}",
     "body"),  # a 5,000-digit number
    (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),  # deep nesting
]


@pytest.mark.parametrize("raw,param", BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_bad_bodies_are_400_naming_the_field(cli_proxy, raw: bytes, param: str) -> None:
    r = httpx.post(f"{cli_proxy.base_url}/chat/completions", content=raw, timeout=30,
                   headers=_headers(cli_proxy.keys[1]) | {"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert "Traceback" not in cli_proxy.stderr.read_text()


class _CountingTokenizer:
    """The kit tokenizer, counting the conversations its chat template renders."""

    def __init__(self) -> None:
        self.inner, self.num_renders = build_char_tokenizer(), 0

    def apply_chat_template(self, *args, **kwargs):
        self.num_renders += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def _post(proxy: AgentProxy, key: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{proxy.base_url}/chat/completions", json=body,
                               headers=_headers(key))


async def test_a_prompt_longer_than_the_context_is_refused_before_it_is_rendered(engine):
    tokenizer = _CountingTokenizer()
    async with AgentProxy([engine], tokenizer, context_tokens=512) as proxy:
        key = proxy.open_session("long").api_key
        huge = {"model": "t", "max_tokens": 2,
                "messages": [{"role": "user", "content": "a" * (4 << 20)}]}
        r = await _post(proxy, key, huge)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "longer than the context" in r.json()["error"]["message"]
        assert tokenizer.num_renders == 0
        # one that only its rendering shows too long is refused before the engine sees it
        near = huge | {"messages": [{"role": "user", "content": "a" * 600}]}
        r = await _post(proxy, key, near)
        assert r.status_code == 400 and "does not fit the context of 512" in r.text, r.text
        ok = await _post(proxy, key, huge | {"messages": [USER]})
        assert ok.status_code == 200, ok.text
        (sample,) = proxy.close_session(key)
    assert sample.num_calls == 1  # the refused calls left nothing behind


async def test_a_sessions_calls_and_history_are_capped(engine):
    limits = ProxyConfig(max_session_calls=3, max_session_history_bytes=1024)
    async with AgentProxy([engine], build_char_tokenizer(), limits=limits) as proxy:
        key = proxy.open_session("calls").api_key
        body = {"model": "t", "max_tokens": 2, "messages": [USER]}
        assert [(await _post(proxy, key, body)).status_code for _ in range(3)] == [200] * 3
        r = await _post(proxy, key, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_session_calls"
        assert "max_session_calls" in r.json()["error"]["message"]

        key = proxy.open_session("history").api_key
        long = {"model": "t", "max_tokens": 2,
                "messages": [{"role": "user", "content": "b" * 400}]}
        assert (await _post(proxy, key, long)).status_code == 200
        assert (await _post(proxy, key, long)).status_code == 200  # a second sample of it
        r = await _post(proxy, key, long)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_session_history_bytes"
        assert "max_session_history_bytes" in r.json()["error"]["message"]


class _Recording:
    """A real engine whose requests are recorded as they pass."""

    def __init__(self, engine) -> None:
        self.inner, self.engine_id, self.requests = engine, engine.engine_id, []

    async def generate(self, request):
        self.requests.append(request)
        return await self.inner.generate(request)

    async def interrupt(self, request_ids=None):
        await self.inner.interrupt(request_ids)

    def stats(self):
        return self.inner.stats()


async def test_only_a_keys_id_leaves_the_proxy_and_its_secret_is_checked(engine, caplog):
    caplog.set_level(logging.DEBUG)
    recording = _Recording(engine)
    async with AgentProxy([recording], build_char_tokenizer()) as proxy:
        handle = proxy.open_session("ep")
        prefix, secret = handle.api_key.split(".", 1)
        assert prefix == f"rs-{handle.session_id}" and len(secret) >= 32
        body = {"model": "t", "max_tokens": 2, "messages": [USER]}
        for wrong in (prefix, f"{prefix}.{secret[:-1]}x", f"rs-{'0' * 12}.{secret}", secret):
            r = await _post(proxy, wrong, body)
            assert r.status_code == 401, wrong
        reply = await _post(proxy, handle.api_key, body)
        assert reply.status_code == 200 and handle.session_id in reply.json()["id"]
        (sample,) = proxy.close_session(handle.api_key)
    (request,) = recording.requests
    assert handle.session_id in request.request_id and handle.session_id in request.episode_id
    shown = [request.request_id, request.episode_id, reply.text, caplog.text, repr(sample)]
    assert not [s for s in shown if secret in s]


def test_the_docs_list_every_field_the_proxy_accepts() -> None:
    """docs/agents.md's tables are the request model's: every field it accepts (used,
    ignored, or accepted with one value), none made up, each with what its docstring says."""
    docs = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    for model, fields in field_docs().items():
        table = re.search(rf"<!-- {model} -->\n(.*?)\n\n", docs, re.S)
        assert table is not None, f"docs/agents.md has no table of {model}"
        rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", table.group(1), re.M))
        assert list(rows) == list(fields), (model, list(rows))
        for name, doc in fields.items():
            assert rows[name] == " ".join(doc.replace("``", "`").split()), (model, name)


def test_the_proxy_limits_are_config_checked_against_the_other_settings() -> None:
    from rollstream.config import ConfigError, load_config

    examples = Path(__file__).parents[2] / "examples"
    cfg = load_config(examples / "agent_openai.yaml", ["agent.proxy.max_request_bytes=4096"])
    assert cfg.agent.proxy.max_request_bytes == 4096
    with pytest.raises(ConfigError, match=r"agent.proxy.max_session_calls = 8 must exceed "
                                          r"agent.max_turns = 8"):
        load_config(examples / "agent_openai.yaml", ["agent.max_turns=8",
                                                     "agent.proxy.max_session_calls=8"])
    with pytest.raises(ConfigError, match="agent.proxy is read only by sources with harness"):
        load_config(examples / "agent.yaml", ["agent.proxy.max_session_calls=64"])


def test_a_reply_nesting_deeper_than_the_json_parser_recurses_is_a_tool_call_error() -> None:
    """The model's own text is parsed for tool calls in the proxy's reply: a long enough turn
    can nest past Python's recursion limit."""
    from rollstream.agent.tools import HermesToolParser

    deep = "<tool_call>\n" + "[" * 5000 + "]" * 5000 + "\n</tool_call>"
    parsed = HermesToolParser().parse(deep)
    assert parsed.calls == [] and parsed.errors == ["tool call 0: JSON nested too deep"]
