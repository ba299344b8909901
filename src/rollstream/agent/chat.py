"""Token-exact chat rendering for multi-turn episodes: append, never re-tokenise.

An episode's token ids grow in two ways: tokens the engine sampled (appended as served) and
tokens the environment adds (tool results, the next user message, the next generation
prompt). ``ChatRenderer.extend`` renders only what the environment adds, with the model's own
chat template, and returns the ids to append; the ids already served are never rendered or
tokenised again, so the trainer sees exactly what the engine saw.

The delta is found by rendering, not by a per-family table: any Hugging Face chat template
works as long as it renders a conversation's messages one after another (an append-only
template). It is the text between two renders (conversation without and with the new
messages, the second with the generation prompt), preceded by what the template puts after
an assistant turn's end (ChatML's ``\\n`` after ``<|im_end|>``; the whole closing text when
the model was cut by its token budget before it ended its turn). A template that is not
append-only for these messages is a ``TemplateError`` naming where the renders part.

A template may rewrite earlier turns when new messages come (Qwen3's drops the ``<think>``
block of every model turn before the last user message). ``rewrites`` says so, from the
conversation's own text (the model's turns as sampled); the agent loop then serves the whole
conversation rendered anew (``prompt``) and splits the episode there into turn-samples
(``trajectory.Context``), so that each turn is still trained on the tokens it was served.

``check_alignment`` is the end-of-episode check: the episode's ids must equal what the template
renders for the final conversation (the model's turns as the decoded text it sampled). A model
turn that the template renders differently (stripped whitespace, re-serialised tool calls)
fails it with the first differing position and both decodings around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]  # {"role": ..., "content": ...}: the chat-template schema
PROBE = "\x00probe\x00"  # a placeholder assistant content no template adds by itself
CONTEXT = 40  # characters of decoded text shown on each side of a mismatch


class TemplateError(ValueError):
    """The chat template cannot extend this conversation by appending, or the episode's
    tokens differ from what the template renders for it."""


@dataclass(slots=True)
class ChatRenderer:
    """Renders with ``tokenizer``'s chat template (a Hugging Face tokenizer)."""

    tokenizer: Any
    tools: list[dict] | None = None  # the tool schemas the template shows the model

    def text(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools, tokenize=False,
            add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt of an episode: ``messages`` and the generation prompt."""
        return self.encode(self.text(messages, add_generation_prompt=True))

    def _assistant_tail(self, messages: Sequence[Message]) -> str:
        """What the template writes after an assistant turn's text."""
        opened = self.text(messages, add_generation_prompt=True)
        closed = self.text([*messages, {"role": "assistant", "content": PROBE}],
                           add_generation_prompt=False)
        _require_prefix(opened, closed, "an assistant turn")
        return closed[len(opened):].split(PROBE, 1)[1]

    def stop_token_ids(self, messages: Sequence[Message]) -> list[int]:
        """The token that ends a model turn under this template (generation stops there)."""
        return [self._stop_in(self._assistant_tail(messages))]

    def _stop_in(self, tail: str) -> int:
        """The first special token the template closes an assistant turn with."""
        for token_id in self.encode(tail):
            if token_id in self.tokenizer.all_special_ids:
                return token_id
        raise TemplateError(f"the chat template closes an assistant turn with {tail!r}, "
                            "which holds no special token to end a turn on")

    def closing(self, messages: Sequence[Message], *, ended: bool) -> str:
        """What the template writes after an assistant turn's text: after its end-of-turn
        token when the model sampled it (``ended``), the whole closing text otherwise."""
        tail = self._assistant_tail(messages)
        if ended:
            stop = self.tokenizer.decode([self._stop_in(tail)])
            tail = tail[tail.index(stop) + len(stop):]
        return tail

    def rewrites(self, messages: Sequence[Message], new: Sequence[Message]) -> bool:
        """Whether the template renders ``messages`` (ending with the model's turn, its text
        as sampled) differently once ``new`` follows: the earlier text is not a prefix of the
        new render (module docstring)."""
        done = self.text(messages, add_generation_prompt=False)
        return not self.text([*messages, *new], add_generation_prompt=True).startswith(done)

    def extend(self, messages: Sequence[Message], new: Sequence[Message], *,
               model_ended_turn: bool) -> list[int]:
        """The ids to append after a model turn: the turn's closing, ``new`` (environment
        messages: tool results, a user message) and the generation prompt. ``messages`` is
        the conversation so far, ending with the model's turn."""
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError("extend() follows a model turn: messages must end with the "
                             "assistant's message")
        before = messages[:-1]
        probe = [*before, {"role": "assistant", "content": PROBE}]
        done = self.text(probe, add_generation_prompt=False)
        after = self.text([*probe, *new], add_generation_prompt=True)
        _require_prefix(done, after, f"the messages {[m['role'] for m in new]}")
        closing = self.closing(before, ended=model_ended_turn)
        return self.encode(closing + after[len(done):])


    def episode(self, opening: Sequence[Message],
                turns: Sequence[Message]) -> tuple[list[int], list[bool]]:
        """A whole conversation as the agent loop serves it: ``opening`` rendered as the
        prompt, then each assistant message as the model's tokens with its end-of-turn token,
        and the other messages after it as one environment delta (``extend``). Returns the
        ids and, per id, whether the model produced it (the supervised targets of a
        demonstration)."""
        ids = self.prompt(opening)
        mask = [False] * len(ids)
        messages = list(opening)
        stop = self.stop_token_ids(opening)
        pending: list[Message] = []
        for message in turns:
            if message["role"] != "assistant":
                pending.append(message)
                continue
            if pending:
                delta = self.extend(messages, pending, model_ended_turn=True)
                ids += delta
                mask += [False] * len(delta)
                messages += pending
                pending = []
            elif len(messages) > len(opening):
                raise ValueError("episode(): two assistant messages in a row")
            turn = self.encode(message["content"]) + stop
            ids += turn
            mask += [True] * len(turn)
            messages.append(message)
        if pending:
            raise ValueError("episode(): the conversation must end with an assistant message")
        return ids, mask


def _require_prefix(shorter: str, longer: str, what: str) -> None:
    if not longer.startswith(shorter):
        at = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), len(longer))
        raise TemplateError(
            f"the chat template is not append-only for {what}: adding them changes the text "
            f"already rendered at character {at} ({shorter[at:at + CONTEXT]!r} became "
            f"{longer[at:at + CONTEXT]!r})")


