"""Faults and liveness: dying engines lose no token and duplicate no sample; a run that cannot
train ends in bounded time with a diagnostic naming the cause. The dispatcher, rollout,
controller, graders and ledger are real; engines and the trainer are doubles at the process
edge (tests/rollout/fakes.py)."""

from __future__ import annotations

import asyncio
import time

from rollstream.data.ledger import read_ledger
from tests.engine.test_local_faults import _Decode

from .fakes import RandomEngine
from .test_controller import check_invariants, run_controller


def _tokens_made(engines: list[RandomEngine]) -> dict[str, int]:
    made: dict[str, int] = {}
    for e in engines:
        for uid, n in e.tokens_by_sample.items():
            made[uid] = made.get(uid, 0) + n
    return made


def test_a_dying_engine_loses_no_token_and_duplicates_no_sample(tmp_path):
    engines: list[RandomEngine] = []

    def make():  # rand-0 dies mid-run, with requests in flight; rand-1 carries on
        engines.extend([RandomEngine(7, "rand-0", die_after_tokens=150),
                        RandomEngine(8, "rand-1")])
        return engines

    loop, res, ledger, trainer = run_controller(tmp_path, mode="async", k=2,
                                                on_update="continue", seed=7, steps=8,
                                                engines=make)
    check_invariants(tmp_path, loop, res, ledger, trainer, 2)
    assert engines[0].dead and res.steps_done == 8 and not res.stop_reason
    assert loop.dispatcher.stats.num_engine_failures > 0
    rows = read_ledger(tmp_path / "ledger.jsonl")
    assert not any(r.status == "failed" for r in rows)  # retried elsewhere, not failed
    # the partial tokens of interrupted requests were kept: each sample holds exactly what
    # the engines generated for it, including what rand-0 made before it died
    assert {r.sample_uid: r.num_tokens for r in rows if r.num_tokens} == \
        _tokens_made(engines)
    resumed = {uid for uid in engines[0].tokens_by_sample if uid in engines[1].tokens_by_sample}
    assert resumed, "some samples were started on rand-0 and finished on rand-1"
    assert all(v == 8 for v, _ in engines[1].loads[-1:])  # weights went to the live engine only


def test_all_engines_dead_stops_the_run_with_the_cause(tmp_path):
    def make():
        return [RandomEngine(1, "rand-0", die_after_tokens=40),
                RandomEngine(2, "rand-1", die_after_tokens=60)]

    t0 = time.perf_counter()
    loop, res, ledger, trainer = run_controller(tmp_path, mode="async", k=1,
                                                on_update="interrupt", seed=1, steps=50,
                                                engines=make)
    assert time.perf_counter() - t0 < 30
    assert res.stalled and res.steps_done < 50
    assert res.stop_reason.startswith("no engine is alive")
    assert "rand-0: engine rand-0 died (injected fault)" in res.stop_reason
    assert not ledger.unfinished()
    rows = read_ledger(tmp_path / "ledger.jsonl")
    aborted = [r for r in rows if r.status == "aborted"]
    assert aborted and all(r.reason for r in aborted)


def _stalled(tmp_path, **kw):
    t0 = time.perf_counter()
    loop, res, ledger, trainer = run_controller(tmp_path, mode="async", k=1,
                                                on_update="interrupt", seed=3, steps=20,
                                                max_untrainable_streak=12, **kw)
    wall = time.perf_counter() - t0
    assert res.stalled and res.steps_done == 0, res
    assert not ledger.unfinished() and wall < 30
    return res.stop_reason


def test_a_reward_that_always_fails_stops_the_run(tmp_path):
    def broken(task, text):
        raise ValueError("cannot parse the answer")

    why = _stalled(tmp_path, reward=broken)
    assert why.startswith("12 groups in a row could not be trained")
    assert "failed: reward: ValueError: cannot parse the answer" in why
    assert "(e.g. t/" in why  # an example sample uid


def test_prompts_that_never_fit_stop_the_run(tmp_path):
    why = _stalled(tmp_path, engines=lambda: [RandomEngine(1, error_prompts=True)])
    assert "failed: engine error: prompt of N tokens does not fit" in why


