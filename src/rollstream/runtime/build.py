"""Build the components a config names: the embedded runtime's wiring, in one place.

:func:`check_inputs` validates what a run reads (model folder, dataset paths, reward names)
at once; the builders here make each component (engines, trainer, workers, harnesses, the
loop and its controller); ``runtime/run.py`` puts them together into one run. The sampling
parameters (:func:`sampling_params`) and the trainer (:func:`build_trainer`) are built from
the config here and only here, for runs and benchmarks alike.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.clock import Clock
from rollstream.config import RunConfig, SamplingConfig
from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import Engine, SamplingParams
from rollstream.monitor.rollout_meter import RolloutMeter
from rollstream.reward.workers import ProcessWorkers, Workers
from rollstream.rollout.concurrency import concurrency_limits
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.harness import Harness
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.rollout.rollout import Rollout, TaskStream
from rollstream.rollout.supervisor import EngineSupervisor
from rollstream.run_files import RunFiles
from rollstream.runtime.autoscale import AutoscalePolicy, Autoscaler
from rollstream.runtime.controller import (
    AfterStep,
    BeforeStop,
    Controller,
    MetricsLike,
    TrainerLike,
    TrainerTurn,
)
from rollstream.runtime.fleet import Fleet, MakeEngine
from rollstream.runtime.placement import TimeShare, placed_train
from rollstream.runtime.reconfigure import Reconfigure
from rollstream.staleness import StalenessPolicy
from rollstream.sync.weights import WeightSync

if TYPE_CHECKING:
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import RewardFn
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.units import ScaleUnits
    from rollstream.train.fsdp import FsdpTrainer
    from rollstream.train.trainer import Trainer

log = logging.getLogger(__name__)


def check_inputs(cfg: RunConfig, rewards: Mapping[str, RewardFn] | None = None) -> None:
    """Fail early, naming the setting, when a model folder, a dataset file, a reward (a name,
    or a callable in ``rewards``), an episode's environment, agent, tool or tool-call parser
    or the sandbox's artifact folder is unusable, or the runtime's library is missing (runs
    call this before touching their run directory)."""
    from rollstream.agent.verifiers_env import with_rubrics
    from rollstream.data.sources import check_source_paths, source_rewards
    from rollstream.models.folder import validate_model_folder
    from rollstream.reward.registry import build_resolver

    if cfg.model.path is not None:
        validate_model_folder(Path(cfg.model.path))
    check_source_paths(cfg.tasks)
    build_resolver(cfg.reward, source_rewards(cfg.tasks), with_rubrics(cfg.tasks, rewards))
    _check_sandbox(cfg.agent.sandbox)
    if any(s.episodic for s in cfg.tasks.sources):
        from rollstream.agent.episodes import episode_sources

        episode_sources(cfg.tasks)  # resolves and checks what each source names
    if cfg.runtime.kind == "ray":
        from rollstream.runtime.ray.cluster import require_ray

        require_ray()


def _check_sandbox(cfg: Any) -> None:
    """What ``agent.sandbox`` names outside the config: its folder and its variables."""
    if cfg.artifacts is not None and not Path(cfg.artifacts).expanduser().is_dir():
        raise ValueError(f"agent.sandbox.artifacts: {cfg.artifacts!r} is not a folder")
    from rollstream.agent.sandbox import sandbox_env

    try:
        sandbox_env(list(cfg.pass_env))
    except ValueError as e:
        raise ValueError(f"agent.sandbox.pass_env: {e}") from None


def sampling_params(cfg: SamplingConfig, stop_token_ids: tuple[int, ...], *,
                    temperature: float | None = None) -> SamplingParams:
    """The engines' sampling parameters for a config (``temperature`` overrides: eval)."""
    return SamplingParams(
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=stop_token_ids,
    )


def build_trainer(cfg: RunConfig, model_path: Path, units: ScaleUnits | None = None, *,
                  staleness: StalenessPolicy) -> Trainer | FsdpTrainer:
    """The trainer of ``train.backend``: in this process (``local``) or FSDP ranks
    (``fsdp``): Ray actors in the run's scale ``units`` where given (``runtime.kind: ray``),
    else processes this one spawns; either way :meth:`close` releases it. ``staleness``: the
    run's policy (``cfg.rollout.staleness_policy()``, built once and given to the loop too)."""
    kwargs: dict[str, Any] = dict(
        staleness=staleness,
        max_response_tokens=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k)
    if cfg.train.backend == "local":
        from rollstream.train.trainer import Trainer

        return Trainer(placed_train(cfg), model_path, lora=cfg.model.lora, **kwargs)
    from rollstream.train.fsdp import FsdpTrainer

    if units is not None:
        from functools import partial

        from rollstream.runtime.ray.ranks import RayRanks

        kwargs["launch"] = partial(RayRanks, num_cpus=cfg.runtime.ray.rank_num_cpus,
                                   units=units)
    else:
        from rollstream.train.rank_processes import ProcessRanks

        kwargs["launch"] = ProcessRanks
    return FsdpTrainer(placed_train(cfg), model_path, **kwargs)


