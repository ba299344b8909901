"""Build the components a config names: the embedded runtime's wiring, in one place.

:func:`check_inputs` validates what a run reads (model folder, dataset paths, reward names)
at once; :func:`build_run` builds every component for a run directory (the run directory is
prepared only after the model and the datasets have loaded and each source has a prompt that
fits the engines' context, so bad input never costs an earlier run's files) and returns them
as one :class:`Run`; ``runtime/train.py`` runs them. A build that fails closes every
component it had built (engine threads, files, worker processes, Ray) before it raises.
The sampling parameters (:func:`sampling_params`) and the trainer (:func:`build_trainer`) are
built from the config here and only here, for runs and benchmarks alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.clock import Clock, WallClock
from rollstream.config import RunConfig, SamplingConfig
from rollstream.data.ledger import REPLAYS, Ledger
from rollstream.durable import checkpoint as durable
from rollstream.durable.resume import reconcile_ledger, reconcile_logs
from rollstream.engine.protocol import Engine, SamplingParams
from rollstream.monitor.rollout_meter import RolloutMeter
from rollstream.reward.workers import ProcessWorkers, Workers
from rollstream.rollout.concurrency import concurrency_limits
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.harness import Harness
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.rollout.rollout import Rollout, TaskStream
from rollstream.rollout.supervisor import EngineSupervisor
from rollstream.runtime.controller import Controller, MetricsLike, TrainerLike
from rollstream.runtime.placement import TimeShare, placed_train
from rollstream.runtime.reconfigure import LOG_FILE, Reconfigure, with_applied
from rollstream.staleness import StalenessPolicy
from rollstream.sync.weights import WeightSync

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from rollstream.data.mix import TaskMix
    from rollstream.monitor.metrics import Metrics
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import RewardFn
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.units import ScaleUnits
    from rollstream.train.fsdp import FsdpTrainer
    from rollstream.train.trainer import Trainer
    from rollstream.trajectory import Task

log = logging.getLogger(__name__)


def check_inputs(cfg: RunConfig, rewards: Mapping[str, RewardFn] | None = None) -> None:
    """Fail early, naming the setting, when a model folder, a dataset file, a reward (a name,
    or a callable in ``rewards``), an episode's environment, agent, tool or tool-call parser
    or the sandbox's artifact folder is unusable, or the runtime's library is missing (runs
    call this before touching their run directory)."""
    from rollstream.data.sources import check_source_paths, source_rewards
    from rollstream.models.folder import validate_model_folder
    from rollstream.reward.registry import build_resolver

    if cfg.model.path is not None:
        validate_model_folder(Path(cfg.model.path))
    check_source_paths(cfg.tasks)
    build_resolver(cfg.reward, source_rewards(cfg.tasks), rewards)
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

        return Trainer(placed_train(cfg), model_path, **kwargs)
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

    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        for stale in ("ledger.jsonl", "ledger.superseded.jsonl", "metrics.jsonl",
                      "metrics.superseded.jsonl", "timeline.jsonl", "timeline.superseded.jsonl",
                      REPLAYS, "replays.superseded.jsonl", "engine_passes.jsonl",
                      "summary.json", LOG_FILE):
            (run_dir / stale).unlink(missing_ok=True)
        shutil.rmtree(durable.folder(run_dir), ignore_errors=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved_config(cfg), sort_keys=False))


def build_workers(cfg: RunConfig, size: int, role: str) -> Workers:
    """The pool of ``size`` workers a ``role`` (``reward``, ``harness``) runs its blocking
    calls in: processes this one spawns (``runtime.kind: embedded``) or Ray actors (``ray``;
    harness actors on the driver's node, where the agent proxy listens on 127.0.0.1). The one
    place that picks them; the grader pool and the harness only see :class:`Workers`."""
    if cfg.runtime.kind == "embedded":
        return ProcessWorkers(size, role=role)
    from rollstream.runtime.ray.workers import RayWorkers

    return RayWorkers(size, role=role, num_cpus=cfg.runtime.ray.worker_num_cpus,
                      on_driver_node=role == "harness")


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
    """The rollout side and the controller around given engines, trainer and tasks."""

    lifecycle: Lifecycle
    dispatcher: Dispatcher
    rollout: Rollout
    sync: WeightSync
    controller: Controller
    reconfigure: Reconfigure


def build_loop(cfg: RunConfig, *, engines: list[Engine], trainer: TrainerLike, tasks: TaskStream,
               graders: GraderPool, decode: Callable[[list[int]], str], ledger: Ledger,
               metrics: MetricsLike, clock: Clock, params: SamplingParams,
               span: Callable[..., None] | None = None, start_step: int = 0,
               staleness: StalenessPolicy, harnesses: Mapping[str, Harness] | None = None,
               reconfig_log: Path | None = None) -> Loop:
    """Wire dispatcher, rollout, weight sync and controller as ``cfg`` says (tests use this
    with their own engines and trainers at the process edges). ``staleness``: the run's
    policy, the one its trainer was given. ``harnesses``: what runs
    tasks that are not one engine request (:func:`build_harnesses`); ``reconfig_log``: where
    reconfigurations are recorded (the run directory's ``reconfig.jsonl``)."""
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
        metrics.record("phase", version, {"sync_s": sync_s})
        rollout.on_version(version)

    sync = WeightSync(engines, dispatcher, cfg.rollout.on_update, on_applied,
                      version=start_step, clock=clock)

    def on_restart(engine_id: str, seconds: float) -> None:
        log.info(f"engine {engine_id} restarted at version {sync.version} in {seconds:.1f} s")
        metrics.record("phase", sync.version, {"engine_restart_s": seconds})

    supervisor = EngineSupervisor(engines, sync, on_restart=on_restart, clock=clock)
    colocated = cfg.runtime.kind == "ray" and cfg.runtime.ray.placement == "colocated"
    turn = TimeShare(dispatcher, sync).trainer_turn if colocated else None
    meter = RolloutMeter(engines, dispatcher.stats, lambda: len(dispatcher.in_flight),
                         lambda: {**rollout.stats(), **dispatcher.gauges()}, clock=clock)
    reconfigure = Reconfigure(cfg, dispatcher=dispatcher, rollout=rollout, tasks=tasks,
                              trainer=trainer, metrics=metrics, log_path=reconfig_log)
    controller = Controller(
        rollout=rollout, trainer=trainer, sync=sync, meter=meter, metrics=metrics,
        steps=cfg.train.steps, groups_per_step=cfg.train.groups_per_step,
        max_wall_s=cfg.max_wall_s, start_step=start_step, supervisor=supervisor, clock=clock,
        reconfigure=reconfigure, trainer_turn=turn,
    )
    return Loop(lifecycle=lifecycle, dispatcher=dispatcher, rollout=rollout, sync=sync,
                controller=controller, reconfigure=reconfigure)


@dataclass(slots=True, kw_only=True)
class Run:
    """Every component of one run (built by :func:`build_run`, closed by :meth:`close`, then :meth:`stop`)."""

    cfg: RunConfig
    run_dir: Path
    model_path: Path
    tokenizer: Any  # the model folder's (AutoTokenizer): each saved folder is checked against it
    mix: TaskMix
    metrics: Metrics
    ledger: Ledger
    engines: list[Engine]
    graders: GraderPool
    trainer: Trainer | FsdpTrainer
    loop: Loop
    eval_tasks: list[Task]
    eval_params: SamplingParams
    resumed: durable.Checkpoint | None = None  # the checkpoint this run continues
    superseded_lines: int = 0  # ledger lines a resume moved to ledger.superseded.jsonl
    cluster: RayCluster | None = None  # runtime.kind: ray (stopped after the trainer closes)
    sandbox: Any = None  # the RunSandbox of agent.sandbox (closed with the harnesses)

    def stop(self) -> None:
        """Close the trainer, then stop the Ray the run uses (fsdp rank actors live in it):
        after :meth:`close` and the final checkpoint."""
        try:
            self.trainer.close()
        finally:
            if self.cluster is not None:
                self.cluster.stop()

    async def close(self) -> None:
        """Close harnesses, the sandbox pool, engines and graders (the trainer and Ray stay:
        :meth:`stop`)."""
        for harness in self.loop.dispatcher.harnesses.values():
            close = getattr(harness, "close", None)
            if close is not None:
                await close()
        if self.sandbox is not None:
            await self.sandbox.close()
        for e in self.engines:
            close = getattr(e, "close", None)
            if close is not None:
                await close()
        res: Any = self.graders.close()
        if asyncio.iscoroutine(res):
            await res


def build_engines(cfg: RunConfig, weights: Path, *, version: int,
                  run_dir: Path) -> tuple[list[Engine], RayCluster | None]:
    """The run's engines serving ``weights`` tagged ``version``: in this process
    (``runtime.kind: embedded``) or one Ray actor each (``ray``, in the run's scale units,
    with the Ray they run on, which holds the units and which the run stops at the end)."""
    from rollstream.engine.factory import build_engine, engine_kind

    if cfg.runtime.kind == "embedded":
        return [build_engine(cfg.engine, weights, engine_id=f"{cfg.engine.kind}-{i}",
                             version=version) for i in range(cfg.engine.num_engines)], None
    from rollstream.runtime.ray.cluster import LOG_DIR, RayCluster
    from rollstream.runtime.ray.units import ScaleUnits

    build_on_ray = engine_kind(cfg.engine.kind).ray_builder()
    cluster = RayCluster.start(cfg.runtime.ray, log_dir=run_dir / LOG_DIR)
    try:
        cluster.units = ScaleUnits.reserve(cfg)
        engines = build_on_ray(cfg, weights, version=version, units=cluster.units,
                               run_dir=run_dir)
    except BaseException:
        cluster.stop()
        raise
    return list(engines), cluster


async def build_run(cfg: RunConfig, run_dir: Path, *, resume: durable.Checkpoint | None = None,
                    rewards: Mapping[str, RewardFn] | None = None) -> Run:
    """Every component of a run; with ``cfg.resume`` it continues from ``resume`` (the run's
    newest checkpoint; None: none was written, the run starts at step 0 keeping the ledger's
    record of what the lost process did in ``ledger.superseded.jsonl``). ``rewards``: source
    name -> a reward callable given as an object (the Python API, ``rollstream.train``).
    On any failure, what was built is closed before the error propagates."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rollstream.agent.sandbox_shared import install_sandbox
    from rollstream.data.mix import TaskMix
    from rollstream.data.sources import source_rewards
    from rollstream.models.warmstart import prepare_model
    from rollstream.monitor.metrics import Metrics
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import build_resolver

    hf_logging.disable_progress_bar()
    saved = resume.state.get("reconfig", {}) if resume is not None else {}
    cfg_now = with_applied(cfg, saved.get("applied", []))  # what reconfigurations left in force
    resolve = build_resolver(cfg.reward, source_rewards(cfg.tasks), rewards)  # fail first
    model_path = Path(prepare_model(cfg.model, cfg.tasks, resolve))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    mix = TaskMix(cfg_now.tasks, tokenizer)  # a bad dataset fails here, before the run dir
    mix.check_fits(*cfg.engine.context)
    skip: set[str] = set()
    superseded = 0
    if cfg.resume:  # first: a ledger it refuses leaves the run directory as it was
        skip, superseded = reconcile_ledger(run_dir, resume, group_size=cfg.rollout.group_size)
        reconcile_logs(run_dir, resume)
    prepare_run_dir(cfg, run_dir, resume=cfg.resume)
    async with contextlib.AsyncExitStack() as built:  # unwound only if the build fails
        metrics = Metrics(run_dir, cfg.monitor)
        _close_on_failure(built, metrics.close)
        ledger = Ledger(run_dir / "ledger.jsonl")
        _close_on_failure(built, ledger.close)
        for task_uid, source, reason in mix.rejected():
            log.warning(f"skipped task {task_uid}: {reason}")
            if ledger.status_of(f"{task_uid}#row") is None:  # a resumed run recorded it before
                ledger.record_rejected(task_uid, source, reason)
        for warning in mix.warnings():
            log.warning(warning)
        version = resume.step if resume is not None else 0  # weight version = steps done
        weights = resume.model_dir if resume is not None else model_path
        engines, cluster = build_engines(cfg, weights, version=version, run_dir=run_dir)
        if cluster is not None:  # stopped last: the trainer's ranks and engines live in it
            _close_on_failure(built, cluster.stop)
        for engine in engines:
            _close_on_failure(built, engine.close)
        graders = GraderPool(cfg.reward, resolve,
                             build_workers(cfg, cfg.reward.num_workers, "reward"))
        _close_on_failure(built, graders.close)
        stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        staleness = cfg_now.rollout.staleness_policy()  # one policy: trainer and rollout
        trainer = build_trainer(cfg_now, model_path, cluster.units if cluster else None,
                                staleness=staleness)
        _close_on_failure(built, trainer.close)
        sandbox = install_sandbox(cfg.agent.sandbox)  # started by its first program
        _close_on_failure(built, sandbox.close)
        harnesses = build_harnesses(cfg, tokenizer, sandbox)
        for harness in harnesses.values():
            if (close := getattr(harness, "close", None)) is not None:
                _close_on_failure(built, close)
        loop = build_loop(cfg_now, engines=engines, trainer=trainer, tasks=mix, graders=graders,
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          ledger=ledger, metrics=metrics, clock=WallClock(),
                          params=sampling_params(cfg_now.sampling, stop), span=metrics.span,
                          start_step=version, staleness=staleness, harnesses=harnesses,
                          reconfig_log=run_dir / LOG_FILE)
        if resume is not None:
            _load_trainer_state(trainer, resume)
            loop.rollout.restore(resume.state["rollout"], version=version)
            loop.reconfigure.restore(saved, version=version)
        loop.rollout.skip(skip)
        built.pop_all()  # built whole: the Run owns every component now
    return Run(
        cfg=cfg, run_dir=run_dir, model_path=model_path, tokenizer=tokenizer, mix=mix,
        metrics=metrics,
        ledger=ledger, engines=engines, graders=graders, trainer=trainer, loop=loop,
        eval_tasks=mix.eval_tasks(),
        eval_params=sampling_params(cfg.sampling, stop, temperature=cfg.eval.temperature),
        resumed=resume, superseded_lines=superseded, cluster=cluster, sandbox=sandbox,
    )


def _close_on_failure(built: contextlib.AsyncExitStack, close: Callable[[], Any]) -> None:
    """Call ``close`` (sync or async) when ``built`` unwinds; an error of its own is logged,
    so the build's error is the one that propagates."""
    async def closing() -> None:
        try:
            res = close()
            if inspect.isawaitable(res):
                await res
        except Exception:  # noqa: BLE001 - fault boundary: cleanup after a failed build
            log.exception("closing %r after a failed build", close)

    built.push_async_callback(closing)


def _load_trainer_state(trainer: Any, ckpt: durable.Checkpoint) -> None:
    """The trainer continues from ``ckpt``; a checkpoint it cannot take (an optimizer state
    of another model, say) is a ValueError naming the files."""
    try:
        trainer.load_training_state(ckpt.model_dir, ckpt.trainer_file)
    except Exception as e:  # noqa: BLE001 - fault boundary: named, the cause kept
        raise ValueError(f"checkpoint {ckpt.path}: the trainer cannot continue from "
                         f"{ckpt.trainer_file} and {ckpt.model_dir} "
                         f"({type(e).__name__}: {e})") from e
