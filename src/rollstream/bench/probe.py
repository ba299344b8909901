"""The engine's saturated rate on its core and the trainer/engine contention probe, with
per-thread CPU accounting from ``/proc`` (used by ``bench modes``).

Saturated rate: ``max_slots`` requests of the config's task mix kept in the engine, each
refilled as it finishes; the same with 1, 4, 16 and 64 requests kept (the batch economy: how
much a long tail of few running requests costs the engine). Contention probe: trainer steps
on a fixed batch alone, then while the engine is saturated; each thread's run / run-queue /
blocked share (a thread that always has work and is blocked is waiting for the GIL).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

from rollstream.config import RunConfig

# ---- per-thread CPU accounting (/proc/self/task/*/schedstat) ----------------------------
ROLES = {"rollstream-local": "engine", "trainer": "trainer", "MainThread": "loop",
         "rollstream-reward": "reward"}


def _role(name: str) -> str:
    return next((r for prefix, r in ROLES.items() if name.startswith(prefix)), "other")


def _schedstat(tid: int) -> tuple[float, float] | None:
    try:
        run_ns, wait_ns, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
    except (OSError, ValueError):  # the thread ended, or no schedstat on this system
        return None
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


class ThreadMeter:
    """Seconds each thread role spent running on a CPU and runnable-but-waiting for one.

    ``sleep`` = wall - run - runq: blocked (idle, or waiting for the GIL). Polled, so a thread
    that lives less than ``period_s`` is missed (reward threads: microseconds of work)."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s = period_s
        self.totals: dict[str, list[float]] = {}
        self._last: dict[int, tuple[str, float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-meter", daemon=True)
        self._t0 = time.perf_counter()

    def __enter__(self) -> Self:
        self._poll()
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()
        self.wall_s = time.perf_counter() - self._t0

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._poll()

    def _poll(self) -> None:
        for t in threading.enumerate():
            if t.native_id is None or t.name == "bench-meter":
                continue
            now = _schedstat(t.native_id)
            if now is None:
                continue
            role, run0, wait0 = self._last.get(t.native_id, (_role(t.name), *now))
            if now[0] < run0:  # a new thread reusing an ended thread's id
                role, run0, wait0 = _role(t.name), *now
            acc = self.totals.setdefault(role, [0.0, 0.0])
            acc[0] += now[0] - run0
            acc[1] += now[1] - wait0
            self._last[t.native_id] = (role, *now)

    def shares(self) -> dict[str, dict[str, float]]:
        wall = max(self.wall_s, 1e-9)
        return {role: {"run": run / wall, "runq": wait / wall}
                for role, (run, wait) in sorted(self.totals.items()) if run / wall >= 0.005}

    def runq_share(self, roles: Sequence[str]) -> float:
        """Of the time ``roles`` were runnable, the share spent waiting for a CPU (other
        processes on the machine, or each other on one core)."""
        run = sum(self.totals.get(r, (0.0, 0.0))[0] for r in roles)
        wait = sum(self.totals.get(r, (0.0, 0.0))[1] for r in roles)
        return wait / (run + wait) if run + wait > 0 else 0.0

    def sleep_share(self, role: str) -> float:
        """Blocked share of one thread of ``role`` that always had work: its GIL wait."""
        run, wait = self.totals.get(role, (0.0, 0.0))
        return max(0.0, 1.0 - (run + wait) / max(self.wall_s, 1e-9))


# ---- the engine's saturated rate and the contention probe -------------------------------
BATCH_SIZES = (1, 4, 16, 64)  # requests kept in the engine for the batch-economy rates
SETTLE_S = 5.0  # each window starts this long after the engine is filled (_saturate)
MIN_TOKEN_WAIT_S = 60.0  # a window lasts until the engine made a token, up to this long


def _saturate(engine: Any, mix: Any, params: Any, seconds: float, *, group_size: int,
              settle_s: float = 0.0, then: Callable[[], cf.Future] | None = None,
              slots: int | None = None) -> tuple[float, list[tuple[Any, list[Any]]]]:
    """Keep ``slots`` (default ``max_slots``) requests of tick prompts in the engine; after
    ``settle_s`` (the clock not yet running) measure for ``seconds``, or until the future
    ``then()`` returns (called once settled) is done; returns (tokens/s, completed groups as
    (task, outputs)).

    Settling matters: an engine filled at once holds only short contexts, and decodes faster
    than in a run (whose rows are of every age) until its first requests finish. Unsettled,
    the ~2 s window beside the trainer's steps measured 1.24-1.30x the 20 s window's rate
    alone (docs/benchmarks.md, 2026-12-04 at 466b169)."""
    from rollstream.engine.protocol import GenerateRequest

    ids = itertools.count()
    tasks = (t for t in iter(mix.next_task, None) for _ in range(group_size))
    live: dict[cf.Future, Any] = {}
    outputs: dict[str, list[Any]] = {}
    groups: list[tuple[Any, list[Any]]] = []

    def submit() -> None:
        task = next(tasks)
        fut = engine.submit(GenerateRequest(request_id=f"sat-{next(ids)}",
                                            prompt_ids=list(task.prompt_ids), params=params))
        live[fut] = task

    def turn() -> None:  # collect what finished, refill
        done, _ = cf.wait(list(live), timeout=0.5, return_when=cf.FIRST_COMPLETED)
        for fut in done:
            task = live.pop(fut)
            outs = outputs.setdefault(task.uid, [])
            outs.append(fut.result())
            if len(outs) == group_size:
                groups.append((task, outs))
            submit()

    for _ in range(slots or engine.stats().capacity):
        submit()
    t_settle = time.perf_counter()
    while time.perf_counter() - t_settle < settle_s:
        turn()
    until = then() if then is not None else None
    tokens0, t0 = engine.stats().generated_tokens, time.perf_counter()

    def more() -> bool:  # a rate needs a token: a loaded machine may make none in a short window
        elapsed = time.perf_counter() - t0
        if engine.stats().generated_tokens == tokens0 and elapsed < MIN_TOKEN_WAIT_S:
            return True
        return elapsed < seconds and not (until is not None and until.done())

    while more():
        turn()
    rate = (engine.stats().generated_tokens - tokens0) / (time.perf_counter() - t0)
    cf.wait(list(live))  # leave the engine empty for whoever comes next
    return rate, groups


def _batch(groups: list[tuple[Any, list[Any]]], resolve: Any, tokenizer: Any, n: int) -> list[Any]:
    """``n`` graded groups (by the run's rewards, in this process), those with reward variance
    first (what the trainer receives)."""
    from rollstream.reward import decode_response
    from rollstream.trajectory import Group, SampleStatus

    graded = []
    for task, outs in groups:
        group = Group.new(task, len(outs))
        for s, o in zip(group.samples, outs, strict=True):
            s.append_policy_tokens(o.token_ids, o.logprobs, o.versions)
            response = decode_response(tokenizer, o.token_ids, finish_reason=o.finish_reason.value)
            s.reward = resolve(task).score(task, response)
            s.status = SampleStatus.GRADED
        graded.append(group)
    graded.sort(key=lambda g: len({s.reward for s in g.samples}) == 1)
    return graded[:n]


def probe(cfg: RunConfig, folder: Path, *, saturate_s: float, probe_steps: int) -> dict[str, Any]:
    """Saturated engine tokens/s on its core, then trainer steps alone and next to it."""
    from transformers import AutoTokenizer

    from rollstream.data.mix import TaskMix
    from rollstream.data.sources import source_rewards
    from rollstream.engine.local import LocalEngine
    from rollstream.reward import build_resolver
    from rollstream.runtime.build import build_trainer, sampling_params

    tokenizer = AutoTokenizer.from_pretrained(folder)
    mix = TaskMix(cfg.tasks, tokenizer)
    resolve = build_resolver(cfg.reward, source_rewards(cfg.tasks))
    params = sampling_params(cfg.sampling, (tokenizer.eos_token_id,))
    engine = LocalEngine(folder, cfg.engine.local)
    pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
    g = cfg.rollout.group_size
    settle = min(SETTLE_S, saturate_s / 4)  # --quick (2 s windows): 0.5 s
    try:
        _saturate(engine, mix, params, min(3.0, saturate_s), group_size=g)  # warm-up
        with ThreadMeter() as alone:
            sat, groups = _saturate(engine, mix, params, saturate_s, group_size=g,
                                    settle_s=settle)
        batch = _batch(groups, resolve, tokenizer, cfg.train.groups_per_step)
        trainer = build_trainer(cfg, folder, staleness=cfg.rollout.staleness_policy())

        def steps(n: int) -> list[float]:
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                trainer.step(batch, i)
                out.append(time.perf_counter() - t0)
            return out

        pool.submit(steps, 1).result()  # warm-up
        solo = pool.submit(steps, probe_steps).result()
        with contextlib.ExitStack() as stack:  # the meter runs while the trainer steps
            meters: list[ThreadMeter] = []
            running: list[cf.Future] = []

            def start_steps() -> cf.Future:
                meters.append(stack.enter_context(ThreadMeter()))
                running.append(pool.submit(steps, probe_steps))
                return running[0]

            shared, _ = _saturate(engine, mix, params, math.inf, group_size=g,
                                  settle_s=settle, then=start_steps)
        both, together = meters[0], running[0].result()
        trainer.close()
        after, _ = _saturate(engine, mix, params, saturate_s / 2, group_size=g, settle_s=settle)
        # the batch economy: tokens/s with only b requests kept in the engine
        by_batch = {b: _saturate(engine, mix, params, saturate_s / 8, group_size=g, slots=b,
                                 settle_s=settle)[0] for b in BATCH_SIZES}
    finally:
        pool.shutdown()
        engine.shutdown()
    return {
        "saturated_tok_s": max(sat, after),  # best of two windows: the machine is shared
        "saturated_tok_s_windows": [sat, after],
        "tok_s_by_batch": {str(b): r for b, r in by_batch.items()},
        "saturate_s": saturate_s,
        "batch_response_tokens": sum(s.num_response_tokens for gr in batch for s in gr.samples),
        "trainer_step_s_alone": statistics.median(solo),
        "trainer_step_s_with_engine": statistics.median(together),
        "engine_tok_s_with_trainer": shared,
        "threads_engine_alone": alone.shares(),
        "threads_engine_and_trainer": both.shares(),
        "runq_share_engine_and_trainer": both.runq_share(("engine", "trainer")),
        "gil_wait_share_engine": both.sleep_share("engine"),
        "gil_wait_share_trainer": both.sleep_share("trainer"),
    }
