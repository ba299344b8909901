"""vLLM serving an exported folder (the session's shared server, shared.py) reads its tokenizer
as training did: its ``/tokenize`` endpoint, rendering the chat template itself or given the
rendered text, answers the ids the kit tokenizer and the agent loop's renderer produce; the
server command and the requests of docs/export.md work as written."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from rollstream.agent.chat import ChatRenderer
from rollstream.models.folder_check import CONVERSATION, TOOLS
from rollstream.models.tokenizer import build_char_tokenizer
from tests.vllm import shared

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


DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"


def _doc_commands(prefix: str) -> list[list[str]]:
    body = DOC.read_text().split("## A vLLM server\n", 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line) for line in body.splitlines() if line.startswith(prefix)]


def test_the_docs_server_command_is_one_vllm_accepts() -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    (argv,) = _doc_commands("python -m vllm.entrypoints.openai.api_server ")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    validate_parsed_serve_args(args)
    assert (args.model, args.served_model_name, args.host) == (
        "exports/tick-demo", ["tick-demo"], "127.0.0.1")


async def test_the_docs_requests_answer_on_an_exported_folder(vllm_engine) -> None:
    kit = build_char_tokenizer()
    requests = _doc_commands("curl ")
    assert [urlsplit(r[2]).path for r in requests] == [
        "/tokenize", "/v1/completions", "/v1/chat/completions"]
    async with httpx.AsyncClient(base_url=vllm_engine.url, timeout=120) as client:
        for argv in requests:
            body = json.loads(argv[argv.index("-d") + 1])
            body["model"] = str(shared.model_path())  # this server's name for its folder
            r = await client.post(urlsplit(argv[2]).path, json=body)
            assert r.status_code == 200, (argv[2], r.text)
            answer = r.json()
            if "messages" in body and "tokens" in answer:
                assert answer["tokens"] == ChatRenderer(kit).prompt(body["messages"])
            elif "choices" in answer:
                choice = answer["choices"][0]
                assert isinstance(choice.get("text", choice.get("message")), (str, dict))
