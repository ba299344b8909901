"""A thinking model's chat template, which drops the ``<think>`` block of every model turn
before the last user message (as Qwen3's does), rewrites history: the episode is split there
into turn-samples, each trained on exactly the tokens it was served, sharing the episode's
reward, advantage and ledger line. An append-only template splits nothing.

The fixture is the kit's tokenizer with ``<think>`` and ``</think>`` as special tokens (the
kit's alphabet has no ``<``) and a ChatML template whose generation prompt opens a
``<think>`` block. The kit model cannot write ``</think>``: the model turns are scripted by an
engine at the process edge; the end-to-end run uses the kit model itself, whose earlier turns
the template rewrites as well (it drops the ``<think>`` they were served after)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from pathlib import Path

import openai
import pytest
from transformers import Qwen2Tokenizer

import rollstream
from rollstream.agent.chat import ChatRenderer, check_alignment
from rollstream.agent.environment import ModelTurn, Observation
from rollstream.agent.harness import AGENT, AgentHarness
from rollstream.agent.loop import (
    AgentLoop,
    Budgets,
    EngineTurns,
    Episode,
    ReplayDiverged,
    generate_turn,
)
from rollstream.agent.proxy import AgentProxy, Binding
from rollstream.clock import WallClock
from rollstream.config.schema import RewardConfig, TinyModelConfig, TrainConfig
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.durable.audit import audit_run
from rollstream.durable.state import group_from_dict, group_to_dict
from rollstream.engine import FinishReason, GenerateOutput, GenerateRequest, SamplingParams
from rollstream.models.tiny import build_tiny_model
from rollstream.models.tokenizer import (
    CHATML_TEMPLATE,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    ascii_symbols,
)
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.run_files import RunFiles
from rollstream.staleness import StalenessPolicy
from rollstream.train.batching import collate, pieces
from rollstream.train.trainer import Trainer
from rollstream.trajectory import (
    Context,
    Group,
    SampleStatus,
    SegmentKind,
    Task,
    served_ids,
    turn_samples,
)
from tests.agent.runs import two_step_run
from tests.rollout.fakes import RandomEngine

THINK, END_THINK = "<think>", "</think>"
# ChatML; a model turn after the last user message is rendered as served (after the
# generation prompt's <think>), an earlier one without its thinking: what precedes </think>
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last -%}"
    "{{ '<|im_start|>assistant\n<think>' + m['content'] + '<|im_end|>\n' }}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\n' + m['content'].split('</think>')[-1] + '<|im_end|>\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n<think>' }}{%- endif -%}"
)


def thinking_tokenizer(template: str = THINKING_TEMPLATE) -> Qwen2Tokenizer:
    """The kit tokenizer (models/tokenizer.py) with two more special tokens, ``<think>`` and
    ``</think>`` (ids 132 and 133), and ``template``."""
    symbols = (*SPECIAL_TOKENS, *ascii_symbols(), THINK, END_THINK)
    return Qwen2Tokenizer(vocab={t: i for i, t in enumerate(symbols)}, merges=[],
                          pad_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1],
                          unk_token=None, extra_special_tokens=[IM_START, IM_END, THINK,
                                                                END_THINK],
                          chat_template=template, model_max_length=1 << 20,
                          padding_side="right", clean_up_tokenization_spaces=False)


TOKENIZER = thinking_tokenizer()
RENDERER = ChatRenderer(TOKENIZER)
OPENING = [{"role": "user", "content": "go"}]


class ScriptedModel(RandomEngine):
    """An engine that writes scripted turns: turn k of the episode of sample ``.../i`` (k:
    the model turns its prompt shows) is ``r{k}</think>a{i % 2}`` (``a0`` for an episode
    of another name, and for an unbound proxy session's, whose id is random) and the end of
    its turn, sampled by weight version k. Every request is recorded (what the model was served)."""

    def __init__(self) -> None:
        super().__init__(seed=0, engine_id="scripted-0")
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        k = TOKENIZER.decode(request.prompt_ids).count(f"{IM_START}assistant") - 1
        episode = str(request.episode_id)  # a proxy session's, proxy/<random id>: a0
        last = episode[-1]
        answer = int(last) % 2 if last.isdigit() and not episode.startswith("proxy/") else 0
        ids = TOKENIZER.encode(f"r{k}{END_THINK}a{answer}") + [TOKENIZER.convert_tokens_to_ids(
            IM_END)]
        ids = ids[:request.params.max_new_tokens]
        await asyncio.sleep(0)
        return GenerateOutput(request_id=request.request_id, token_ids=ids,
                              logprobs=[-0.5] * len(ids), versions=[k] * len(ids),
                              finish_reason=FinishReason.STOP)


@dataclasses.dataclass
class Chat:
    """Answers turn 0 with a tool's result (no rewrite: the turn is still after the last user
    message), turn 1 with a user message (the template drops both turns' thinking), and ends
    after turn 2: reward 1 when its answer is ``a1``."""

    tools: object = None

    async def reset(self):
        return list(OPENING)

    async def step(self, turn: ModelTurn) -> Observation:
        if turn.turn_index == 0:
            return Observation(messages=[{"role": "tool", "content": "t0"}], done=False)
        if turn.turn_index == 1:
            return Observation(messages=[{"role": "user", "content": "more"}], done=False)
        return Observation(messages=[], done=True,
                           reward=float(turn.text.endswith("a1")))


@dataclasses.dataclass
class ChatSource:
    name: str = "chat"

    def tool_list(self):
        return []

    def environment(self, task: Task, tools) -> Chat:
        return Chat(tools=tools)


def _group(size: int = 4) -> Group:
    task = Task(uid="chat/0", source="chat", prompt_ids=tuple(RENDERER.prompt(OPENING)),
                prompt_text="go", reference="a1", harness=AGENT)
    return Group.new(task, size)


async def _run(group: Group, engine: ScriptedModel, ledger: Ledger) -> None:
    graders = GraderPool(RewardConfig(num_workers=1), lambda task: get_reward("exact_match"))
    harness = AgentHarness(renderer=RENDERER, tool_timeout_s=5.0, sources={"chat": ChatSource()},
                           budgets=Budgets(max_turns=4, max_turn_tokens=32,
                                           max_total_tokens=400))
    disp = Dispatcher(engines=[engine], params=SamplingParams(temperature=1.0),
                      graders=graders, decode=TOKENIZER.decode,
                      lifecycle=Lifecycle(ledger, WallClock()), clock=WallClock(), seed=7,
                      harnesses={AGENT: harness})
    try:
        await asyncio.wait_for(disp.run_group(group), 60)
    finally:
        graders.close()


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> Path:
    cfg = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                          intermediate_size=64, max_position=512, seed=3)
    return build_tiny_model(cfg, TOKENIZER, tmp_path_factory.mktemp("thinking-model"))


async def test_a_template_that_rewrites_history_splits_the_episode_token_exactly(
        tmp_path: Path, thinking_model: Path):
    engine, ledger, group = ScriptedModel(), Ledger(tmp_path / "ledger.jsonl"), _group()
    await _run(group, engine, ledger)
    prompt = list(group.task.prompt_ids)
    for s in group.samples:
        assert s.status is SampleStatus.GRADED, s.failure
        assert [g.kind for g in s.segments] == [SegmentKind.POLICY, SegmentKind.ENV] * 2 + [
            SegmentKind.POLICY]
        assert len(s.segments[1]) > 0 and len(s.segments[3]) == 0  # appended; then split
        (context,) = s.contexts
        assert context.num_segments == 4
        answer = f"a{s.sample_idx % 2}"
        assert TOKENIZER.decode(list(context.token_ids)) == (
            f"<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
            f"<|im_start|>tool\nt0<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
            "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n<think>")
        # every turn was served exactly the context and tokens its turn-sample trains on
        served = [r.prompt_ids for r in engine.requests if r.episode_id == s.uid]
        (first, first_ids), (second, second_ids) = pieces(s)
        assert first == prompt and list(second) == list(context.token_ids)
        turn0, env0, turn1 = (s.segments[i].token_ids for i in range(3))
        assert first_ids == turn0 + env0 + turn1 and second_ids == s.segments[4].token_ids
        assert served == [first, first + turn0 + env0, list(second)]
        mb = collate([s])
        row = mb.input_ids[0].tolist()
        assert row[:len(first) + len(first_ids)] == first + first_ids
        assert row[len(first) + len(first_ids):][:len(second) + len(second_ids)] == (
            list(second) + second_ids)
        assert [g.versions for g in s.segments if g.kind is SegmentKind.POLICY] == [
            [k] * len(s.segments[2 * k]) for k in range(3)]
    assert [s.reward for s in group.samples] == [0.0, 1.0, 0.0, 1.0]
    restored = group_from_dict(json.loads(json.dumps(group_to_dict(group))))
    assert [s.contexts for s in restored.samples] == [s.contexts for s in group.samples]

    # trained as four samples (one advantage each), every model token kept
    trainer = Trainer(TrainConfig(updates_per_step=1), thinking_model,
                      staleness=StalenessPolicy(max_staleness=4))
    samples, advantages, _ = trainer._trainable([group])
    assert samples == group.samples and len(advantages) == 4
    assert advantages[0] == advantages[2] < 0 < advantages[1] == advantages[3]
    result = trainer.step([group], step=2)
    assert result.metrics["num_samples"] == 4
    for s in group.samples:
        kept = result.kept[s.uid]
        assert kept.num_tokens == sum(len(s.segments[i]) for i in (0, 2, 4))
        s.trained_at_step, s.num_trained_tokens = 2, kept.num_tokens
        s.min_trained_version = kept.min_version
        ledger_move(ledger, s)
    ledger.close()

    rows = read_ledger(tmp_path / "ledger.jsonl")
    assert [r.sample_uid for r in rows] == [s.uid for s in group.samples]  # once each
    for row, s in zip(rows, group.samples):
        parts = row.turn_samples
        assert [p.sample_uid for p in parts] == [f"{s.uid}#t0", f"{s.uid}#t1"]
        assert [p.prompt_tokens for p in parts] == [len(prompt), len(s.contexts[0].token_ids)]
        assert [p.num_tokens for p in parts] == [sum(len(s.segments[i]) for i in range(4)),
                                                len(s.segments[4])]
        assert [(p.min_version, p.max_version) for p in parts] == [(0, 1), (2, 2)]
        assert {(p.status, p.reward, p.trained_at_step) for p in parts} == {
            (SampleStatus.TRAINED, s.reward, 2)}
    audit = audit_run(tmp_path, group_size=4, eval_group_size=1, groups_per_step=1, steps=0)
    assert (audit["duplicated_samples"], audit["lost_samples"]) == (0, 0)
    assert (audit["split_episodes"], audit["turn_samples"]) == (4, 8)
    assert audit["turn_samples_mismatched"] == 0


def ledger_move(ledger: Ledger, sample) -> None:
    Lifecycle(ledger, WallClock()).move(sample, SampleStatus.TRAINED)


async def _episode(renderer: ChatRenderer, episode: Episode | None = None) -> Episode:
    loop = AgentLoop(renderer=renderer, budgets=Budgets(max_turns=4, max_turn_tokens=32))
    return await loop.run(Chat(), episode_id="chat/0#g0/1", generate=EngineTurns(ScriptedModel()),
                          episode=episode)


async def test_an_append_only_template_gives_no_split():
    renderer = ChatRenderer(thinking_tokenizer(CHATML_TEMPLATE))
    ep = await _episode(renderer)
    assert ep.end.value == "done" and ep.num_model_turns == 3 and ep.contexts == []
    assert all(len(g) for g in ep.segments)
    check_alignment(renderer, ep.messages, ep.token_ids)


async def test_a_split_episode_resumes_by_replaying_to_the_same_context():
    whole = await _episode(RENDERER)
    assert [c.num_segments for c in whole.contexts] == [4]
    cut = Episode(prompt_ids=whole.prompt_ids, segments=whole.segments[:4],
                  turns=whole.turns[:4], contexts=list(whole.contexts))
    resumed = await _episode(RENDERER, cut)  # replays turns 0 and 1, then generates turn 2
    assert resumed.end.value == "done" and resumed.contexts == whole.contexts
    assert resumed.token_ids == whole.token_ids
    (context,) = whole.contexts
    forged = Context(num_segments=4, token_ids=context.token_ids[:-1])
    cut = Episode(prompt_ids=whole.prompt_ids, segments=whole.segments[:4],
                  turns=whole.turns[:4], contexts=[forged])
    with pytest.raises(ReplayDiverged, match=r"turn 1: .*\(the conversation anew\)"):
        await _episode(RENDERER, cut)


def test_an_end_to_end_run_trains_split_episodes_and_audits_clean(tmp_path: Path,
                                                                    thinking_model: Path):
    rows = [{"prompt": f"count {i}", "n": 3, "answer": "x"} for i in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = rollstream.run(_two_step_run(tmp_path, thinking_model, "think", {
        "name": "count", "harness": "agent",
        "environment": "tests.agent.user_pkg.envs:SyncCountdown"}))
    assert summary["steps"] == 2
    run = tmp_path / "runs" / "think"
    trained = [r for r in read_ledger(RunFiles(run).ledger) if r.status is SampleStatus.TRAINED]
    assert len(trained) == 8
    for r in trained:  # three model turns, "again" twice: two rewrites
        assert r.finish_reason == "done" and r.num_turns == 3, r
        assert len(r.turn_samples) == 3 and r.num_trained_tokens > 0
    audit = audit_run(run, group_size=2, eval_group_size=1, groups_per_step=2, steps=2)
    assert audit["duplicated_samples"] == audit["lost_samples"] == 0
    assert audit["steps_missing"] == audit["steps_repeated"] == 0
    assert (audit["split_episodes"], audit["turn_samples_mismatched"]) == (8, 0)


async def _sdk_agent(handle) -> None:
    """An SDK agent: a tool's result after its first reply, a user message after its second,
    and a last reply; it stops at a refused call."""
    messages = list(OPENING)
    async with openai.AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key,
                                  max_retries=0) as client:
        for follow in ({"role": "tool", "tool_call_id": "call_0", "content": "t0"},
                       {"role": "user", "content": "more"}, None):
            try:
                reply = await client.chat.completions.create(model="k", messages=messages,
                                                             max_tokens=32)
            except openai.BadRequestError:
                return
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            messages += [] if follow is None else [follow]


async def test_an_sdk_agent_through_the_proxy_is_split_where_the_template_rewrites():
    engine = ScriptedModel()
    async with AgentProxy([engine], TOKENIZER) as proxy:
        handle = proxy.open_session("sdk")
        await _sdk_agent(handle)
        (sample,) = proxy.close_session(handle.api_key)
    assert sample.num_calls == 3 and [c.num_segments for c in sample.contexts] == [4]
    assert len(sample.segments[3]) == 0 and TOKENIZER.decode(
        list(sample.contexts[0].token_ids)).endswith(
        "assistant\na0<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n<think>")
    first, second = turn_samples(sample.prompt_ids, len(sample.segments), sample.contexts)
    turn0, env0 = sample.segments[0].token_ids, sample.segments[1].token_ids
    assert [r.prompt_ids for r in engine.requests] == [
        list(first.prompt_ids), list(first.prompt_ids) + turn0 + env0, list(second.prompt_ids)]


async def _bound_episode(engine: ScriptedModel, binding: Binding) -> Binding:
    """The SDK agent in a session bound to ``binding``, whose turns ``engine`` generates
    after what the episode serves (as the dispatcher does for a training sample)."""
    async def generate(params, rid, on_tokens):
        ids = served_ids(binding.prompt_ids, binding.segments, binding.contexts)
        return await generate_turn(engine, ids, params, rid, binding.segments,
                                   episode_id="sdk/1")

    binding.generate = generate
    async with AgentProxy([engine], TOKENIZER) as proxy:
        handle = proxy.open_session("sdk/1", binding=binding)
        await _sdk_agent(handle)
        await proxy.end_session(handle.api_key)
    return binding


async def test_a_restored_split_sdk_episode_replays_to_the_same_context():
    def binding(**fields) -> Binding:
        return Binding(prompt_ids=list(RENDERER.prompt(OPENING)), generate=None,
                       max_total_tokens=400, max_turns=8, **fields)

    engine = ScriptedModel()
    live = await _bound_episode(engine, binding(segments=[], turns=[]))
    assert live.refused is None and [c.num_segments for c in live.contexts] == [4]
    assert len(engine.requests) == 3 and len(live.segments) == 5
    restored = await _bound_episode(engine, binding(
        segments=copy.deepcopy(live.segments[:4]), turns=copy.deepcopy(live.turns[:4]),
        contexts=list(live.contexts), recorded=4))
    assert len(engine.requests) == 4  # turns 0 and 1 answered from the record
    assert restored.refused is None and restored.contexts == live.contexts
    assert [g.token_ids for g in restored.segments] == [g.token_ids for g in live.segments]
    (context,) = live.contexts
    forged = Context(num_segments=4, token_ids=context.token_ids[:-1])
    diverged = await _bound_episode(engine, binding(
        segments=copy.deepcopy(live.segments[:4]), turns=copy.deepcopy(live.turns[:4]),
        contexts=[forged], recorded=4))
    assert "the conversation renders anew to" in diverged.refused
    assert len(engine.requests) == 4


def test_an_sdk_agent_run_trains_split_episodes_and_audits_clean(tmp_path: Path,
                                                                 thinking_model: Path):
    rows = [{"prompt": f"guess {i}", "target": 40 + i, "answer": "x"} for i in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = rollstream.run(_two_step_run(tmp_path, thinking_model, "sdk", {
        "name": "sdk", "harness": "openai", "agent": "tests.agent.user_pkg.agents:guess",
        "tools": ["tests.agent.user_pkg.tools:Length"]}))
    assert summary["steps"] == 2
    run = tmp_path / "runs" / "sdk"
    rows = read_ledger(RunFiles(run).ledger)
    assert len(rows) == 8 and {r.status for r in rows} == {SampleStatus.TRAINED}, rows[0]
    split = [r for r in rows if r.turn_samples]
    assert split and all(len(r.turn_samples) == r.num_turns == 2 for r in split)
    audit = audit_run(run, group_size=2, eval_group_size=1, groups_per_step=2, steps=2)
    assert audit["duplicated_samples"] == audit["lost_samples"] == 0
    assert (audit["split_episodes"], audit["turn_samples_mismatched"]) == (len(split), 0)


def _two_step_run(tmp_path: Path, model: Path, name: str, source: dict) -> dict:
    """A sync run of 2 steps x 2 groups of 2 on ``model`` whose one source (``source``, graded
    by exact match) reads ``tmp_path/rows.jsonl``."""
    return two_step_run(tmp_path, model, name, [{
        **source, "kind": "jsonl", "path": str(tmp_path / "rows.jsonl"),
        "reward": "exact_match"}], max_slots=8, max_new_tokens=120)
