"""The OpenAI-compatible proxy with the official SDK against the real embedded engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from rollstream.agent.chat import ChatRenderer, check_alignment
from rollstream.agent.proxy import AgentProxy
from rollstream.agent.proxy_wire import reply_message, sse
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.trajectory import SegmentKind

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


@pytest.fixture
async def proxy(engine):
    async with AgentProxy([engine], build_char_tokenizer()) as proxy:
        yield proxy


async def _agent(handle, index: int, *, stream: bool) -> list[str]:
    """An ordinary SDK agent: ask, feed a tool result back, ask again; the replies it read."""
    client = openai.AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key)
    messages = [{"role": "system", "content": "use tools"},
                {"role": "user", "content": f"what is {index} + 1"}]
    replies = []
    for turn in range(3):
        kwargs = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 12,
                      "temperature": 1.0, "seed": index}
        if stream:
            text = ""
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        else:
            reply = await client.chat.completions.create(**kwargs)
            text = reply.choices[0].message.content or ""
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
        follow = ({"role": "tool", "tool_call_id": "call_0", "content": f"{index + 1}"}
                  if turn == 0 else {"role": "user", "content": "and then"})
        messages.append(follow)
    await client.close()
    return replies


async def test_64_concurrent_sdk_sessions_each_stitch_into_one_exact_sample(proxy):
    handles = [proxy.open_session(f"ep{i}") for i in range(64)]
    replies = await asyncio.gather(*(_agent(h, i, stream=i % 2 == 1)
                                     for i, h in enumerate(handles)))
    renderer = ChatRenderer(build_char_tokenizer())
    for handle, read in zip(handles, replies, strict=True):
        samples = proxy.close_session(handle.api_key)
        assert len(samples) == 1, [s.started_because for s in samples]
        sample = samples[0]
        assert sample.num_calls == 3 and sample.started_because is None
        kinds = [s.kind for s in sample.segments]
        assert kinds == [SegmentKind.POLICY, SegmentKind.ENV] * 2 + [SegmentKind.POLICY]
        check_alignment(renderer, sample.messages, sample.token_ids)
        served = [m["content"] for m in sample.messages if m["role"] == "assistant"]
        assert served == read  # what the SDK read is what was trained
        policy = [s for s in sample.segments if s.kind is SegmentKind.POLICY]
        assert all(len(s) <= 12 and set(s.versions) == {0} for s in policy)


async def test_a_harness_that_rewrites_history_starts_a_new_sample(proxy):
    handle = proxy.open_session("rw")
    client = openai.AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key)
    first = [{"role": "user", "content": "a"}]
    reply = await client.chat.completions.create(model="t", messages=first, max_tokens=4)
    text = reply.choices[0].message.content or ""
    await client.chat.completions.create(  # continues: one sample
        model="t", max_tokens=4,
        messages=[*first, {"role": "assistant", "content": text}, {"role": "user", "content": "b"}])
    await client.chat.completions.create(  # drops the history: a second sample
        model="t", max_tokens=4, messages=[{"role": "user", "content": "summary"}])
    await client.close()
    samples = proxy.close_session(handle.api_key)
    assert [s.num_calls for s in samples] == [2, 1]
    assert samples[1].started_because == "history rewritten: 1 messages sent after 4 seen"


async def test_missing_wrong_or_closed_keys_are_refused_and_only_loopback_is_bound(proxy):
    assert proxy._server.servers[0].sockets[0].getsockname()[0] == "127.0.0.1"
    url = f"{proxy.base_url}/chat/completions"
    body = {"model": "t", "messages": [{"role": "user", "content": "x"}]}
    async with httpx.AsyncClient() as http:
        assert (await http.post(url, json=body)).status_code == 401
        wrong = await http.post(url, json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        handle = proxy.open_session("k")
        proxy.close_session(handle.api_key)
        closed = await http.post(url, json=body,
                                 headers={"Authorization": f"Bearer {handle.api_key}"})
        assert closed.status_code == 401
        handle = proxy.open_session("n")
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(**body)
    await client.close()


async def test_a_streamed_reply_arrives_as_it_is_sampled_and_adds_up_to_the_reply(proxy):
    """The official SDK with ``stream=True``: the text comes in several chunks while the
    engine samples it (a chunk per decode step here), then the finish and the usage chunk;
    joined, they are the reply the same call gets without streaming (same seed)."""
    messages = [{"role": "user", "content": "tell me a story"}]
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 40, "temperature": 1.0,
              "seed": 11}
    streaming, plain_ = proxy.open_session("streamed"), proxy.open_session("whole")
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key=streaming.api_key) as sdk:
        chunks = [c async for c in await sdk.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs)]
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key=plain_.api_key) as sdk:
        whole = await sdk.chat.completions.create(**kwargs)
    texts = [c.choices[0].delta.content for c in chunks if c.choices and
             c.choices[0].delta.content]
    assert len(texts) > 1, texts
    assert "".join(texts) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1
    [sample] = proxy.close_session(streaming.api_key)
    assert sample.token_ids == proxy.close_session(plain_.api_key)[0].token_ids


def test_a_reply_streams_its_prose_and_holds_back_what_may_be_a_tool_call():
    """The content streamed is what is certain: never the start of a tool call (or a tag
    that may grow into one), never trailing space (a reply with calls has its prose
    stripped); what it sent always begins the final content."""
    from rollstream.agent.proxy_stream import StreamedText
    from rollstream.agent.tools import HermesToolParser

    parser = HermesToolParser()
    text = StreamedText(decode=lambda ids: "".join(map(chr, ids)), parser=parser)  # a token
    sent = [text.add(list(map(ord, piece)))  # per character
            for piece in ("let me ", "add <to", 'ol_call>{"name": "f"}', "</tool_call> ok")]
    assert sent == ["let me", " add", "", ""]
    final = "".join(map(chr, text.ids))
    content = reply_message(final, parser.parse(final), 0)["content"]
    assert parser.parse(final).calls and content == "let me add  ok"
    assert "".join(sent) + text.rest(content) == content
    plain_text = StreamedText(decode=lambda ids: "".join(map(chr, ids)), parser=parser)
    assert plain_text.add(list(map(ord, " hi"))) == ""  # leading space: at the end
    assert plain_text.rest(" hi") == " hi"


async def test_n_choices_are_each_their_own_sample_and_a_next_call_goes_on_in_its_own(proxy):
    """``n=3`` through the SDK: three choices, each sampled on its own and each its own
    sample of the session (the two extra ones forked from the call's prompt); the next call
    keeps the third reply and goes on in that choice's sample. A streamed call takes n=1."""
    handle = proxy.open_session("choices")
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key=handle.api_key) as sdk:
        messages = [{"role": "user", "content": "pick one"}]
        reply = await sdk.chat.completions.create(model="t", messages=messages, n=3,
                                                  max_tokens=10, temperature=1.0, seed=5)
        texts = [c.message.content for c in reply.choices]
        assert [c.index for c in reply.choices] == [0, 1, 2] and len(set(texts)) == 3
        messages += [{"role": "assistant", "content": texts[2]},
                     {"role": "user", "content": "go on"}]
        await sdk.chat.completions.create(model="t", messages=messages, max_tokens=10)
        with pytest.raises(openai.BadRequestError, match="one choice") as refused:
            await sdk.chat.completions.create(model="t", messages=messages, n=2, stream=True)
        assert refused.value.body["param"] == "n"
    samples = proxy.close_session(handle.api_key)
    assert [(s.started_because, s.num_calls) for s in samples] == [
        (None, 1), ("choice 1 of call 1", 1), ("choice 2 of call 1", 2)]
    assert samples[0].prompt_ids == samples[2].prompt_ids
    renderer = ChatRenderer(build_char_tokenizer())
    for sample, text in zip(samples, texts, strict=True):
        assert sample.messages[1]["content"] == text
        check_alignment(renderer, sample.messages, sample.token_ids)
    assert reply.usage.completion_tokens == sum(len(s.segments[0]) for s in samples)


