"""The data plane's pure parts (runtime/ray/dataplane.py), no Ray: packed tokens round-trip
exactly, and the driver's mirror and the actor's histories, driven together through random
episodes with evictions on either side, never build a prompt other than the request's; and
the dispatcher names each sample's episode and ends it once (engine doubles)."""

from __future__ import annotations

import asyncio
import random

from rollstream.engine.protocol import (
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
)
from rollstream.runtime.ray.dataplane import (
    Episodes,
    Histories,
    PeekCursor,
    pack,
    pack_ids,
    unpack_ids,
)


def test_packed_tokens_round_trip_exactly():
    ids, versions = [0, 5, 2**31 - 1, 70_000], [3, 3, 4, 4]
    single = [-0.5, -1.25, -3.0, 0.0]  # float32-exact: 4 bytes each
    t = pack(ids, single, versions)
    assert t.unpack() == (ids, single, versions)
    assert len(t.ids) == len(t.logprobs) == 16 and len(t.runs) == 2 * 2 * 8  # two runs
    double = [-0.1, -1.25, -3.0, 0.0]  # -0.1 is not a float32: sent as float64
    t = pack(ids, double, [1, 2, 1, 1])
    assert t.unpack() == (ids, double, [1, 2, 1, 1]) and len(t.logprobs) == 32
    assert pack([], [], []).unpack() == ([], [], [])
    assert unpack_ids(pack_ids(ids)) == ids


def _output(rid: str, ids: list[int], reason=FinishReason.STOP) -> GenerateOutput:
    return GenerateOutput(request_id=rid, token_ids=ids, logprobs=[-1.0] * len(ids),
                          versions=[0] * len(ids), finish_reason=reason)


def _call(episodes: Episodes, histories: Histories, request: GenerateRequest,
          new: list[int], reason=FinishReason.STOP) -> tuple[bool, bool]:
    """One generate as the proxy and the actor run it (the actor checks that it built the
    request's prompt): (whether it sent a delta the actor used, whether the actor missed)."""
    for whole in (False, True):
        call, ids = episodes.plan(request, whole=whole)
        prompt = histories.prompt(call, list(ids))
        if prompt is None:
            episodes.done(request, call, None)
            continue
        assert prompt == request.prompt_ids, "the actor built another prompt"
        out = _output(request.request_id, new, reason)
        if reason is not FinishReason.ERROR:
            histories.keep(call.stamp, prompt + new)
        episodes.done(request, call, out)
        return call.base != 0, whole
    raise AssertionError("a whole prompt missed")


def test_a_continuing_request_sends_only_the_added_tokens():
    eps, hist = Episodes(1000), Histories(1000)
    req = GenerateRequest(request_id="a/0", prompt_ids=[1, 2, 3], episode_id="a")
    call, ids = eps.plan(req)
    assert (call.base, ids) == (0, [1, 2, 3]) and call.stamp > 0
    hist.keep(call.stamp, [1, 2, 3, 7, 8])
    eps.done(req, call, _output("a/0", [7, 8]))
    nxt = GenerateRequest(request_id="a/1", prompt_ids=[1, 2, 3, 7, 8, 9], episode_id="a")
    call2, ids = eps.plan(nxt)
    assert (call2.base, ids) == (call.stamp, [9])
    assert hist.prompt(call2, ids) == nxt.prompt_ids
    # a prompt that does not extend the history goes whole, and the stale one is dropped there
    eps.done(nxt, call2, _output("a/1", [4]))
    other = GenerateRequest(request_id="a/2", prompt_ids=[1, 2, 3, 0], episode_id="a")
    call3, ids = eps.plan(other)
    assert (call3.base, ids, call3.forget) == (0, [1, 2, 3, 0], (call2.stamp,))
    # no episode id, or no cache: whole and nothing kept
    alone = GenerateRequest(request_id="x", prompt_ids=[5])
    assert eps.plan(alone)[0].stamp == 0
    off = Episodes(0)
    assert off.plan(req)[0].stamp == 0 and off.plan(req)[1] == [1, 2, 3]


def test_an_ended_or_moved_episode_is_forgotten_by_the_actor_that_held_it():
    holders: dict[str, Episodes] = {}
    a, b = Episodes(1000, holders), Episodes(1000, holders)
    req = GenerateRequest(request_id="e/0", prompt_ids=[1, 2], episode_id="e")
    call, _ = a.plan(req)
    a.done(req, call, _output("e/0", [3]))
    moved = GenerateRequest(request_id="e/1", prompt_ids=[1, 2, 3], episode_id="e")
    call_b, ids = b.plan(moved)  # continued on the other engine: sent whole there
    assert call_b.base == 0 and ids == [1, 2, 3] and holders["e"] is b
    nxt, _ = a.plan(GenerateRequest(request_id="z", prompt_ids=[9]))
    assert nxt.forget == (call.stamp,)  # a's actor drops it with a's next call
    b.done(moved, call_b, _output("e/1", [4]))
    a.end("e")  # the dispatcher may tell any engine: the holder forgets
    assert "e" not in holders and b.plan(GenerateRequest(request_id="y", prompt_ids=[1])
                                         )[0].forget == (call_b.stamp,)
    assert b.num_tokens == 0


