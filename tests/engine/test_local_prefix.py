"""The local engine's prefix cache (engine/local/prefix.py): the same tokens and logprobs as
without it, fewer tokens prefilled, never reused across weight versions unless ``keep``."""

from __future__ import annotations

import asyncio
import collections
import random

import pytest
import torch

from rollstream.config.schema import LocalEngineConfig
from rollstream.engine import GenerateRequest, SamplingParams
from rollstream.engine.local import LocalEngine
from rollstream.engine.local.prefix import PrefixCache, PrefixIndex
from rollstream.engine.local.weights import ModelSpec
from tests.engine.helpers import MAX_SEQ_LEN, VOCAB
from tests.engine.test_local import _load_mid_stream, _state_dict

BLOCK = 16


def _local(path, **kw) -> LocalEngine:
    cfg = {"max_slots": 4, "max_seq_len": MAX_SEQ_LEN, "threads": 1, "device": "cpu"} | kw
    return LocalEngine(path, LocalEngineConfig(**cfg))


def _req(rid: str, prompt: list[int], **params) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=SamplingParams(**params))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _computed(work: dict[str, float]) -> float:
    """Prompt tokens the engine ran through the model (separate and fused prefills)."""
    return work["prefill_tokens"] + work["fused_prefill_tokens"]


def _assert_same(outs, refs) -> None:
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids and out.token_ids == ref.token_ids, out.request_id
        assert out.versions == ref.versions
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-4


def _group_requests(seed: int, tag: str = "") -> list[GenerateRequest]:
    """Two groups of 6 (a 60-token prompt; 20 shared tokens + 30 of their own), greedy and
    seeded samples, and prompts sharing only part of a group's prompt."""
    rng = random.Random(seed)
    shared = _tokens(rng, 20)
    prompts = [_tokens(rng, 60), shared + _tokens(rng, 30)]
    reqs = [_req(f"{tag}g{g}-{i}", p, max_new_tokens=rng.randint(5, 30),
                 **({"temperature": 0.0} if i % 2 else {"temperature": 1.0, "seed": i}))
            for g, p in enumerate(prompts) for i in range(6)]
    reqs += [_req(f"{tag}x{i}", prompts[0][:40] + _tokens(rng, 10), max_new_tokens=12,
                  temperature=0.0) for i in range(3)]
    rng.shuffle(reqs)
    return reqs


@pytest.mark.parametrize("fuse", [True, False])
async def test_batched_groups_equal_without_the_cache_and_prefill_less(tiny_model_dir, fuse):
    """Groups submitted together (4 rows, so most wait and join running rows): every sample's
    tokens, logprobs and versions are those of the engine without the cache, and the cache
    saved exactly the tokens it reports as hits."""
    reqs = _group_requests(seed=3)
    outs, works = {}, {}
    for tokens in (0, 4096):
        e = _local(tiny_model_dir, prefix_cache_tokens=tokens, fuse_prefill=fuse)
        try:
            outs[tokens] = await asyncio.gather(*(e.generate(r) for r in reqs))
            works[tokens] = e.stats().work
        finally:
            await e.close()
    _assert_same(outs[4096], outs[0])
    off, on = works[0], works[4096]
    total = sum(len(r.prompt_ids) for r in reqs)
    assert _computed(off) == total and off["prefix_hit_tokens"] == 0
    assert on["prefix_query_tokens"] == total
    # each group's first sample computes its prompt; the 5 others find 3 (59 // 16) blocks
    assert on["prefix_hit_tokens"] >= 2 * 5 * 3 * BLOCK
    assert _computed(on) == total - on["prefix_hit_tokens"]


async def test_a_second_identical_prompt_prefills_only_the_uncached_tokens(tiny_model_dir):
    """40 tokens: the second request finds 2 whole blocks (32 tokens) and prefills 8; a
    prompt that differs in its second block reuses only the first."""
    rng = random.Random(5)
    prompt = _tokens(rng, 40)
    e = _local(tiny_model_dir, prefix_cache_tokens=1024)
    try:
        first = await e.generate(_req("a", prompt, temperature=0.0, max_new_tokens=8))
        before = e.stats().work
        second = await e.generate(_req("b", prompt, temperature=0.0, max_new_tokens=8))
        after = e.stats().work
        other = prompt[:20] + _tokens(rng, 20)
        await e.generate(_req("c", other, temperature=0.0, max_new_tokens=8))
        last = e.stats().work
    finally:
        await e.close()
    assert first.token_ids == second.token_ids
    assert max(abs(a - b) for a, b in zip(first.logprobs, second.logprobs)) < 1e-4
    assert _computed(before) == 40
    assert _computed(after) - _computed(before) == 8
    assert after["prefix_hit_tokens"] == 32 and after["prefix_query_tokens"] == 80
    assert last["prefix_hit_tokens"] - after["prefix_hit_tokens"] == BLOCK
    assert _computed(last) - _computed(after) == 40 - BLOCK