def test_groups_without_reward_variance_stop_the_run(tmp_path):
    why = _stalled(tmp_path, reward=lambda task, text: 1.0)
    assert "filtered: zero reward variance in group (every reward N)" in why


def test_a_low_trainable_share_stops_the_run(tmp_path):
    """One group in three trainable is below a floor of 0.5 over a window of 12 groups."""
    def reward(task, text):
        return float(len(text) % 2) if int(task.uid.split("/")[1]) % 3 == 0 else 1.0

    t0 = time.perf_counter()
    loop, res, ledger, trainer = run_controller(
        tmp_path, mode="async", k=1, on_update="interrupt", seed=3, steps=40,
        reward=reward, min_trainable_share=0.5, trainable_share_window=12)
    assert res.stalled and time.perf_counter() - t0 < 30
    assert res.stop_reason.startswith("only ")
    assert "of the last 12 groups could be trained" in res.stop_reason


def test_max_wall_s_ends_a_run_whose_engines_never_finish(tmp_path):
    t0 = time.perf_counter()
    loop, res, ledger, trainer = run_controller(
        tmp_path, mode="async", k=1, on_update="interrupt", seed=3, steps=5,
        engines=lambda: [RandomEngine(1, hang=True)], max_wall_s=1.0)
    assert 0.9 < time.perf_counter() - t0 < 10
    assert res.stop_reason == "max_wall_s = 1 s reached" and not res.stalled
    assert res.steps_done == 0 and not ledger.unfinished()
    rows = read_ledger(tmp_path / "ledger.jsonl")
    assert rows and all(r.status == "aborted" for r in rows)


async def _one_reward(task, text: str) -> float:
    return 1.0


def test_a_failing_local_engine_hands_its_samples_to_the_other(tmp_path):
    """Two real local engines; one's step loop raises mid-generation. Its samples come back
    with their partial tokens, are resumed on the other engine, and each ends with exactly the
    tokens its engines delivered (the dispatcher's spans add up to the sample's length)."""
    from rollstream.clock import WallClock
    from rollstream.config import RewardConfig
    from rollstream.config.schema import LocalEngineConfig
    from rollstream.data.ledger import Ledger
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import EngineHealth, SamplingParams
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle
    from rollstream.trajectory import Group, SampleStatus, Task
    from tests.engine.helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "m")
    cfg = LocalEngineConfig(max_slots=8, max_seq_len=96, threads=1, device="cpu",
                            max_restarts=0)  # nobody restarts it here: it is DEAD
    spans: list[dict] = []

    async def main():
        a, b = LocalEngine(model, cfg, engine_id="a"), LocalEngine(model, cfg, engine_id="b")
        _Decode(a, fail_at=12)  # a's step loop raises on its 12th decode
        reward = get_reward(_one_reward)
        graders = GraderPool(RewardConfig(), lambda task: reward)
        disp = Dispatcher(engines=[a, b], params=SamplingParams(max_new_tokens=40, seed=None),
                          graders=graders, decode=lambda ids: "", clock=WallClock(),
                          lifecycle=Lifecycle(Ledger(), WallClock()),
                          span=lambda **kw: spans.append(kw))
        groups = [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=(3 + i, 5, 7, 9),
                                 prompt_text="", reference=""), 2) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(disp.run_group(g) for g in groups)), 120)
        health = a.stats().health, b.stats().health
        await a.close()
        await b.close()
        graders.close()
        return groups, disp, health

    groups, disp, health = asyncio.run(main())
    assert health == (EngineHealth.DEAD, EngineHealth.UP)
    assert disp.stats.num_engine_failures > 0
    samples = [s for g in groups for s in g.samples]
    assert all(s.status is SampleStatus.GRADED for s in samples)
    delivered: dict[str, int] = {}
    for sp in spans:
        delivered[sp["sample_uid"]] = delivered.get(sp["sample_uid"], 0) + sp["num_tokens"]
    assert {s.uid: s.num_response_tokens for s in samples} == delivered
    moved = {sp["sample_uid"] for sp in spans if sp["engine_id"] == "a" and sp["num_tokens"]} & \
        {sp["sample_uid"] for sp in spans if sp["engine_id"] == "b"}
    assert moved, "samples with tokens from the dead engine were finished on the other"