async def test_run_harness_returns_the_samples_of_a_harness_that_times_out(proxy):
    async def ask(handle):
        client = openai.AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key)
        await client.chat.completions.create(
            model="t", max_tokens=4, messages=[{"role": "user", "content": "hi"}])

    async def harness(handle):
        await ask(handle)
        await asyncio.sleep(60)

    warm = proxy.open_session("warm")  # its first request pays the client's start-up
    await ask(warm)
    proxy.close_session(warm.api_key)
    # the timed harness's request takes well under a second warm, even on a loaded machine
    samples, outcome = await proxy.run_harness(harness, episode_id="slow", timeout_s=5.0)
    assert isinstance(outcome, TimeoutError)
    assert len(samples) == 1 and samples[0].num_calls == 1


async def test_tool_calls_in_a_reply_are_openai_tool_calls(proxy):
    text = 'sure\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n' \
           "</tool_call>"
    message = reply_message(text, proxy.parser.parse(text), 0)
    assert message["content"] == "sure"
    call = message["tool_calls"][0]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "1+2"}
    reply = {"id": "c", "created": 0, "model": "t",
             "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}
    chunks = [line async for line in sse(reply)]
    assert chunks[-1] == "data: [DONE]\n\n"
    deltas = [json.loads(c[6:])["choices"][0] for c in chunks[:-1]]
    assert deltas[2]["delta"]["tool_calls"][0]["function"]["name"] == "calculator"
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_rollstream_proxy_command_serves_an_sdk_agent_and_writes_its_samples(model_dir,
                                                                            tmp_path):
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "samples.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "rollstream", "proxy", str(model_dir),
                             "--sessions", "2", "--out", str(out)],
                            stdout=subprocess.PIPE, text=True)
    try:
        base_url = proc.stdout.readline().split()[1]
        keys = [proc.stdout.readline().split()[1] for _ in range(2)]
        assert base_url.startswith("http://127.0.0.1:")
        for key in keys:
            client = openai.OpenAI(base_url=base_url, api_key=key)
            reply = client.chat.completions.create(
                model="kit", max_tokens=6, messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].finish_reason in ("stop", "length")
            client.close()
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "2 samples from 2 sessions" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["session"], r["num_calls"]) for r in records] == [(0, 1), (1, 1)]
    assert all(r["segments"][0]["kind"] == "policy" for r in records)


