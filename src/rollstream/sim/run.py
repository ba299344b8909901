"""Run one mode of a scenario: the real loop (``runtime.build.build_loop``) on simulated
engines, a simulated trainer and virtual time, and what it measured.

The components are the run's own: ``build_loop`` wires the real Dispatcher, Rollout (its
admission, StalenessPolicy, buffer, Lifecycle, Ledger), WeightSync and Controller around the
simulated engines and trainer, a GraderPool with an async reward that reads the simulated
answer, and a :class:`~rollstream.sim.vloop.LoopClock`. Two seams differ from a run, both
at a process edge and both given when the loop and its controller are built:

* the controller's ``train_pool`` is a :class:`VirtualExecutor`: trainer steps cost virtual
  time (a thread would let wall time leak into the virtual clock);
* no engine supervisor (``supervise=False``): simulated engines never die, so it has nothing
  to do, and its 0.2 s poll over every engine would be most of the simulation's cost at 512
  engines.

Measured (per mode): mean step time (simulated seconds to the last step ÷ steps), engine
utilization (busy prefill + decode time ÷ engines × that time), the tail share (per step, over
the samples of its batch: time from the 90th percentile finish to the last finish ÷ time from
the first dispatch to the last finish, as Seer's "last 10% of requests"; the mean over steps),
the staleness histogram (trained samples in the ledger: trained step − oldest kept version),
trained tokens/s (prompt + kept response tokens ÷ simulated time), generated tokens/s, the
ledger's terminal statuses, interrupts and preemptions, the mean response tokens of the
samples trained at each step (``response_tokens_by_step``: the length drift), and the wall and
CPU time the mode took. Agentic scenarios (``workload.agent``) add the model turns per
trained episode, the model tokens per turn of the episodes trained at each step
(``turn_tokens_by_step``: the drift without the noise of turn counts), the tool's calls,
timeouts and mean seconds, and the share of the episodes' time (first dispatch to last
return, summed) spent waiting on the tool.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rollstream.agent.harness import AGENT
from rollstream.config import RewardConfig
from rollstream.config.loader import read_yaml_mapping
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.data.ledger_row import LedgerRow
from rollstream.engine.protocol import SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import Reward
from rollstream.run_files import RunFiles
from rollstream.runtime.build import Loop, build_controller, build_loop
from rollstream.runtime.controller import Controller
from rollstream.sim.agentic import END, AgentWorkload
from rollstream.sim.engine import SimEngine
from rollstream.sim.profile import Profile
from rollstream.sim.replay import AgentReplayWorkload, ReplayWorkload, read_groups
from rollstream.sim.scenario import ModeConfig, Scenario, run_config
from rollstream.sim.trainer import SimTrainer
from rollstream.sim.vloop import LoopClock, VirtualExecutor, run_virtual
from rollstream.sim.workload import CORRECT, WRONG, TaskStream, Workload, sim_reward
from rollstream.trajectory import SampleStatus
from rollstream.staleness import age

SIM_REWARD = Reward.of(sim_reward, "sim")
TAIL_QUANTILE = 0.9


class SimMetrics:
    """The controller's MetricsLike: each record stamped with simulated time."""

    def __init__(self, clock: LoopClock) -> None:
        self.clock = clock
        self.records: list[tuple[str, int, float, dict[str, float]]] = []

    def record(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.records.append((kind, step, self.clock.now(), dict(values)))

    def observe(self, name: str, value: float) -> None:
        pass  # the staleness histogram is read from the ledger


class Spans:
    """First dispatch and last return of every sample (the dispatcher's span sink)."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def __call__(self, *, sample_uid: str, t_start_s: float, t_end_s: float,
                 **_: Any) -> None:
        self.first.setdefault(sample_uid, t_start_s)
        self.last[sample_uid] = t_end_s


def simulate_mode(sc: Scenario, mode: ModeConfig, profile: Profile) -> dict[str, Any]:
    """Run one mode on a fresh virtual-time loop; its measurements (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="rollstream-sim-") as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        out = run_virtual(_simulate(sc, mode, profile, RunFiles(tmp).ledger))
        out["wall_s"] = time.perf_counter() - t0
        out["cpu_s"] = time.process_time() - c0  # this process's CPU: less noisy when shared
        return out


async def build_sim(sc: Scenario, mode: ModeConfig, profile: Profile,
                    ledger_path: Path | None) -> tuple[Loop, Controller, list[SimEngine],
                                                       SimTrainer, SimMetrics, Spans, Ledger]:
    """The real loop around simulated engines and trainer (call inside the virtual loop)."""
    cfg = run_config(sc, mode)
    workload = make_workload(sc)
    engines = [SimEngine(f"sim-{i}", profile, workload) for i in range(sc.engines)]
    staleness = cfg.rollout.staleness_policy()  # one policy: the trainer and the rollout
    trainer = SimTrainer(profile.trainer, devices=sc.trainer_devices, policy=staleness,
                         token_block=sc.token_block)
    clock = LoopClock()
    metrics, spans, ledger = SimMetrics(clock), Spans(), Ledger(ledger_path)
    # every reward call at once: grading is instantaneous in the simulation
    graders = GraderPool(RewardConfig(num_workers=1 << 30), lambda task: SIM_REWARD)
    agentic = isinstance(workload, AgentWorkload | AgentReplayWorkload)  # the agent harness
    params = SamplingParams(temperature=1.0, max_new_tokens=workload.max_blocks,
                            stop_token_ids=(END,) if agentic else (CORRECT, WRONG))
    loop = build_loop(cfg, engines=list(engines), trainer=trainer, tasks=TaskStream(workload),
                      graders=graders, decode=lambda ids: "", ledger=ledger, metrics=metrics,
                      clock=clock, params=params, span=spans, staleness=staleness,
                      harnesses={AGENT: workload.harness()} if agentic else None,
                      supervise=False)
    controller = build_controller(cfg, loop, train_pool=_train_pool(trainer, engines, profile))
    return loop, controller, engines, trainer, metrics, spans, ledger


def _train_pool(trainer: SimTrainer, engines: list[SimEngine],
                profile: Profile) -> VirtualExecutor:
    """Trainer steps on virtual time. With Profile.contention, while a step computes the
    engines' passes cost ``1 + contention.engine`` times more, and the step itself, once its
    cost ``d`` is spent, goes on for ``d * contention.trainer * u`` more, ``u`` the engines'
    busy share meanwhile (as the real run's ``engine_busy_in_train`` measures it)."""
    c = profile.contention
    if c.engine == 0 and c.trainer == 0:
        return VirtualExecutor(lambda _: trainer.take_elapsed())
    busy_at_start = 0.0

    def start(_: object) -> float:
        nonlocal busy_at_start
        busy_at_start = sum(e.busy_now() for e in engines)
        for e in engines:
            e.set_slowdown(1 + c.engine)
        return trainer.take_elapsed()

    def extend(step_s: float) -> float:
        u = (sum(e.busy_now() for e in engines) - busy_at_start) / (step_s * len(engines)) \
            if step_s > 0 else 0.0
        extra = step_s * c.trainer * min(max(u, 0.0), 1.0)
        asyncio.get_running_loop().call_later(extra, _uncontend, engines)
        return extra

    return VirtualExecutor(start, extend)


def _uncontend(engines: list[SimEngine]) -> None:
    for e in engines:
        e.set_slowdown(1.0)


def make_workload(sc: Scenario) -> Workload | ReplayWorkload:
    """The scenario's generator (of episodes with ``workload.agent``), or the replay of its
    recorded run (of its episodes, an agent run's)."""
    if sc.replay is None:
        kind = Workload if sc.workload.agent is None else AgentWorkload
        return kind(sc.workload, seed=sc.seed, token_block=sc.token_block)
    run_dir = Path(sc.replay)
    recorded = read_yaml_mapping(RunFiles(run_dir).config, "run config")

    def setting(path: str) -> Any:
        value: Any = recorded
        for key in path.split("."):
            if not isinstance(value, dict) or key not in value:
                raise ValueError(f"replay {run_dir}: config.yaml has no {path}")
            value = value[key]
        return value

    groups = read_groups(run_dir, sc.group_size)
    common = {"seed": sc.seed, "max_response_tokens": setting("sampling.max_new_tokens"),
              "token_block": sc.token_block}
    if not any(s.turns for g in groups for s in g.samples):
        return ReplayWorkload(groups, **common)
    return AgentReplayWorkload(groups, **common, max_turns=setting("agent.max_turns"),
                               max_turn_tokens=setting("agent.max_turn_tokens"),
                               tool_timeout_s=setting("agent.tool_timeout_s"))


async def _simulate(sc: Scenario, mode: ModeConfig, profile: Profile,
                    ledger_path: Path) -> dict[str, Any]:
    loop, controller, engines, trainer, metrics, spans, ledger = await build_sim(
        sc, mode, profile, ledger_path)
    result = await controller.run()
    ledger.close()
    rows = [r for r in read_ledger(ledger_path) if not r.is_dataset_row]
    trained = [r for r in rows if r.status is SampleStatus.TRAINED]
    steps = [(step, t) for kind, step, t, _ in metrics.records if kind == "train"]
    sim_s = steps[-1][1] if steps else metrics.clock.now()
    block = sc.token_block
    staleness = Counter(age(r.trained_at_step, r.min_trained_version) for r in trained)
    busy = sum(e.busy_s for e in engines)
    by_step: dict[int, list[int]] = {}
    for r in trained:
        by_step.setdefault(r.trained_at_step, []).append(r.num_tokens * block)
    out: dict[str, Any] = {
        "mode": mode.model_dump(),
        "steps_done": result.steps_done,
        "stop_reason": result.stop_reason,
        "sim_s": sim_s,
        "step_s_mean": sim_s / max(result.steps_done, 1),
        "engine_utilization": busy / (len(engines) * sim_s) if sim_s > 0 else 0.0,
        "tail_share_mean": _tail_share(rows, spans),
        "staleness_hist": {str(k): staleness[k] for k in sorted(staleness)},
        "staleness_max": max(staleness, default=0),
        "trained_tok_s": trainer.trained_tokens / sim_s if sim_s > 0 else 0.0,
        "trained_samples": sum(staleness.values()),
        "gen_tok_s": loop.dispatcher.stats.generated_tokens * block / sim_s if sim_s > 0 else 0.0,
        "gen_tokens_per_trained_token": (loop.dispatcher.stats.generated_tokens * block
                                         / trainer.trained_tokens if trainer.trained_tokens
                                         else None),
        "statuses": dict(Counter(r.status.value for r in rows)),
        "interrupts": loop.dispatcher.stats.num_interrupts,
        "preemptions": sum(e.num_preemptions for e in engines),
        "response_tokens_by_step": {str(k): sum(v) / len(v) for k, v in sorted(by_step.items())},
    }
    workload = engines[0].workload
    if isinstance(workload, AgentWorkload | AgentReplayWorkload):
        tool = workload.tool
        turns = [r.num_turns for r in trained]
        per_turn: dict[int, list[int]] = {}  # step -> [model tokens, model turns]
        for r in trained:
            acc = per_turn.setdefault(r.trained_at_step, [0, 0])
            acc[0] += r.num_trained_tokens * block  # the policy's tokens: no tool output
            acc[1] += r.num_turns
        episode_s = sum(spans.last[u] - spans.first[u] for u in spans.last)
        out.update(turns_mean=sum(turns) / len(turns) if turns else None,
                   turn_tokens_by_step={str(k): t / n for k, (t, n) in sorted(per_turn.items())
                                        if n},
                   tool_calls=tool.num_calls, tool_timeouts=tool.num_timeouts,
                   tool_s_mean=tool.waited_s / tool.num_calls if tool.num_calls else None,
                   tool_time_share=tool.waited_s / episode_s if episode_s > 0 else None)
    return out


def _tail_share(rows: list[LedgerRow], spans: Spans) -> float | None:
    """Mean over steps of (last finish − 90th-percentile finish) ÷ (last finish − first
    dispatch), over the samples each step's batch held."""
    by_step: dict[int, list[str]] = {}
    for r in rows:
        if r.taken_at_step is not None and r.sample_uid in spans.last:
            by_step.setdefault(r.taken_at_step, []).append(r.sample_uid)
    shares = []
    for uids in by_step.values():
        ends = sorted(spans.last[u] for u in uids)
        start = min(spans.first[u] for u in uids)
        window = ends[-1] - start
        if window > 0:
            t90 = ends[max(math.ceil(TAIL_QUANTILE * len(ends)) - 1, 0)]
            shares.append((ends[-1] - t90) / window)
    return sum(shares) / len(shares) if shares else None