def test_a_dead_local_engine_is_restarted_at_the_current_version(tmp_path):
    """The only engine's step loop raises mid-generation after weights of version 1 were
    loaded. Its requests return their partial tokens and wait (no engine is UP, one is
    RECOVERING); the supervisor restarts it with version 1's weights; it takes the work again.
    No token is lost (spans add up), every token is version 1, and the restarted engine
    samples exactly what version 1's weights give (greedy, compared with a fresh engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollstream.clock import WallClock
    from rollstream.config import RewardConfig
    from rollstream.config.schema import LocalEngineConfig
    from rollstream.data.ledger import Ledger
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import EngineHealth, GenerateRequest, SamplingParams
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle
    from rollstream.rollout.supervisor import EngineSupervisor
    from rollstream.sync.weights import WeightSync
    from rollstream.trajectory import Group, SampleStatus, Task
    from tests.engine.helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "m")
    cfg = LocalEngineConfig(max_slots=8, max_seq_len=96, threads=1, device="cpu",
                            max_restarts=1)
    weights1 = {k: v + 0.01 * torch.randn_like(v) for k, v in AutoModelForCausalLM
                .from_pretrained(model, dtype=torch.float32).state_dict().items()}
    spans: list[dict] = []
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)

    async def main():
        a = LocalEngine(model, cfg, engine_id="a")
        reward = get_reward(_one_reward)
        graders = GraderPool(RewardConfig(), lambda task: reward)
        disp = Dispatcher(engines=[a], params=SamplingParams(max_new_tokens=40, seed=None),
                          graders=graders, decode=lambda ids: "", clock=WallClock(),
                          lifecycle=Lifecycle(Ledger(), WallClock()),
                          span=lambda **kw: spans.append(kw))
        sync = WeightSync([a], disp, "continue", lambda v, s: None)
        restarts: list[tuple[str, int]] = []
        supervisor = EngineSupervisor([a], sync,
                                      on_restart=lambda e, s: restarts.append((e, sync.version)))
        loops = [asyncio.create_task(sync.run()), asyncio.create_task(supervisor.run())]
        sync.publish(1, weights1)
        await sync.wait_applied()
        # after the load: its 3rd decode raises (the 10th came after the groups' last on a busy
        # machine, whose samples were then admitted together and took fewer steps)
        _Decode(a, fail_at=3)
        groups = [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=(3 + i, 5, 7, 9),
                                 prompt_text="", reference=""), 2) for i in range(6)]
        await asyncio.wait_for(asyncio.gather(*(disp.run_group(g) for g in groups)), 120)
        # the engine serves from inside its restart, so on a busy machine the work can end
        # before the supervisor's restart call returns and reports it
        async with asyncio.timeout(30):
            while not restarts:
                await asyncio.sleep(0.05)
        after = await a.generate(GenerateRequest(request_id="after", prompt_ids=[3, 5, 7],
                                                 params=greedy))
        stats = a.stats()
        for t in loops:
            t.cancel()
        await a.close()
        fresh = LocalEngine(model, cfg, engine_id="fresh")
        await fresh.load_weights(1, weights1)
        want = await fresh.generate(GenerateRequest(request_id="want", prompt_ids=[3, 5, 7],
                                                    params=greedy))
        await fresh.close()
        graders.close()
        return groups, disp, stats, restarts, after, want

    groups, disp, stats, restarts, after, want = asyncio.run(main())
    assert restarts == [("a", 1)] and stats.health is EngineHealth.UP and stats.version == 1
    assert disp.stats.num_engine_failures > 0, "the fault landed while requests ran"
    samples = [s for g in groups for s in g.samples]
    assert all(s.status is SampleStatus.GRADED for s in samples), \
        [(s.uid, s.status, s.failure) for s in samples if s.status is not SampleStatus.GRADED]
    assert all(set(s.versions) == {1} for s in samples)
    delivered: dict[str, int] = {}
    for sp in spans:
        delivered[sp["sample_uid"]] = delivered.get(sp["sample_uid"], 0) + sp["num_tokens"]
    assert {s.uid: s.num_response_tokens for s in samples} == delivered
    failed_at = min(sp["t_end_s"] for sp in spans if sp["outcome"] == "interrupted")
    assert any(sp["t_start_s"] >= failed_at and sp["num_tokens"] for sp in spans), \
        "the restarted engine took work again"
    assert after.token_ids == want.token_ids and after.versions == [1] * len(want.token_ids)


def test_a_drained_engine_hands_its_requests_to_the_other(tmp_path):
    """Preemption: drain("a") mid-generation interrupts a's requests at a token boundary; they
    continue on b from their tokens (spans add up, nothing starts on a afterwards); a drained
    engine that is the only one left makes requests wait, not fail; undrain routes to it again."""
    from rollstream.clock import WallClock
    from rollstream.config import RewardConfig
    from rollstream.config.schema import LocalEngineConfig
    from rollstream.data.ledger import Ledger
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import SamplingParams
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle
    from rollstream.trajectory import Group, SampleStatus, Task
    from tests.engine.helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "m")
    cfg = LocalEngineConfig(max_slots=8, max_seq_len=96, threads=1, device="cpu")
    spans: list[dict] = []
    clock = WallClock()

    def groups(tag: str, n: int) -> list:
        return [Group.new(Task(uid=f"{tag}/{i}", source="t", prompt_ids=(3 + i, 5, 7, 9),
                               prompt_text="", reference=""), 2) for i in range(n)]

    async def main():
        a, b = LocalEngine(model, cfg, engine_id="a"), LocalEngine(model, cfg, engine_id="b")
        reward = get_reward(_one_reward)
        graders = GraderPool(RewardConfig(), lambda task: reward)
        disp = Dispatcher(engines=[a, b], params=SamplingParams(max_new_tokens=60, seed=None),
                          graders=graders, decode=lambda ids: "", clock=clock,
                          lifecycle=Lifecycle(Ledger(), clock),
                          span=lambda **kw: spans.append(kw))
        first = groups("t", 8)
        run = asyncio.gather(*(disp.run_group(g) for g in first))
        while a.stats().generated_tokens < 40:
            await asyncio.sleep(0.005)
        handed_back = await disp.drain("a")
        t_drain = clock.now()
        await asyncio.wait_for(run, 120)
        disp.undrain("b")  # no-op: b was never drained
        await disp.drain("b")  # both drained: a new request waits instead of failing
        waiting = asyncio.ensure_future(disp.run_group(groups("w", 1)[0]))
        await asyncio.sleep(0.3)
        assert not waiting.done() and disp.fatal is None
        disp.undrain("a")
        later = await asyncio.wait_for(waiting, 60)
        await a.close()
        await b.close()
        graders.close()
        return first, later, handed_back, t_drain

    first, later, handed_back, t_drain = asyncio.run(main())
    assert handed_back > 0
    samples = [s for g in first for s in g.samples]
    assert all(s.status is SampleStatus.GRADED for s in samples)
    delivered: dict[str, int] = {}
    for sp in spans:
        delivered[sp["sample_uid"]] = delivered.get(sp["sample_uid"], 0) + sp["num_tokens"]
    assert {s.uid: s.num_response_tokens for s in samples} == \
        {u: n for u, n in delivered.items() if u.startswith("t/")}
    assert not [sp for sp in spans if sp["engine_id"] == "a" and sp["t_start_s"] > t_drain
                and sp["sample_uid"].startswith("t/")], "nothing started on a after the drain"
    moved = {sp["sample_uid"] for sp in spans if sp["engine_id"] == "a" and sp["num_tokens"]} & \
        {sp["sample_uid"] for sp in spans if sp["engine_id"] == "b"}
    assert moved, "samples with tokens from the drained engine were finished on the other"
    assert all(sp["engine_id"] == "a" for sp in spans if sp["sample_uid"].startswith("w/"))
    assert all(s.status is SampleStatus.GRADED for s in later.samples)
