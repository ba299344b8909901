"""Token-exact chat rendering: appended ids equal the template's full rendering, for a
ChatML (Qwen-style) and a Llama-3-style template, and drift is detected."""

from __future__ import annotations

import pytest

from rollstream.agent.chat import ChatRenderer, TemplateError, check_alignment
from rollstream.models.tokenizer import build_char_tokenizer

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _chatml():
    return build_char_tokenizer()


def _llama3():
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def _model_turn(renderer: ChatRenderer, messages, text: str, *, ended: bool) -> list[int]:
    """What an engine would serve for a model turn with ``text``: its ids, then the stop."""
    ids = renderer.encode(text)
    return ids + renderer.stop_token_ids(messages) if ended else ids


@pytest.mark.parametrize("make", [_chatml, _llama3], ids=["chatml", "llama3"])
def test_incremental_episode_equals_the_full_rendering(make):
    renderer = ChatRenderer(make())
    messages = [{"role": "system", "content": "add numbers"},
                {"role": "user", "content": "sum 3 4 5"}]
    ids = renderer.prompt(messages)
    served = []  # every prefix handed to the engine: never changed afterwards
    turns = [("call add 3 4", [{"role": "tool", "content": "7"}]),
             ("call add 7 5", [{"role": "tool", "content": "12"},
                               {"role": "user", "content": "done?"}]),
             ("answer 12", [])]
    for text, env in turns:
        served.append(list(ids))
        ids += _model_turn(renderer, messages, text, ended=True)
        messages.append({"role": "assistant", "content": text})
        if env:
            ids += renderer.extend(messages, env, model_ended_turn=True)
            messages.extend(env)
    assert all(ids[:len(prefix)] == prefix for prefix in served)
    check_alignment(renderer, messages, ids)
    full = renderer.encode(renderer.text(messages, add_generation_prompt=False))
    assert full[:len(ids)] == ids  # only the template's text after the last stop is not served


@pytest.mark.parametrize("make", [_chatml, _llama3], ids=["chatml", "llama3"])
def test_a_turn_cut_by_its_budget_is_closed_by_the_template(make):
    renderer = ChatRenderer(make())
    messages = [{"role": "user", "content": "count"}]
    ids = renderer.prompt(messages)
    ids += _model_turn(renderer, messages, "1 2 3", ended=False)  # no stop token sampled
    messages.append({"role": "assistant", "content": "1 2 3"})
    ids += renderer.extend(messages, [{"role": "user", "content": "go on"}],
                           model_ended_turn=False)
    messages.append({"role": "user", "content": "go on"})
    check_alignment(renderer, messages, ids)
    assert ids == renderer.prompt(messages)  # here: the same as rendering all of it


def test_stop_tokens_come_from_the_template():
    chatml, llama = ChatRenderer(_chatml()), ChatRenderer(_llama3())
    messages = [{"role": "user", "content": "x"}]
    assert chatml.tokenizer.decode(chatml.stop_token_ids(messages)) == "<|im_end|>"
    assert llama.tokenizer.decode(llama.stop_token_ids(messages)) == "<|eot_id|>"
    assert chatml.closing(messages, ended=True) == "\n"
    assert llama.closing(messages, ended=True) == ""


def test_an_assistant_turn_rendered_differently_from_what_was_sampled_is_detected():
    """The template trims the assistant's text; the model sampled surrounding spaces."""
    tok = _chatml()
    tok.chat_template = tok.chat_template.replace(
        "message['content']", "(message['content'] | trim if message['role'] == 'assistant' "
        "else message['content'])")
    renderer = ChatRenderer(tok)
    messages = [{"role": "user", "content": "2+2"}]
    ids = renderer.prompt(messages) + _model_turn(renderer, messages, " 4 ", ended=True)
    messages.append({"role": "assistant", "content": " 4 "})
    with pytest.raises(TemplateError, match=r"at token 22 of 26.*then ' 4 <\|im_end\|>'; "
                       r"the template renders '4<\|im_end\|>"):
        check_alignment(renderer, messages, ids)


def test_a_template_that_is_not_append_only_is_refused():
    """A template that shows only the last two messages rewrites history as it grows."""
    tok = _chatml()
    tok.chat_template = tok.chat_template.replace("for message in messages",
                                                  "for message in messages[-2:]")
    renderer = ChatRenderer(tok)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(TemplateError, match="not append-only for the messages \\['tool'\\]"):
        renderer.extend(messages, [{"role": "tool", "content": "c"}], model_ended_turn=True)
    with pytest.raises(ValueError, match="must end with the assistant's message"):
        renderer.extend(messages[:1], [{"role": "tool", "content": "c"}], model_ended_turn=True)
