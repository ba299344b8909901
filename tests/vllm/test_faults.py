"""Faults of the vLLM engine: clear errors at start, and a server killed mid-run."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from rollstream.config.schema import EngineConfig, VllmEngineConfig
from rollstream.engine import EngineHealth, FinishReason, GenerateRequest, SamplingParams
from rollstream.engine.vllm import build_vllm_engine
from rollstream.engine.vllm.server import VllmServer, VllmServerError, free_port
from tests.vllm import shared

pytestmark = pytest.mark.vllm


def _req(rid: str, prompt: list[int], **params) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=SamplingParams(**params))


def test_port_taken_is_a_clear_error(tmp_path, vllm_model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(VllmServerError, match=f"port {port} .* already in use"):
            build_vllm_engine(EngineConfig(kind="vllm"), vllm_model_path, port=port,
                              log_dir=tmp_path)


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        build_vllm_engine(EngineConfig(kind="vllm"), tmp_path / "nope")


async def test_bad_model_folder_reports_the_server_log(tmp_path):
    """The folder passes our checks but vLLM cannot load it: the server exits early and the
    error quotes its last log lines."""
    bad = shared.make_unloadable_model(tmp_path / "bad-model")
    server = VllmServer(cfg=VllmEngineConfig(), model_path=bad, log_path=tmp_path / "log.txt")
    server.start()
    with pytest.raises(VllmServerError, match="exited with code") as err:
        await server.wait_ready(timeout_s=240)
    assert "Last log lines" in str(err.value) and "no_such_model" in str(err.value)
    assert server.proc is None  # stopped: nothing left running


async def test_health_timeout_is_a_clear_error():
    server = VllmServer(cfg=VllmEngineConfig(), attach_url=f"http://127.0.0.1:{free_port()}")
    server.start()
    with pytest.raises(VllmServerError, match="did not answer /health within 1 s"):
        await server.wait_ready(timeout_s=1.0)


def _maps_of_all() -> str:
    text = []
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError):
            text.append(Path(maps).read_text())
    return "\n".join(text)


def _mapped(path: str) -> bool:
    return path in _maps_of_all()


def _segments_of(pgid: int) -> list[str]:
    """The psm_* segments the processes of group ``pgid`` map now."""
    found = set()
    for proc_dir in glob.glob("/proc/[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            stat = Path(f"{proc_dir}/stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
                maps = Path(f"{proc_dir}/maps").read_text()
                found.update(p for p in glob.glob("/dev/shm/psm_*") if p in maps)
    return sorted(found)


def _group_gone(pgid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


STREAMS = 8  # at once, so that each runs for seconds (one stream: ~400 tok/s here)


async def _streams_across_a_reload(e, weights8, life: int):
    """``STREAMS`` long seeded streams at version 7, then a reload to 8 mid-stream: the tasks,
    the engine's token count at the reload, and whether the streams delivered tokens before it
    (on 8 tries in a row vLLM's stalled API server delivered each stream in one burst at its
    end, docs/vllm.md: then the last try's streams are cut before they delivered any)."""
    for attempt in range(8):
        tasks = [asyncio.create_task(e.generate(_req(f"k{life}{attempt}-{i}", [1, 2, 3 + i],
                                                     max_new_tokens=4000, seed=100 + i)))
                 for i in range(STREAMS)]
        while e.stats().num_running < STREAMS and not any(t.done() for t in tasks):
            await asyncio.sleep(0.001)  # every stream has delivered tokens
        if not any(t.done() for t in tasks):
            flowed = True
            break
        await asyncio.gather(*tasks)  # delivered in one burst at the end: try again
    else:
        tasks = [asyncio.create_task(e.generate(_req(f"k{life}-{i}", [1, 2, 3 + i],
                                                     max_new_tokens=4000, seed=100 + i)))
                 for i in range(STREAMS)]
        flowed = False
        await asyncio.sleep(0.2)  # sent: a stream of 4000 tokens takes seconds
    base, deadline = e.stats().generated_tokens, time.monotonic() + 1.0
    while (e.stats().generated_tokens < base + 16 * STREAMS and time.monotonic() < deadline
           and not any(t.done() for t in tasks)):
        await asyncio.sleep(0.001)  # another event each (one per 16 tokens), if they come
    await e.load_weights(8, weights8)  # mid-stream: later tokens may be of either version
    tokens_at_resume, deadline = e.stats().generated_tokens, time.monotonic() + 0.3
    while (e.stats().generated_tokens < tokens_at_resume + 16 and time.monotonic() < deadline
           and not any(t.done() for t in tasks)):
        await asyncio.sleep(0.001)  # let tokens of uncertain version arrive, if they come
    return tasks, tokens_at_resume, flowed


async def _recovered(e, rid: str) -> None:
    """Wait until the engine answers again (a request sent before a death was noticed is
    aborted: send another)."""
    for attempt in range(2):
        out = await asyncio.wait_for(e.generate(_req(f"{rid}-{attempt}", [1, 2, 3],
                                                     temperature=0.0, max_new_tokens=4)), 300)
        if out.finish_reason is not FinishReason.ABORT:
            break
    assert out.finish_reason is FinishReason.LENGTH, out.error


async def test_killed_server_returns_partials_restarts_and_restores_weights(vllm_engine):
    """Streams run at version 7, a reload to 8 lands mid-stream, then the server is killed:
    each cut request keeps the tokens received before the reload resumed, all of version 7
    (the same seeded streams on the version-7 weights begin with them); the engine is
    RECOVERING, restarts the server with the version-8 weights, and is UP again."""
    e = vllm_engine
    g = torch.Generator().manual_seed(5)
    original = shared.original_weights(shared.model_path())
    weights7, weights8 = ({k: v + 0.3 * torch.randn(v.shape, generator=g)
                           for k, v in original.items()} for _ in range(2))
    greedy = dict(temperature=0.0, max_new_tokens=32)
    await e.load_weights(8, weights8)
    reference = await e.generate(_req("ref", [1, 2, 3], **greedy))  # what the v8 weights give
    for life in range(3):
        await e.load_weights(7, weights7)
        old_pgid, restarts = e.server.proc.pid, e.num_restarts
        shm_before = set(glob.glob("/dev/shm/psm_*")) - set(_segments_of(old_pgid))
        if life == 2:  # two lives' streams ended before their kill (seen in CI): kill
            await e.load_weights(8, weights8)  # while fresh ones surely run, at version 8
            tasks = [asyncio.create_task(e.generate(
                _req(f"k{life}-{i}", [1, 2, 3 + i], max_new_tokens=4000, seed=100 + i)))
                for i in range(STREAMS)]
            await asyncio.sleep(0.05)
            tokens_at_resume, flowed, at8 = e.stats().generated_tokens, False, True
            break
        tasks, tokens_at_resume, flowed = await _streams_across_a_reload(e, weights8, life)
        at8 = False  # sent at version 7, reloaded to 8 mid-stream
        if e.stats().health is EngineHealth.UP and not any(t.done() for t in tasks):
            os.kill(e.server.proc.pid, signal.SIGKILL)  # the API server; children orphaned
            outs = await asyncio.gather(*tasks)
            if any(o.finish_reason is not FinishReason.LENGTH for o in outs):
                break
            # every stream had ended inside the server before the kill (seen once, in CI: a
            # reload paused 13 s while the server ran them to their end and sent them in one
            # burst): nothing was cut; let the engine recover and run the scenario again
            print(f"life {life}: the streams ended before the kill landed")
            await _recovered(e, f"up{life}")
            continue
        if e.stats().health is EngineHealth.UP:
            # a stream ran to its end before the kill could land (seen once, in CI: the
            # reload took long enough on a loaded machine): nothing to cut, run it again
            done = [t.result() for t in tasks if t.done()]
            print(f"life {life}: a stream finished before the planned kill: "
                  f"{[(o.finish_reason.value, len(o.token_ids), o.error) for o in done]}")
            await e.interrupt()  # the others need not run on to 4000 tokens
            await asyncio.gather(*tasks)
            continue
        # vLLM's EngineCore died by itself before the planned kill (seen once, in CI on a
        # loaded machine): show why, let the engine recover, and run the scenario again
        print(f"vLLM died before the planned kill: {e.stats().health_reason}\n"
              f"{e.server.log_tail()}")
        await asyncio.gather(*tasks)
        await _recovered(e, f"up{life}")
    else:
        pytest.fail("three tries: vLLM died by itself or the streams ended before the kill")
    if at8:
        os.kill(e.server.proc.pid, signal.SIGKILL)  # the API server; its children are orphaned
        outs = await asyncio.gather(*tasks)
    stats = e.stats()
    assert stats.health is EngineHealth.RECOVERING and "died" in stats.health_reason
    cut = [o for o in outs if o.finish_reason is not FinishReason.LENGTH]
    assert cut, "the kill should land while requests run"
    if flowed:  # they return the tokens received before the reload resumed the server
        assert any(o.token_ids for o in cut), "the kill should land while streams deliver"
    else:
        print("no stream delivered tokens before the kill (the API server's stall, or the "
              "third life's kill right after sending)")
    assert all(o.finish_reason is FinishReason.ABORT and "died" in o.error for o in cut), \
        [(o.finish_reason, o.error) for o in cut]
    kept = 8 if at8 else 7  # the third life sends its streams at version 8
    assert all(o.versions == [kept] * len(o.token_ids) for o in cut)
    assert all(o.versions == sorted(o.versions) and set(o.versions) <= {7, 8} for o in outs)
    print(f"killed mid-run: {len(cut)}/{STREAMS} requests cut, "
          f"{sum(len(o.token_ids) for o in cut)} partial tokens of version {kept} kept, "
          f"{e.stats().generated_tokens - tokens_at_resume} received after the reload")

    out = await asyncio.wait_for(e.generate(_req("after", [1, 2, 3], **greedy)), 300)
    if out.finish_reason is FinishReason.ABORT:  # sent before the death was noticed
        out = await asyncio.wait_for(e.generate(_req("after2", [1, 2, 3], **greedy)), 300)
    assert out.finish_reason is FinishReason.LENGTH, out.error
    assert e.num_restarts == restarts + 1 and e.stats().version == 8
    assert e.stats().health is EngineHealth.UP and e.stats().health_reason is None
    assert out.token_ids == reference.token_ids and out.versions == [8] * 32  # weights restored
    assert _group_gone(old_pgid), "the killed server's EngineCore/worker were left behind"
    # its shared-memory ring buffers (160+ MB each) were unlinked, not left in /dev/shm
    leaked = [p for p in set(glob.glob("/dev/shm/psm_*")) - shm_before if not _mapped(p)]
    assert not leaked, f"segments of the killed server left behind: {leaked}"

    await e.load_weights(9, weights8 if at8 else weights7)  # what sampled the kept tokens
    for o in cut:
        if o.token_ids:
            i = int(o.request_id.rpartition("-")[2])
            n = min(len(o.token_ids), 64)
            again = await e.generate(_req(f"again-{i}", [1, 2, 3 + i], max_new_tokens=n,
                                          seed=100 + i))
            assert again.token_ids == o.token_ids[:n]