def test_random_episodes_never_build_a_wrong_prompt():
    """Random episodes (turns, resubmissions, errors, prompts that do not extend, cancelled
    calls, restarts), the actor keeping fewer tokens than the driver mirrors: every prompt the
    actor builds is the request's; histories are reused, and misses resend it whole."""
    rng = random.Random(0)
    eps, hist = Episodes(800), Histories(300)  # the actor evicts before the driver does
    prompts: dict[str, list[int]] = {}
    reused = misses = 0
    for i in range(3000):
        eid = f"e{rng.randrange(8)}"
        prompt = prompts.get(eid) or [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.05:  # a template that is not append-only: a changed token
            prompt = [*prompt[:-1], prompt[-1] + 1]
        req = GenerateRequest(request_id=f"{eid}/{i}", prompt_ids=prompt, episode_id=eid)
        new = [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        r = rng.random()
        if r < 0.03:  # restart: a new actor holds nothing
            hist = Histories(300)
            eps.reset()
            continue
        if r < 0.06:  # cancelled: the actor may have kept it, the driver never heard back
            call, ids = eps.plan(req)
            if (built := hist.prompt(call, list(ids))) is not None:
                assert built == prompt
                hist.keep(call.stamp, built + new)
            eps.done(req, call, None)
            prompts.pop(eid, None)
            continue
        reason = FinishReason.ERROR if r < 0.09 else FinishReason.STOP
        delta, missed = _call(eps, hist, req, new, reason)
        reused, misses = reused + delta, misses + missed
        if reason is FinishReason.ERROR or len(prompt) > 200 or rng.random() < 0.1:
            prompts.pop(eid, None)
            eps.end(eid)
        else:  # the next turn: the output, then what the environment adds
            prompts[eid] = prompt + new + [rng.randrange(50) for _ in range(rng.randrange(4))]
        assert eps.num_tokens <= 800 and hist.num_tokens <= 300
    assert misses > 300 and reused > 1000, (misses, reused)  # 498 and 1,388 with seed 0


def test_peeks_send_only_the_tokens_since_the_last_peek():
    cursor = PeekCursor()
    entries, t = cursor.deltas([_output("r", [1, 2]), _output("s", [5])])
    assert entries == (("r", 0, 2), ("s", 0, 1)) and t.unpack()[0] == [1, 2, 5]
    entries, t = cursor.deltas([_output("r", [1, 2, 3, 4]), _output("s", [5])])
    assert entries == (("r", 2, 2),) and t.unpack()[0] == [3, 4]
    entries, _ = cursor.deltas([_output("s", [5, 6])])  # r finished
    assert entries == (("s", 1, 1),)
    entries, _ = cursor.deltas([_output("r", [1])])  # r not in the last peek: from 0 again
    assert entries == (("r", 0, 1),)


def test_sampling_params_ride_the_call():
    params = SamplingParams(temperature=0.5, max_new_tokens=3, seed=4)
    req = GenerateRequest(request_id="p", prompt_ids=[1], params=params, episode_id="p")
    assert Episodes(10).plan(req)[0].params is params


async def test_the_dispatcher_names_each_samples_episode_and_ends_it_once():
    """Every request of a sample (its resubmissions after interrupts too) carries the sample's
    uid as its episode; when the sample's run ends, the engine of its last request is told,
    once."""
    from rollstream.clock import WallClock
    from rollstream.config import RewardConfig
    from rollstream.data.ledger import Ledger
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle
    from tests.rollout.fakes import RandomEngine, _reward_one, task_groups

    class Keeping(RandomEngine):  # a KeepsEpisodes double
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.episodes: dict[str, str] = {}  # request id -> episode id
            self.ended: list[str] = []

        async def generate(self, request: GenerateRequest) -> GenerateOutput:
            self.episodes[request.request_id] = request.episode_id
            return await super().generate(request)

        def end_episode(self, episode_id: str) -> None:
            self.ended.append(episode_id)

    engines = [Keeping(1, "a", max_delay_s=0.004, max_len=20),
               Keeping(2, "b", max_delay_s=0.004, max_len=20)]
    reward = get_reward(_reward_one)
    graders = GraderPool(RewardConfig(), lambda task: reward)
    disp = Dispatcher(engines=engines, params=SamplingParams(max_new_tokens=20),
                      graders=graders, decode=lambda ids: "", clock=WallClock(),
                      lifecycle=Lifecycle(Ledger(), WallClock()))
    groups = task_groups(0, 4)
    try:
        run = asyncio.gather(*(disp.run_group(g) for g in groups))
        while sum(e.generated for e in engines) < 10:
            await asyncio.sleep(0.002)
        await disp.interrupt(None)  # some samples resume: a second request, same episode
        await asyncio.wait_for(run, 30)
    finally:
        graders.close()
    samples = [s for g in groups for s in g.samples]
    assert sum(s.num_interrupts for s in samples) > 0
    for e in engines:
        for rid, eid in e.episodes.items():
            assert eid == rid.split("@")[0]  # the dispatcher's request ids: uid@n
    assert sorted(eid for e in engines for eid in e.ended) == sorted(s.uid for s in samples)
    for s in samples:
        assert s.uid in next(e for e in engines if e.engine_id == s.engine_id).ended