async def test_a_session_whose_engine_went_away_continues_on_another(model_dir, engine):
    from rollstream.config.schema import EngineConfig, LocalEngineConfig
    from rollstream.engine import build_engine

    other = build_engine(EngineConfig(kind="local", local=LocalEngineConfig(
        max_slots=4, max_seq_len=512, threads=1, device="cpu")), model_dir, engine_id="local-1")
    async with AgentProxy([engine, other], build_char_tokenizer()) as proxy:
        handle = proxy.open_session("failover")
        session = proxy._sessions[handle.session_id]
        client = openai.AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key)
        messages = [{"role": "user", "content": "a"}]
        reply = await client.chat.completions.create(model="t", messages=messages, max_tokens=4)
        first = session.engine
        await first.close()  # DEAD from now on
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "b"}]
        await client.chat.completions.create(model="t", messages=messages, max_tokens=4)
        await client.close()
        assert session.engine is not first
        samples = proxy.close_session(handle.api_key)
        assert len(samples) == 1 and samples[0].num_calls == 2  # the same sample goes on
    await other.close()


class _Held:
    """A real engine whose calls wait at a gate before they reach it (to keep one in flight)."""

    def __init__(self, engine) -> None:
        self.inner, self.engine_id, self.gate = engine, engine.engine_id, asyncio.Event()
        self.num_failures = 0  # calls that raise (a bug of ours, not an engine's error reply)

    async def generate(self, request):
        await self.gate.wait()
        if self.num_failures:
            self.num_failures -= 1
            raise RuntimeError("a bug in the middle of a call")
        return await self.inner.generate(request)

    async def interrupt(self, request_ids=None):
        await self.inner.interrupt(request_ids)

    def stats(self):
        return self.inner.stats()