def prepare_run_dir(cfg: RunConfig, run_dir: Path, *, resume: bool = False) -> None:
    """The run directory: a fresh run removes the previous run's files of that name (and its
    checkpoints), a resumed one keeps them; the config is saved, its secrets redacted."""
    import yaml

    from rollstream.config.redact import saved_config

    files = RunFiles(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        for stale in files.fresh_run_leftovers():
            stale.unlink(missing_ok=True)
        shutil.rmtree(files.checkpoints, ignore_errors=True)
    files.config.write_text(yaml.safe_dump(saved_config(cfg), sort_keys=False))


def build_workers(cfg: RunConfig, size: int, role: str) -> Workers:
    """The pool of ``size`` workers a ``role`` (``reward``, ``harness``) runs its blocking
    calls in: processes this one spawns (``runtime.kind: embedded``) or Ray actors (``ray``;
    reward actors on ``runtime.ray.nodes.rewards``' nodes where set, harness actors on the
    driver's node, where the agent proxy listens on 127.0.0.1). The one place that picks
    them; the grader pool and the harness only see :class:`Workers`."""
    if cfg.runtime.kind == "embedded":
        return ProcessWorkers(size, role=role)
    from rollstream.runtime.ray.nodes import role_resources
    from rollstream.runtime.ray.workers import RayWorkers

    harness = role == "harness"
    return RayWorkers(size, role=role, num_cpus=cfg.runtime.ray.worker_num_cpus,
                      on_driver_node=harness,
                      resources={} if harness else role_resources(cfg.runtime.ray.nodes,
                                                                  "rewards"))


def build_harnesses(cfg: RunConfig, tokenizer: Any, sandbox: Any = None) -> dict[str, Harness]:
    """The harnesses the run's task sources need: the agent loop, and the OpenAI-SDK agents
    behind the proxy, for sources whose tasks are episodes (``agent/episodes.py`` resolves
    what each names; ``cfg.agent`` sets their budgets; ``sampling.max_new_tokens`` caps an
    episode's response tokens in all). ``sandbox``: the run's pool (``RunSandbox``), which
    tools that ask for one get."""
    from rollstream.agent.chat import ChatRenderer
    from rollstream.agent.episodes import episode_sources
    from rollstream.agent.harness import AGENT, AgentHarness
    from rollstream.agent.loop import Budgets
    from rollstream.agent.proxy_harness import OPENAI, ProxyHarness

    by_harness: dict[str, dict[str, Any]] = {}
    for name, src in episode_sources(cfg.tasks, sandbox).items():
        by_harness.setdefault(src.harness, {})[name] = src
    a = cfg.agent
    budgets = Budgets(max_turns=a.max_turns, max_turn_tokens=a.max_turn_tokens,
                      max_total_tokens=cfg.sampling.max_new_tokens, max_wall_s=a.max_wall_s)
    harnesses: dict[str, Harness] = {}
    if AGENT in by_harness:
        harnesses[AGENT] = AgentHarness(renderer=ChatRenderer(tokenizer), budgets=budgets,
                                        sources=by_harness[AGENT],
                                        tool_timeout_s=a.tool_timeout_s,
                                        max_tool_concurrency=a.max_tool_concurrency,
                                        max_tool_output_chars=a.max_tool_output_chars)
    if OPENAI in by_harness:
        pool = build_workers(cfg, a.harness_workers, "harness") if a.harness_workers else None
        harnesses[OPENAI] = ProxyHarness(tokenizer=tokenizer, sources=by_harness[OPENAI],
                                         budgets=budgets, workers=pool,
                                         context_tokens=cfg.engine.context[1],
                                         limits=a.proxy, tool_timeout_s=a.tool_timeout_s,
                                         max_tool_concurrency=a.max_tool_concurrency)
    return harnesses


@dataclass(slots=True, kw_only=True)
class Loop:
    """The rollout side of a run and what its controller drives, around given engines,
    trainer and tasks (:func:`build_loop`); :func:`build_controller` builds the controller."""

    lifecycle: Lifecycle
    dispatcher: Dispatcher
    rollout: Rollout
    sync: WeightSync
    reconfigure: Reconfigure
    meter: RolloutMeter
    supervisor: EngineSupervisor | None  # None: nothing revives engines (simulated ones)
    fleet: Fleet  # engines joining and leaving the run (``rollstream engines --add/--remove``)
    autoscaler: Autoscaler | None  # runtime.autoscale (None: the roster changes by hand only)
    trainer_turn: TrainerTurn | None  # colocated placement: engines stop for a trainer step
    trainer: TrainerLike
    metrics: MetricsLike
    clock: Clock
    start_step: int


def build_loop(cfg: RunConfig, *, engines: list[Engine], trainer: TrainerLike, tasks: TaskStream,
               graders: GraderPool, decode: Callable[[list[int]], str], ledger: Ledger,
               metrics: MetricsLike, clock: Clock, params: SamplingParams,
               span: Callable[..., None] | None = None, start_step: int = 0,
               staleness: StalenessPolicy, harnesses: Mapping[str, Harness] | None = None,
               reconfig_log: Path | None = None, supervise: bool = True,
               make: MakeEngine | None = None) -> Loop:
    """Wire dispatcher, rollout and weight sync as ``cfg`` says (tests use this with their
    own engines and trainers at the process edges). ``staleness``: the run's policy, the one
    its trainer was given. ``harnesses``: what runs tasks that are not one engine request
    (:func:`build_harnesses`); ``reconfig_log``: where reconfigurations are recorded (the run
    directory's ``reconfig.jsonl``); ``supervise``: revive an engine whose loop died (the
    simulator's never die: its poll over hundreds of engines would be most of a simulation's
    cost); ``make``: builds an engine that joins the run (:func:`engine_maker`; None: none
    can). ``engines`` becomes the run's roster: engines join and leave it (runtime/fleet.py)."""
    lifecycle = Lifecycle(ledger, clock)
    dispatcher = Dispatcher(engines=engines, params=params, graders=graders, decode=decode,
                            lifecycle=lifecycle, clock=clock, span=span, seed=cfg.seed,
                            harnesses=harnesses, dispatch=cfg.rollout.dispatch,
                            concurrency=concurrency_limits(cfg.rollout),
                            prefix_affinity=cfg.rollout.prefix_affinity,
                            breaker=cfg.rollout.breaker)
    rollout = Rollout(
        cfg=cfg.rollout, policy=staleness,
        groups_per_step=cfg.train.groups_per_step,
        total_groups=cfg.train.steps * cfg.train.groups_per_step, tasks=tasks,
        dispatcher=dispatcher, lifecycle=lifecycle,
        failed_reward=0.0 if cfg.train.failed_reward == "zero" else None,
    )

    async def on_applied(version: int, sync_s: float) -> None:
        metrics.record("phase", version, {"sync_s": sync_s, "sync_bytes": sync.num_bytes})
        rollout.on_version(version)

    sync = WeightSync(dispatcher.engines, dispatcher, cfg.rollout.on_update, on_applied,
                      version=start_step, clock=clock)

    def on_restart(engine_id: str, seconds: float) -> None:
        log.info(f"engine {engine_id} restarted at version {sync.version} in {seconds:.1f} s")
        metrics.record("phase", sync.version, {"engine_restart_s": seconds})

    supervisor = (EngineSupervisor(dispatcher.engines, sync, on_restart=on_restart, clock=clock)
                  if supervise else None)
    colocated = cfg.runtime.kind == "ray" and cfg.runtime.ray.placement == "colocated"
    meter = RolloutMeter(dispatcher.engines, dispatcher.stats, lambda: len(dispatcher.in_flight),
                         lambda: {**rollout.stats(), **dispatcher.gauges()}, clock=clock)
    reconfigure = Reconfigure(cfg, dispatcher=dispatcher, rollout=rollout, tasks=tasks,
                              trainer=trainer, metrics=metrics, log_path=reconfig_log)
    fleet = Fleet(dispatcher=dispatcher, sync=sync, make=make,
                  on_change=lambda n: metrics.record("phase", sync.version, {"num_engines": n}))
    scale = cfg.runtime.autoscale
    if scale is not None and make is None:
        raise ValueError("runtime.autoscale adds engines, but nothing can build one for this "
                         "run (its engines were given to it): drop runtime.autoscale")
    autoscaler = None if scale is None else Autoscaler(AutoscalePolicy(scale, clock), fleet,
                                                       rollout.capacity)
    return Loop(lifecycle=lifecycle, dispatcher=dispatcher, rollout=rollout, sync=sync,
                reconfigure=reconfigure, meter=meter, supervisor=supervisor, fleet=fleet,
                autoscaler=autoscaler,
                trainer_turn=TimeShare(dispatcher, sync).trainer_turn if colocated else None,
                trainer=trainer, metrics=metrics, clock=clock, start_step=start_step)


def build_controller(cfg: RunConfig, loop: Loop, *, after_step: AfterStep | None = None,
                     before_stop: BeforeStop | None = None, train_pool: Executor | None = None,
                     training: threading.Event | None = None) -> Controller:
    """The controller that runs ``loop`` for ``cfg.train.steps`` steps, given everything it
    calls (:class:`~rollstream.runtime.controller.Controller`)."""
    return Controller(
        rollout=loop.rollout, trainer=loop.trainer, sync=loop.sync, meter=loop.meter,
        metrics=loop.metrics, steps=cfg.train.steps, groups_per_step=cfg.train.groups_per_step,
        max_wall_s=cfg.max_wall_s, start_step=loop.start_step, supervisor=loop.supervisor,
        clock=loop.clock, reconfigure=loop.reconfigure, trainer_turn=loop.trainer_turn,
        after_step=after_step, before_stop=before_stop, train_pool=train_pool,
        training=training, autoscaler=loop.autoscaler)


def build_engines(cfg: RunConfig, weights: Path, *, version: int, run_dir: Path,
                  training: Callable[[], bool] | None = None,
                  ) -> tuple[list[Engine], RayCluster | None]:
    """The run's engines serving ``weights`` tagged ``version``: in this process
    (``runtime.kind: embedded``; ``training`` says whether a trainer step computes, which the
    local engine's pass recorder reads) or one Ray actor each (``ray``, in the run's scale
    units, with the Ray they run on, which holds the units and which the run stops at the
    end)."""
    from rollstream.engine.factory import engine_kind

    if cfg.runtime.kind == "embedded":
        make = _make_here(cfg, weights, version=version, training=training)
        return [make(i) for i in range(cfg.engine.num_engines)], None
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.nodes import check_cluster_has
    from rollstream.runtime.ray.units import ScaleUnits

    build_on_ray = engine_kind(cfg.engine.kind).ray_builder()
    cluster = RayCluster.start(cfg.runtime.ray, log_dir=RunFiles(run_dir).ray_logs)
    try:
        check_cluster_has(cfg.runtime.ray.nodes)
        cluster.units = ScaleUnits.reserve(cfg)
        engines = build_on_ray(cfg, weights, version=version, units=cluster.units,
                               run_dir=run_dir)
    except BaseException:
        cluster.stop()
        raise
    return engines, cluster  # the list the transport's broadcast group reads: the roster


def engine_maker(cfg: RunConfig, weights: Path, *, version: int, engines: list[Engine],
                 training: Callable[[], bool] | None = None) -> MakeEngine | None:
    """What builds the run's engine number ``index`` serving ``weights`` tagged ``version``,
    as :func:`build_engines` built its first ones (``engines``): the engines that join the
    run later (``runtime/fleet.py``). None where none can join: engines attached to servers
    the run did not start (``engine.vllm.urls``), and vLLM engine actors (not built yet)."""
    if cfg.engine.kind == "vllm" and (cfg.engine.vllm.urls or cfg.runtime.kind == "ray"):
        return None
    if cfg.runtime.kind == "ray":
        from rollstream.runtime.ray.engines import RayEngine
        from rollstream.runtime.ray.join import join_run_engines

        assert isinstance(engines[0], RayEngine)
        return join_run_engines(cfg, weights, version=version, like=engines[0])
    return _make_here(cfg, weights, version=version, training=training)


def _make_here(cfg: RunConfig, weights: Path, *, version: int,
               training: Callable[[], bool] | None) -> MakeEngine:
    """Engine ``index`` in this process (``runtime.kind: embedded``)."""
    from rollstream.engine.factory import build_engine

    def make(index: int) -> Engine:
        return build_engine(cfg.engine, weights, engine_id=f"{cfg.engine.kind}-{index}",
                            version=version, training=training, lora=cfg.model.lora)
    return make
