"""vLLM serving an exported folder (the session's shared server, shared.py) reads its tokenizer
as training did: its ``/tokenize`` endpoint, rendering the chat template itself or given the
rendered text, answers the ids the kit tokenizer and the agent loop's renderer produce."""

from __future__ import annotations

import httpx
import pytest

from rollstream.agent.chat import ChatRenderer
from rollstream.models.folder_check import CONVERSATION, TOOLS
from rollstream.models.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("tools", [None, list(TOOLS)], ids=["no-tools", "tools"])
async def test_the_server_tokenizes_a_chat_rendering_as_training(vllm_engine, tools) -> None:
    renderer = ChatRenderer(build_char_tokenizer(), tools=tools)  # what training renders
    messages = list(CONVERSATION)
    trained = renderer.prompt(messages)
    text = renderer.text(messages, add_generation_prompt=True)
    async with httpx.AsyncClient(base_url=vllm_engine.url, timeout=60) as client:
        by_server = await client.post("/tokenize", json={
            "messages": messages, "tools": tools, "add_generation_prompt": True})
        by_text = await client.post("/tokenize", json={"prompt": text,
                                                        "add_special_tokens": False})
    assert by_server.status_code == 200, by_server.text
    assert by_server.json()["tokens"] == trained
    assert by_text.status_code == 200, by_text.text
    assert by_text.json()["tokens"] == trained
    assert trained.count(renderer.tokenizer.convert_tokens_to_ids("<|im_start|>")) == 7