async def test_sessions_are_routed_by_the_calls_in_flight_and_stay_with_their_prefix(
        model_dir, engine):
    """The rollout's Router picks the engines: a first call goes where the proxy has the fewest
    calls in flight (the engine's own queue does not show a call that has not reached it yet),
    a later call stays on the engine that holds its session's prefix, and with no engine UP a
    call fails with the reason."""
    from rollstream.config.schema import EngineConfig, LocalEngineConfig
    from rollstream.engine import build_engine

    other = build_engine(EngineConfig(kind="local", local=LocalEngineConfig(
        max_slots=4, max_seq_len=512, threads=1, device="cpu")), model_dir, engine_id="local-1")
    held = _Held(engine)
    async with AgentProxy([held, other], build_char_tokenizer()) as proxy:
        handles = [proxy.open_session(f"s{i}") for i in range(3)]
        clients = [openai.AsyncOpenAI(base_url=h.base_url, api_key=h.api_key, max_retries=0)
                   for h in handles]

        async def call(i: int, text: str) -> None:
            await clients[i].chat.completions.create(
                model="t", messages=[{"role": "user", "content": text}], max_tokens=4)

        first = asyncio.create_task(call(0, "a"))  # held at the gate of engine local-0
        async with asyncio.timeout(30):
            while proxy.router.load[held] == 0:
                await asyncio.sleep(0.005)
        await asyncio.wait_for(call(1, "b"), 30)  # (sent to local-0, it would wait there)
        await asyncio.wait_for(call(2, "c"), 30)
        engines = [proxy._sessions[h.session_id].engine for h in handles]
        assert engines == [held, other, other]  # local-0 had a call in flight
        held.gate.set()
        await first
        await call(2, "c")  # the same session again: local-0 is idle now, yet it stays
        assert proxy._sessions[handles[2].session_id].engine is other
        assert proxy.router.load[held] == proxy.router.load[other] == 0
        await engine.close()
        await other.close()  # no engine is UP now
        with pytest.raises(openai.APIStatusError, match="no engine is UP") as failed:
            await call(0, "d")
        assert failed.value.status_code == 502
        for c in clients:
            await c.close()


async def test_a_call_that_fails_midway_has_the_next_one_start_a_new_sample(engine):
    """A call that raised after it put its prompt on the sample (HTTP 500) leaves no half
    state: the SDK's retry of the same messages starts a new sample, with the reason."""
    held = _Held(engine)
    held.gate.set()
    held.num_failures = 1
    async with AgentProxy([held], build_char_tokenizer()) as proxy:
        handle = proxy.open_session("flaky")
        client = openai.AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key,
                                    max_retries=1)  # the retry is the second call
        messages = [{"role": "user", "content": "a"}]
        reply = await client.chat.completions.create(model="t", messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "b"}]
        await client.chat.completions.create(model="t", messages=messages, max_tokens=4)
        await client.close()
        failed, sample = proxy.close_session(handle.api_key)
    assert held.num_failures == 0 and failed.num_calls == 0 and failed.segments == []
    assert sample.started_because == "the previous call failed" and sample.num_calls == 2
    check_alignment(ChatRenderer(build_char_tokenizer()), sample.messages, sample.token_ids)


async def test_a_connection_idle_while_tools_run_stays_open(proxy):
    """An agent's HTTP connection idles while its tools run: the proxy keeps it open past
    uvicorn's 5 s default (with it, a client that reused the connection as the server closed
    it failed its episode with a connection error: 32 verifiers rollouts, tools up to 7 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Authorization: Bearer rs-none.x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 2\r\n\r\n{}")
    try:
        for idle in (6, 0):  # the second call after a slow tool
            writer.write(request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 401"), head
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            await asyncio.sleep(idle)
    finally:
        writer.close()