async def test_an_interrupted_sample_resumes_from_its_cached_prompt_and_tokens(tiny_model_dir):
    """An interrupt keeps the row's whole blocks (prompt + partial tokens); the resumed
    request (prompt + partial, same seed) prefills only what follows them and continues the
    uninterrupted run exactly."""
    rng = random.Random(9)
    prompt, max_new = _tokens(rng, 30), 90  # room for the interrupt to land mid-stream
    kw = {"temperature": 1.0, "seed": 17}
    ref_engine = _local(tiny_model_dir, prefix_cache_tokens=0)
    try:
        whole = await ref_engine.generate(_req("w", prompt, max_new_tokens=max_new, **kw))
    finally:
        await ref_engine.close()
    e = _local(tiny_model_dir, prefix_cache_tokens=1024)
    try:
        task = asyncio.create_task(e.generate(_req("p", prompt, max_new_tokens=max_new, **kw)))
        while e.stats().generated_tokens < 20:
            await asyncio.sleep(0.0005)
        await e.interrupt(["p"])
        part = await task
        k = len(part.token_ids)
        assert 20 <= k < max_new
        before = e.stats().work
        rest = await e.generate(_req("r", prompt + part.token_ids, max_new_tokens=max_new - k,
                                     **kw))
        after = e.stats().work
    finally:
        await e.close()
    assert part.token_ids + rest.token_ids == whole.token_ids
    assert max(abs(a - b) for a, b in
               zip(part.logprobs + rest.logprobs, whole.logprobs)) < 1e-4
    held = (30 + k - 1) // BLOCK * BLOCK  # the row held keys and values up to its last token
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == held
    assert _computed(after) - _computed(before) == 30 + k - held


