"""The engine contract tests (tests/engine/test_contract.py) against the ``ray`` kind: the
local engine in a Ray actor, behind the runtime's proxy (one local Ray and one actor for the
module, tests/engine/ray_shared.py).

A module of its own so that its Ray runs only while these tests do: alongside the vLLM
cases of the contract module, the extra processes slowed vLLM's API server enough that two
mid-stream cases skipped in CI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import engine_case, tiny_model_dir, tiny_moe_dir  # noqa: F401 (fixtures)
from tests.engine.test_contract import *  # noqa: F403 (the contract's tests)

pytestmark = pytest.mark.ray


@pytest.fixture
async def engine(request: pytest.FixtureRequest, tiny_model_dir: Path):  # noqa: F811
    async with engine_case("ray", request, tiny_model_dir) as case:
        yield case


async def test_an_engine_actor_returns_the_routing_of_every_token(
        request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_moe_dir: Path) -> None:  # noqa: F811
    """Routing replay on Ray: a mixture-of-experts model's engine actor returns the experts
    every token of prompt + output was routed to, as the local engine does on its own, also
    for an episode's next turn sent as the tokens added to the history the actor keeps. And
    the actor's engine keeps the episode's turn in its prefix cache as the local one does:
    the next turn prefills only what follows the first turn's whole blocks."""
    from rollstream.config.schema import LocalEngineConfig
    from rollstream.engine import GenerateRequest, SamplingParams
    from rollstream.engine.local import LocalEngine
    from rollstream.runtime.ray.engines import build_ray_engines
    from rollstream.train.routing import routing_ids
    from tests.engine.helpers import MAX_SEQ_LEN

    async with engine_case("ray", request, tiny_model_dir):  # the module's Ray is up
        pass
    cfg = LocalEngineConfig(max_slots=4, max_seq_len=MAX_SEQ_LEN, threads=1, device="cpu")
    actor = build_ray_engines(tiny_moe_dir, cfg, num_engines=1, version=0, num_cpus=1)[0]
    local = LocalEngine(tiny_moe_dir, cfg, engine_id="local")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    try:
        first = [5, 17, 33, 2, 60]
        turns, hits = [], []
        for engine, stats in ((actor, actor.actor.stats.remote), (local, local.stats)):
            a = await engine.generate(GenerateRequest(request_id="t1", prompt_ids=first,
                                                      params=greedy, episode_id="e"))
            second = [*first, *a.token_ids, 9, 40, 41]
            b = await engine.generate(GenerateRequest(request_id="t2", prompt_ids=second,
                                                      params=greedy, episode_id="e"))
            turns.append((a, b))
            work = stats()
            hits.append((await work if engine is actor else work).work["prefix_hit_tokens"])
        assert actor.wire.reused_tokens > 0, "the second turn extended the actor's history"
        assert hits[0] == hits[1] >= 16, hits  # the first turn's whole block, kept
    finally:
        await actor.close()
        await local.close()
    for got, want in zip(*turns, strict=True):
        assert got.token_ids == want.token_ids and got.routing is not None
        assert got.routing == want.routing
    (a, b), _ = turns
    assert routing_ids(b.routing).shape[0] == len(first) + len(a.token_ids) + 3 \
        + len(b.token_ids)  # the whole sequence, the history the actor kept included