def check_alignment(renderer: ChatRenderer, messages: Sequence[Message],
                    token_ids: Sequence[int]) -> None:
    """Raise ``TemplateError`` unless ``token_ids`` (an episode's prompt + turns, as trained)
    equal the template's rendering of ``messages``: with the generation prompt when the
    environment spoke last; a final model turn may lack the template's closing text.""" 
    ids = list(token_ids)
    ends_model_turn = bool(messages) and messages[-1]["role"] == "assistant"
    rendered = renderer.encode(renderer.text(messages,
                                             add_generation_prompt=not ends_model_turn))
    if ends_model_turn:  # the template's closing after it may not have been served
        allowed = {"", renderer.closing(messages[:-1], ended=True),
                   renderer.closing(messages[:-1], ended=False)}
    else:
        allowed = {""}
    if rendered[:len(ids)] == ids and renderer.tokenizer.decode(rendered[len(ids):]) in allowed:
        return
    at = next((i for i, (a, b) in enumerate(zip(ids, rendered)) if a != b),
              min(len(ids), len(rendered)))
    decode = renderer.tokenizer.decode
    raise TemplateError(
        f"episode tokens differ from the chat template's rendering at token {at} of "
        f"{len(ids)} (rendered: {len(rendered)}): trained ...{decode(ids[max(0, at - 8):at])!r}"
        f" then {decode(ids[at:at + 8])!r}; the template renders "
        f"{decode(rendered[at:at + 8])!r}")