async def test_a_batch_interrupted_and_resumed_together_continues_each_run(tiny_model_dir):
    """A group of 4 (greedy and seeded) interrupted together mid-stream and resumed together
    (prompt + partial, same seeds): each continues its uninterrupted run, every resumed
    prompt finding its own partial tokens cached."""
    rng = random.Random(27)
    prompt, max_new = _tokens(rng, 24), 90
    kws = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2},
           {"temperature": 0.7, "seed": 3}]
    ref_engine = _local(tiny_model_dir, prefix_cache_tokens=0)
    try:
        whole = await asyncio.gather(*(ref_engine.generate(
            _req(f"w{i}", prompt, max_new_tokens=max_new, **kw)) for i, kw in enumerate(kws)))
    finally:
        await ref_engine.close()
    e = _local(tiny_model_dir, prefix_cache_tokens=1024)
    try:
        tasks = [asyncio.create_task(e.generate(_req(f"p{i}", prompt, max_new_tokens=max_new,
                                                     **kw))) for i, kw in enumerate(kws)]
        while e.stats().generated_tokens < 4 * 20:
            await asyncio.sleep(0.0005)
        await e.interrupt()
        parts = await asyncio.gather(*tasks)
        before = e.stats().work
        rests = await asyncio.gather(*(e.generate(_req(
            f"r{i}", prompt + part.token_ids, max_new_tokens=max_new - len(part.token_ids),
            **kw)) for i, (part, kw) in enumerate(zip(parts, kws, strict=True))))
        after = e.stats().work
    finally:
        await e.close()
    for part, rest, full in zip(parts, rests, whole, strict=True):
        assert 0 < len(part.token_ids) < max_new
        assert part.token_ids + rest.token_ids == full.token_ids
        assert max(abs(a - b) for a, b in
                   zip(part.logprobs + rest.logprobs, full.logprobs)) < 1e-4
    held = sum((24 + len(p.token_ids) - 1) // BLOCK * BLOCK for p in parts)
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == held


async def _turns(e: LocalEngine, first: list[int], env: list[int],
                 max_new: int) -> tuple[list, dict, dict]:
    """An episode's two turns, greedy: ``first``, then ``first`` + its output + ``env``;
    the outputs and the engine's work before and after the second."""
    a = await e.generate(GenerateRequest(
        request_id="t1", prompt_ids=first, episode_id="ep",
        params=SamplingParams(temperature=0.0, max_new_tokens=max_new)))
    before = e.stats().work
    b = await e.generate(GenerateRequest(
        request_id="t2", prompt_ids=first + a.token_ids + env, episode_id="ep",
        params=SamplingParams(temperature=0.0, max_new_tokens=max_new)))
    return [a, b], before, e.stats().work


async def test_an_episodes_next_turn_prefills_only_the_environments_tokens(tiny_model_dir):
    """A finished turn of an episode keeps its row's whole blocks (prompt + output): the
    next turn (prompt + output + 10 environment tokens) prefills only what follows them, and
    both turns equal the uncached engine's."""
    rng = random.Random(41)
    first, env = _tokens(rng, 30), _tokens(rng, 10)
    outs, works = {}, {}
    for tokens in (0, 1024):
        e = _local(tiny_model_dir, prefix_cache_tokens=tokens)
        try:
            outs[tokens], before, works[tokens] = await _turns(e, first, env, 20)
        finally:
            await e.close()
    _assert_same(outs[1024], outs[0])
    k = len(outs[1024][0].token_ids)
    held = (30 + k - 1) // BLOCK * BLOCK  # the row held keys and values up to its last token
    assert k == 20 and held == 48  # more than the first prompt's one block
    after = works[1024]
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == held
    assert _computed(after) - _computed(before) == 30 + k + 10 - held


async def test_an_ended_episodes_blocks_are_evicted_first(tiny_model_dir):
    """Room for 6 blocks: episodes A then B each keep 3 (a 17-token prompt + 32 tokens).
    B ends, so a 33-token prompt that needs 2 blocks evicts B's turn, not the older A's:
    A's next turn still finds its 3 blocks, B's only its prompt's."""
    rng = random.Random(43)
    prompts = {ep: _tokens(rng, 17) for ep in "AB"}
    e = _local(tiny_model_dir, prefix_cache_tokens=6 * BLOCK)
    try:
        outs = {ep: await e.generate(GenerateRequest(
            request_id=ep, prompt_ids=p, episode_id=ep,
            params=SamplingParams(temperature=0.0, max_new_tokens=32)))
            for ep, p in prompts.items()}
        assert all(len(o.token_ids) == 32 for o in outs.values())
        e.end_episode("B")
        await e.generate(_req("c", _tokens(rng, 33), temperature=0.0, max_new_tokens=1))
        assert e.stats().work["prefix_evicted_tokens"] == 2 * BLOCK
        hits = {}
        for ep in "AB":
            before = e.stats().work["prefix_hit_tokens"]
            await e.generate(_req(f"{ep}2", prompts[ep] + outs[ep].token_ids + [1] * 5,
                                  temperature=0.0, max_new_tokens=1))
            hits[ep] = e.stats().work["prefix_hit_tokens"] - before
    finally:
        await e.close()
    assert hits == {"A": 3 * BLOCK, "B": BLOCK}


async def test_an_episodes_kept_turn_is_dropped_by_a_weight_load(tiny_model_dir):
    """``kv_on_load: recompute``: a load drops the episode's kept turn with the rest, and its
    next turn is prefilled whole under the new weights, as a fresh engine with them gives."""
    rng = random.Random(47)
    first, env, new = _tokens(rng, 30), _tokens(rng, 10), _perturbed(tiny_model_dir)
    e = _local(tiny_model_dir, prefix_cache_tokens=1024)
    try:
        a = await e.generate(GenerateRequest(
            request_id="t1", prompt_ids=first, episode_id="ep",
            params=SamplingParams(temperature=0.0, max_new_tokens=20)))
        await e.load_weights(1, new)
        before = e.stats().work
        b = await e.generate(GenerateRequest(
            request_id="t2", prompt_ids=first + a.token_ids + env, episode_id="ep",
            params=SamplingParams(temperature=0.0, max_new_tokens=20)))
        after = e.stats().work
    finally:
        await e.close()
    fresh = _local(tiny_model_dir, prefix_cache_tokens=0)
    try:
        await fresh.load_weights(1, new)
        ref = await fresh.generate(_req("f", first + a.token_ids + env, temperature=0.0,
                                        max_new_tokens=20))
    finally:
        await fresh.close()
    assert before["prefix_dropped_tokens"] == 48  # the turn's 3 blocks, not only the prompt's
    assert after["prefix_hit_tokens"] == before["prefix_hit_tokens"]
    assert _computed(after) - _computed(before) == 60
    _assert_same([b], [ref])


def _perturbed(path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in _state_dict(path).items()}


@pytest.mark.parametrize("kv_on_load", ["recompute", "keep"])
async def test_no_entry_is_reused_across_versions_unless_keep(tiny_model_dir, kv_on_load):
    """After a weight load the prompt cached under the old weights is prefilled again
    (``recompute``: the outputs are the new weights' own, as a fresh engine gives) or, with
    ``keep``, reused as running rows' cache is (its old keys and values change the
    outputs)."""
    rng = random.Random(13)
    prompt, new = _tokens(rng, 50), _perturbed(tiny_model_dir)
    fresh = _local(tiny_model_dir, prefix_cache_tokens=0)
    try:
        await fresh.load_weights(1, new)
        ref = await fresh.generate(_req("f", prompt, temperature=0.0, max_new_tokens=20))
    finally:
        await fresh.close()
    e = _local(tiny_model_dir, prefix_cache_tokens=1024, kv_on_load=kv_on_load)
    try:
        await e.generate(_req("a", prompt, temperature=0.0, max_new_tokens=20))
        await e.load_weights(1, new)
        before = e.stats().work
        out = await e.generate(_req("b", prompt, temperature=0.0, max_new_tokens=20))
        after = e.stats().work
    finally:
        await e.close()
    assert out.versions == [1] * len(out.token_ids)
    hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    if kv_on_load == "recompute":
        assert hit == 0 and before["prefix_dropped_tokens"] == 48
        _assert_same([out], [ref])
    else:
        assert hit == 48 and before["prefix_dropped_tokens"] == 0
        assert out.token_ids != ref.token_ids or max(
            abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) > 1e-3


async def test_groups_before_and_after_a_load_equal_the_uncached_engine(tiny_model_dir):
    """Groups finished under version 0, a load, then the same prompts under version 1: with
    the cache every output is the one of the engine without it (same loads, same order)."""
    reqs, new = _group_requests(seed=21), _perturbed(tiny_model_dir)
    outs = {}
    for tokens in (0, 4096):
        e = _local(tiny_model_dir, prefix_cache_tokens=tokens)
        try:
            first = await asyncio.gather(*(e.generate(r) for r in reqs))
            await e.load_weights(1, new)
            second = await asyncio.gather(*(e.generate(
                _req(f"{r.request_id}'", list(r.prompt_ids), temperature=0.0,
                     max_new_tokens=r.params.max_new_tokens)) for r in reqs))
            outs[tokens] = first + second
        finally:
            await e.close()
    _assert_same(outs[4096], outs[0])
    assert {v for o in outs[4096][len(reqs):] for v in o.versions} == {1}


async def test_a_load_mid_stream_gives_the_new_weights_continuation(tiny_model_dir):
    """A load lands mid-stream (``recompute``): the tokens after it are the new weights'
    continuation of the prefix, as the uncached engine with the new weights gives, both for
    the running row and for the same prefix sent again (the prompt's blocks cached under the
    old version are gone)."""
    rng = random.Random(17)
    prompt, max_new, new = _tokens(rng, 40), 80, _perturbed(tiny_model_dir)
    e = _local(tiny_model_dir, prefix_cache_tokens=1024)
    try:
        mixed, k = await _load_mid_stream(e, prompt, max_new, 1, new)
        cont = await e.generate(_req("c", prompt + mixed.token_ids[:k], temperature=0.0,
                                     max_new_tokens=max_new - k))
    finally:
        await e.close()
    fresh = _local(tiny_model_dir, prefix_cache_tokens=0)
    try:
        await fresh.load_weights(1, new)
        ref = await fresh.generate(_req("f", prompt + mixed.token_ids[:k], temperature=0.0,
                                        max_new_tokens=max_new - k))
    finally:
        await fresh.close()
    _assert_same([cont], [ref])
    assert mixed.token_ids[k:] == ref.token_ids
    assert max(abs(a - b) for a, b in zip(mixed.logprobs[k:], ref.logprobs)) < 1e-4


async def test_eviction_under_a_tiny_budget_keeps_outputs_equal(tiny_model_dir):
    """Two blocks of room for many prompts: entries are evicted all the time, and every
    output is still the uncached engine's."""
    reqs = _group_requests(seed=31) + _group_requests(seed=32, tag="b")
    outs, work = {}, {}
    for tokens in (0, 2 * BLOCK):
        e = _local(tiny_model_dir, prefix_cache_tokens=tokens)
        try:
            outs[tokens] = await asyncio.gather(*(e.generate(r) for r in reqs))
            work = e.stats().work
        finally:
            await e.close()
    _assert_same(outs[2 * BLOCK], outs[0])
    assert work["prefix_evicted_tokens"] > 0 and work["prefix_hit_tokens"] > 0


def _spec() -> ModelSpec:
    return ModelSpec(arch="qwen2", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1,
                     num_kv_heads=1, head_dim=8, intermediate_size=8, rms_norm_eps=1e-6,
                     rope_theta=1e4, rope_scaling=None, qkv_bias=False, o_bias=False,
                     mlp_bias=False, tied_embeddings=True)


def test_eviction_takes_unheld_leaves_least_recently_used_first():
    """The pool's index: a prefix's parent outlives its children, a held block is never
    evicted, and a full pool of held blocks stores nothing more."""
    c = PrefixCache(_spec(), 3 * BLOCK, torch.device("cpu"), torch.float32)
    a = [1] * BLOCK + [2] * BLOCK  # two blocks: a0 <- a1
    b = [3] * BLOCK
    assert [i for i, _ in c.insert(a, len(a))] == [0, 1]
    assert [i for i, _ in c.insert(b, len(b))] == [0]
    assert len(c.match(a + [0])) == 2 and len(c.match(a)) == 1  # one token left to compute
    hit = c.match(b + [0])
    c.acquire(hit, BLOCK + 1)  # b is held (admitted, not stored yet)
    new = [5] * BLOCK
    assert len(c.insert(new, BLOCK)) == 1  # evicts a's leaf a1 (a0 has a child until then)
    assert len(c.match(a + [0])) == 1 and c.counts["prefix_evicted_tokens"] == BLOCK
    assert c.insert([6] * BLOCK, BLOCK) != []  # evicts a0 (a leaf now, least recent)
    assert c.match(a + [0]) == [] and c.match(b + [0]) == hit
    c.acquire(c.match(new + [0]) + c.match([6] * BLOCK + [0]), 2 * BLOCK + 2)
    assert c.insert([7] * BLOCK, BLOCK) == []  # every block held: nothing stored
    c.clear()
    assert c.match(b + [0]) == [] and c.counts["prefix_dropped_tokens"] == 3 * BLOCK


def test_an_ended_episode_is_untagged_and_evicted_before_older_blocks():
    """The pool's episode tags: an ended episode's leaf goes first, then its parent; an
    evicted block leaves no tag behind; a load's clear drops the tags."""
    c = PrefixCache(_spec(), 3 * BLOCK, torch.device("cpu"), torch.float32)
    c.insert([1] * BLOCK, BLOCK, "old")
    two = [2] * BLOCK + [3] * BLOCK
    c.insert(two, len(two), "ended")
    c.end_episode("ended")
    assert c.episodes == {"old": {0}}
    c.insert([4] * BLOCK, BLOCK)  # evicts the ended leaf, not the older block
    assert len(c.match(two + [0])) == 1 and len(c.match([1] * BLOCK + [0])) == 1
    c.insert([5] * BLOCK, BLOCK)  # then its parent
    assert c.match(two + [0]) == [] and len(c.match([1] * BLOCK + [0])) == 1
    c.insert([6] * BLOCK, BLOCK)  # the least recent now: "old"'s block, untagged as it goes
    assert c.match([1] * BLOCK + [0]) == [] and c.episodes == {}
    c.insert([7] * BLOCK, BLOCK, "x")
    c.clear()
    assert c.episodes == {}


def test_a_budget_under_one_block_is_a_clear_error():
    with pytest.raises(ValueError, match="prefix_cache_tokens = 5 holds no block"):
        LocalEngineConfig(prefix_cache_tokens=5)


def test_a_mirror_kept_from_the_change_log_answers_as_the_cache_does():
    """``PrefixIndex`` (an engine actor's proxy keeps one, runtime/ray): applying the log of
    inserts, evictions (a pool of 6 blocks under prompts of up to 5), ended episodes and a
    load's clear, read at random points, the mirror holds of any prompt what the cache
    does."""
    rng = random.Random(0)
    c = PrefixCache(_spec(), 6 * BLOCK, torch.device("cpu"), torch.float32)
    c.changes = collections.deque()
    mirror = PrefixIndex()
    stems = [[rng.randrange(1, 5) for _ in range(5 * BLOCK)] for _ in range(4)]
    prompts = [stem[:n] + [9] * rng.randrange(BLOCK) for stem in stems
               for n in range(BLOCK, 5 * BLOCK + 1, BLOCK)]
    evicted = 0
    for step in range(300):
        prompt = rng.choice(prompts)
        c.insert(prompt, len(prompt), rng.choice([None, f"ep{step % 5}"]))
        if step % 37 == 0:
            c.end_episode(f"ep{step % 5}")
        if step == 150:
            c.clear()
        if rng.random() < 0.3:  # a poll
            evicted += sum(1 for ch in c.changes if ch is not None and ch[1] is None)
            mirror.apply([c.changes.popleft() for _ in range(len(c.changes))])
            assert all(mirror.held(p) == c.held(p) for p in prompts)
    assert evicted > 50  # the pool was under pressure
