"""The config of where a run's components live (docs/distributed.md): one process
(``embedded``) or Ray actors (``ray``). The controller is the same on both; this section only
says where engines, workers and fsdp ranks run (scale units) and which Ray they run on.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from rollstream.config.engine import EngineConfig
from rollstream.config.section import Section
from rollstream.config.train import TrainConfig

MIN_OBJECT_STORE_BYTES = 78643200  # Ray refuses less (75 MiB)
DEFAULT_BUCKET_BYTES = 64 << 20
# 1,024 episodes of 4,096 tokens; 16 MiB of int32 in an engine actor, and as much in its mirror
DEFAULT_EPISODE_CACHE_TOKENS = 1 << 22
# Ray's own inline limit (max_direct_call_object_size): below it, a payload by reference took
# 2.3-3.2x an inline round trip; above it Ray stores the payload in its object store anyway
# and the explicit reference cost 5-16% more (docs/distributed.md, "Control and data planes")
DEFAULT_OUT_OF_BAND_BYTES = 100 << 10


# Ray's own resources: a role's node is named by a custom one the user gives its nodes
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# one resource name as `ray start --resources` takes it (a JSON key; kept to a shell-safe set)
_RESOURCE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


class RayNodesConfig(Section):
    """Which nodes of a cluster each role's actors go to, each named by a custom resource
    that those nodes were started with (``ray start --resources '{"rs_engines": 1}'``: a
    mark, not a count; CPUs bound how many actors fit, as without it). A role left null
    goes wherever its CPUs fit, as without this section. The driver (the process that runs
    ``rollstream train``, with the controller and a ``train.backend: local`` trainer) runs on
    the node it is started on, and harness workers stay on its node (the agent proxy listens on
    127.0.0.1 there). Only with ``runtime.ray.address`` (the run's own local Ray is one node
    without custom resources). docs/distributed.md, "Nodes per role"."""

    engines: str | None = None
    """The resource of the nodes that hold the engine actors: the run's scale units' engine
    bundles reserve it, and engines that join a live run ask for it too."""
    trainer: str | None = None
    """The resource of the nodes that hold the fsdp rank actors (``train.backend: fsdp``; a
    ``local`` trainer runs in the driver). When it differs from ``engines``, each scale unit's
    ranks get a bundle of their own, so ranks and engines go to their own nodes."""
    rewards: str | None = None
    """The resource of the nodes that hold the reward worker actors (``reward.num_workers``)."""

    @model_validator(mode="after")
    def _custom_resources(self) -> RayNodesConfig:
        for role in ("engines", "trainer", "rewards"):
            name = getattr(self, role)
            if name is None:
                continue
            if name in RAY_RESOURCES or name.startswith("node:") or \
                    not _RESOURCE_NAME.fullmatch(name):
                raise ValueError(
                    f"runtime.ray.nodes.{role} = {name!r} is not a custom resource name: "
                    "letters, digits, '_', '.', '-' (up to 64, not starting with a digit), "
                    f"none of Ray's own ({', '.join(RAY_RESOURCES)}, node:...)")
        return self

    def roles(self) -> dict[str, str]:
        """Each role that has a node resource -> that resource."""
        return {role: name for role in ("engines", "trainer", "rewards")
                if (name := getattr(self, role)) is not None}


class RayConfig(Section):
    """Settings of the Ray runtime (read only with ``runtime.kind: ray``)."""

    address: str | None = None
    """An existing cluster to join: its head's ``host:port`` (rollstream must be importable on
    its nodes; ``ray://`` addresses need Ray Client, ``ray[client]``). Null: the run starts a local Ray of its own on 127.0.0.1 (no dashboard, logs
    in the run directory's ``ray-logs``) and stops it at the end."""
    num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of the local Ray (null: the machine's count). Only with ``address`` null."""
    object_store_bytes: int | None = Field(None, ge=MIN_OBJECT_STORE_BYTES)
    """Object store memory of the local Ray (null: Ray's default, 30% of memory). Only with
    ``address`` null."""
    engine_num_cpus: float = Field(1.0, gt=0)
    """Logical CPUs each engine actor reserves (Ray places actors by these)."""
    rank_num_cpus: float = Field(1.0, gt=0)
    """Logical CPUs each fsdp rank actor reserves (``train.backend: fsdp``, whose ranks are
    Ray actors on this runtime). Read only with that backend."""
    scale_units: int = Field(1, ge=1)
    """Scale units: groups of engine actors and fsdp rank actors placed together on one node
    (one node's worth of the run), so a cluster is described as N units. Each unit holds
    ``engine.num_engines / scale_units`` engines and ``train.fsdp.world_size / scale_units``
    ranks (both must divide evenly); the run reserves one Ray placement group with a bundle
    per unit (its actors' CPUs; two, its engines' and its ranks', when ``nodes`` gives them
    different nodes), units spread over nodes. docs/distributed.md."""
    worker_num_cpus: float = Field(0.0, ge=0)
    """Logical CPUs each reward worker actor (``reward.num_workers`` of them) and harness
    worker actor (``agent.harness_workers``) reserves. 0: none; they mostly wait, and a
    reservation would take CPUs the engine actors are placed by. Set it on a cluster to have
    Ray spread CPU-heavy rewards by their CPUs."""
    weight_sync: Literal["object_store", "broadcast", "shared_memory", "auto"] = "object_store"
    """How new weights reach the engine actors: ``object_store`` (one ``ray.put`` per version,
    a reference per actor), ``broadcast`` (a gloo process group of the driver and the actors,
    the weights in buckets of ``bucket_bytes``), ``shared_memory`` (written once under
    /dev/shm in buckets, read by each actor; actors on this host only, so not with
    ``address``), ``auto`` (by each actor's node: shared memory to those on the driver's
    node, the object store to the others; the dashboard names each engine's). A revived
    actor gets the current version through the object store. With ``engine.kind: vllm`` only
    ``auto`` is read (the default means: the driver writes this host's shared memory, so
    servers on its node only): a server whose actor runs on another node gets each version
    through the object store, written by its actor to that node's shared memory
    (runtime/ray/vllm_weights.py), and the engine's HTTP to it crosses by that actor
    (runtime/ray/relay.py)."""
    delta: bool = True
    """True: an engine actor that holds the previous version gets only what changed, in
    its dtype (``engine.local.dtype``): the changed elements' indices and values, or whole
    tensors where that is smaller; a version where more than half of all elements changed,
    an actor's first load, one that missed a version and a replaced actor get the full
    version in that dtype. Exact: the weights after a delta equal a full sync's bit for bit.
    Gains come with ``bfloat16`` engines (small AdamW moves round to the same value); with
    ``float32`` nearly every element moves each step. False: every version goes whole, as
    the trainer holds it. Bytes per sync, kind and dtype are logged per send (sync/delta.py,
    docs/distributed.md)."""
    placement: Literal["colocated", "disaggregated"] | None = None
    """Where engines and the trainer run on this host's CPUs: ``disaggregated`` pins the
    engine actors and the trainer to separate cores (the lower and upper half); ``colocated``
    lets them share every core and take turns (the engines stop while the trainer steps and
    resume with its new weights); null: Ray places the actors by ``engine_num_cpus``, nothing
    pinned. One host only (not with ``address``); docs/distributed.md."""
    episode_cache_tokens: int = Field(DEFAULT_EPISODE_CACHE_TOKENS, ge=0)
    """Tokens of episode histories each engine actor keeps (and the driver mirrors, 4 bytes a
    token on each side), so that a request continuing an episode (its next turn, or a sample
    resumed after an interrupt) sends only the tokens added since its last call; the oldest
    are evicted first. 0: every request sends its whole prompt. An evicted or lost history
    (a replaced actor) costs one more call with the whole prompt, never a wrong one."""
    out_of_band_bytes: int = Field(DEFAULT_OUT_OF_BAND_BYTES, ge=0)
    """Token payloads (a request's prompt tokens, a reply's tokens with their logprobs and
    versions, a peek's) above this many bytes go through Ray's object store, the call carrying
    their reference (shared memory on one host, Ray's object transfer across hosts); smaller
    ones ride the call. 0: every payload out of band."""
    bucket_bytes: int = Field(DEFAULT_BUCKET_BYTES, ge=1 << 20)
    """Bucket size of ``weight_sync: broadcast`` and ``shared_memory`` (and ``auto``'s shared
    memory; a larger tensor goes alone); bounds the extra memory of a sync to about one bucket
    per process."""
    broadcast_backend: Literal["gloo", "nccl"] = "gloo"
    """The process group of ``weight_sync: broadcast``: ``gloo`` (buckets in CPU memory, any
    machine) or ``nccl`` (buckets in GPU memory, GPU to GPU: the driver and every engine actor
    need a CUDA device; refused at load where this machine has none). The bucket plan is the
    same for both (sync/buckets.py)."""
    nodes: RayNodesConfig = RayNodesConfig()
    """Which of a cluster's nodes each role (engines, fsdp ranks, reward workers) goes to,
    each named by a custom resource those nodes were started with (``ray start --resources
    '{"rs_engines": 1}'``: a mark, not a count). A role left null goes wherever its CPUs fit.
    The driver runs where it is started, harness workers on its node. Only with ``address``.
    Unlike ``placement`` (this host's cores), it chooses nodes. docs/distributed.md, "Nodes
    per role"."""

    @model_validator(mode="after")
    def _local_settings_need_a_local_ray(self) -> RayConfig:
        for name in ("num_cpus", "object_store_bytes"):
            if self.address is not None and getattr(self, name) is not None:
                raise ValueError(
                    f"runtime.ray.{name} sizes the local Ray a run starts, but runtime.ray."
                    f"address = {self.address!r} joins an existing cluster: drop one of them")
        if self.placement is not None and self.address is not None:
            raise ValueError(
                f"runtime.ray.placement = {self.placement!r} places processes on this host's "
                f"CPUs, but runtime.ray.address = {self.address!r} joins a cluster: drop one")
        if self.weight_sync == "shared_memory" and self.address is not None:
            raise ValueError(
                "runtime.ray.weight_sync = 'shared_memory' reaches actors on this host only, "
                f"but runtime.ray.address = {self.address!r} joins a cluster: use broadcast "
                "or object_store there")
        if self.broadcast_backend == "nccl":
            _check_nccl(self.weight_sync)
        if self.weight_sync == "object_store" and self.bucket_bytes != DEFAULT_BUCKET_BYTES:
            raise ValueError(
                "runtime.ray.bucket_bytes is read only with runtime.ray.weight_sync: broadcast, "
                "shared_memory or auto (it is object_store): set one or drop bucket_bytes")
        return self


def _check_nccl(weight_sync: str) -> None:
    """``broadcast_backend: nccl`` needs the broadcast and a CUDA device (torch is imported
    only for this question: the config loads without it otherwise)."""
    if weight_sync != "broadcast":
        raise ValueError(
            "runtime.ray.broadcast_backend = 'nccl' is read only with runtime.ray.weight_sync: "
            f"broadcast (it is {weight_sync}): set weight_sync: broadcast or drop it")
    import importlib.util

    cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        raise ValueError(
            "runtime.ray.broadcast_backend = 'nccl' needs CUDA, and this machine has no CUDA "
            "device (torch.cuda.is_available() is False): use gloo (allowed: gloo, nccl)")


class AutoscaleConfig(Section):
    """Engines added and removed while the run trains (``runtime/autoscale.py``), through the
    same path as ``rollstream engines RUN --add / --remove``. At most one change per
    ``window_s``."""

    min_engines: int = Field(1, ge=1)
    """Never fewer engines than this: shrinking stops here (at most ``engine.num_engines``,
    the run's engines at its start)."""
    max_engines: int = Field(4, ge=1)
    """Never more engines than this: growing stops here (at least ``engine.num_engines``
    and ``min_engines``)."""
    grow_after_s: float = Field(30.0, gt=0)
    """Add an engine once requests have waited for an engine slot (in the dispatch queue or
    in the engines' own queues) for this many seconds without a break."""
    shrink_busy_below: float = Field(0.3, ge=0, le=1)
    """Remove an engine when the engines' busy share over the last ``window_s`` (forward-pass
    seconds per engine-second) is below this while admission is blocked by the staleness
    capacity: the engines wait for the trainer, not the other way round. 0: never shrink."""
    window_s: float = Field(60.0, gt=0)
    """The window the busy share is measured over, and the least time between two changes."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> AutoscaleConfig:
        if self.min_engines > self.max_engines:
            raise ValueError(
                f"runtime.autoscale.min_engines = {self.min_engines} is above runtime."
                f"autoscale.max_engines = {self.max_engines}: min_engines <= max_engines")
        return self


class RuntimeConfig(Section):
    """Where the run's components live."""

    kind: Literal["embedded", "ray"] = "embedded"
    """``embedded``: everything in this process (engines on threads, reward and harness
    workers in processes it spawns). ``ray``: each engine, reward worker, harness worker and
    (with ``train.backend: fsdp``) trainer rank is a Ray actor (its own process) behind the
    same protocols, engines and ranks in ``ray.scale_units`` placement-group units; the
    controller and grader pool (and a ``train.backend: local`` trainer) stay in this
    process."""
    ray: RayConfig = RayConfig()
    """Settings of ``kind: ray``."""
    autoscale: AutoscaleConfig | None = None
    """Add and remove engines as the run goes (its bounds, when to grow and shrink). Null:
    the run keeps ``engine.num_engines`` engines unless an operator adds or removes some."""

    @model_validator(mode="after")
    def _ray_settings_need_ray(self) -> RuntimeConfig:
        if self.kind == "embedded" and self.ray != RayConfig():
            changed = sorted(k for k in RayConfig.model_fields
                             if getattr(self.ray, k) != getattr(RayConfig(), k))
            raise ValueError(
                f"runtime.ray.{changed[0]} is read only with runtime.kind: ray (it is "
                "embedded): set runtime.kind: ray or drop the runtime.ray settings")
        return self


def check_runtime(rt: RuntimeConfig, *, engine: EngineConfig, train: TrainConfig,
                  num_workers: int) -> None:
    """Runtime settings that contradict the engine and train sections (``num_workers``: the
    reward and harness worker actors)."""
    if rt.autoscale is not None:
        _check_autoscale(rt, engine)
    if rt.kind != "ray":
        return
    if engine.kind == "vllm":
        _check_vllm(rt.ray, engine)
    if rt.ray.placement == "disaggregated":
        for name, value in (("engine.local.cpu_affinity", engine.local.cpu_affinity),
                            ("train.cpu_affinity", train.cpu_affinity)):
            if value:
                raise ValueError(
                    f"{name} = {list(value)} contradicts runtime.ray.placement = "
                    "'disaggregated', which pins engines and trainer itself: drop one")
    _check_units(rt.ray, engine, train)
    _check_nodes(rt.ray, engine, train)
    fsdp = train.backend == "fsdp"
    ranks = train.fsdp.world_size if fsdp else 0
    need = engine.num_engines * rt.ray.engine_num_cpus + ranks * rt.ray.rank_num_cpus
    if rt.ray.num_cpus is not None and need > rt.ray.num_cpus:
        raise ValueError(
            f"engine.num_engines = {engine.num_engines} actors of runtime.ray."
            f"engine_num_cpus = {rt.ray.engine_num_cpus}"
            + (f" and train.fsdp.world_size = {ranks} rank actors of runtime.ray.rank_num_cpus"
               f" = {rt.ray.rank_num_cpus}" if fsdp else "")
            + f" need {need:g} CPUs, more than runtime.ray.num_cpus = {rt.ray.num_cpus}: Ray "
            "would never place them all")
    workers_cpus = num_workers * rt.ray.worker_num_cpus
    if rt.ray.num_cpus is not None and need + workers_cpus > rt.ray.num_cpus:
        raise ValueError(
            f"runtime.ray.worker_num_cpus = {rt.ray.worker_num_cpus} for {num_workers} worker "
            f"actors (reward.num_workers + agent.harness_workers) and {need:g} CPUs of "
            f"{'engine and rank' if fsdp else 'engine'} actors need more than runtime.ray.num_cpus = {rt.ray.num_cpus}: Ray "
            "would never place them all")


# read only by the local engine's actors: vLLM engines on Ray stream over HTTP and reload
# weights from shared memory (runtime/ray/vllm.py), of this host's or, with weight_sync:
# auto, of their node's
_LOCAL_ACTOR_FIELDS = ("weight_sync", "delta", "bucket_bytes", "episode_cache_tokens",
                       "out_of_band_bytes")
_VLLM_WEIGHT_SYNC = ("auto",)  # what weight_sync may say besides its default, with vllm


def _check_vllm(rt: RayConfig, engine: EngineConfig) -> None:
    """vLLM engines on Ray: servers their actors launch (runtime/ray/vllm.py)."""
    if engine.vllm.urls:
        raise ValueError(
            f"engine.vllm.urls = {list(engine.vllm.urls)} attaches to running servers, but "
            "runtime.kind: ray launches each engine's server from an actor: drop one of them")
    for name in _LOCAL_ACTOR_FIELDS:
        value = getattr(rt, name)
        if value == RayConfig.model_fields[name].default or \
                name == "weight_sync" and value in _VLLM_WEIGHT_SYNC:
            continue
        allowed = " (or set it to auto: by node, the server's actor writes them on its node)" \
            if name == "weight_sync" else ""
        raise ValueError(
            f"runtime.ray.{name} = {value!r} is read only by local engine actors, but "
            "engine.kind = 'vllm' (its engines stream over HTTP and reload weights from "
            f"shared memory): drop runtime.ray.{name}{allowed}")
    if rt.placement == "disaggregated":
        raise ValueError(
            "runtime.ray.placement = 'disaggregated' pins the local engine's threads to cores; "
            "a vLLM server places its own processes (VLLM_CPU_OMP_THREADS_BIND): use "
            "placement colocated or null with engine.kind: vllm")


def _check_units(ray: RayConfig, engine: EngineConfig, train: TrainConfig) -> None:
    """The scale units against the engines and fsdp ranks they hold."""
    fsdp = train.backend == "fsdp"
    if not fsdp and ray.rank_num_cpus != RayConfig.model_fields["rank_num_cpus"].default:
        raise ValueError(
            f"runtime.ray.rank_num_cpus = {ray.rank_num_cpus} is read only with train.backend "
            f"= fsdp (it is {train.backend}): set backend: fsdp or drop rank_num_cpus")
    if fsdp and train.fsdp.device != "cpu":
        raise ValueError(
            f"train.fsdp.device = {train.fsdp.device!r} with runtime.kind: ray is not built "
            "yet (rank actors compute on CPU): use train.fsdp.device: cpu, or runtime.kind: "
            "embedded")
    counts = {"engine.num_engines": engine.num_engines}
    if fsdp:
        counts["train.fsdp.world_size"] = train.fsdp.world_size
    for field, count in counts.items():
        if count % ray.scale_units:
            raise ValueError(
                f"{field} = {count} does not split into runtime.ray.scale_units = "
                f"{ray.scale_units} equal units: each unit holds an equal share: "
                f"allowed scale_units divide {' and '.join(f'{k} = {v}' for k, v in counts.items())}")


def _check_nodes(ray: RayConfig, engine: EngineConfig, train: TrainConfig) -> None:
    """The roles given nodes against the Ray they need and the run's actors of those roles."""
    nodes, roles = ray.nodes, ray.nodes.roles()
    if roles and ray.address is None:
        role = next(iter(roles))
        raise ValueError(
            f"runtime.ray.nodes.{role} = {roles[role]!r} names nodes of a cluster, but "
            "runtime.ray.address is null: the run's own local Ray is one node without "
            "custom resources; set runtime.ray.address to the cluster's head, or drop "
            "runtime.ray.nodes")
    if nodes.trainer is not None and train.backend != "fsdp":
        raise ValueError(
            f"runtime.ray.nodes.trainer = {nodes.trainer!r} places fsdp rank actors, but "
            f"train.backend = {train.backend!r} trains in the driver process, on the node the "
            "run is started on: set train.backend: fsdp or drop runtime.ray.nodes.trainer")
    if nodes.engines is not None and engine.kind == "vllm" and ray.weight_sync != "auto":
        raise ValueError(
            f"runtime.ray.nodes.engines = {nodes.engines!r} with engine.kind = 'vllm' places "
            "vLLM servers on other nodes, whose weights their actors must write on their "
            "node: set runtime.ray.weight_sync: auto (it is "
            f"{ray.weight_sync}), or drop runtime.ray.nodes.engines")


def _check_autoscale(rt: RuntimeConfig, engine: EngineConfig) -> None:
    """The autoscaler's bounds against the engines the run starts with and can build."""
    scale = rt.autoscale
    assert scale is not None
    n = engine.num_engines
    if not scale.min_engines <= n <= scale.max_engines:
        raise ValueError(
            f"engine.num_engines = {n} is outside runtime.autoscale's bounds (min_engines = "
            f"{scale.min_engines}, max_engines = {scale.max_engines}): the run starts with "
            "engine.num_engines engines; set it between them")
    if engine.kind == "vllm" and engine.vllm.urls:
        raise ValueError(
            f"runtime.autoscale adds engines, but engine.vllm.urls = {list(engine.vllm.urls)} "
            "attaches to running servers (none can be started): drop one of them")
    if rt.kind == "ray" and engine.kind == "vllm":
        raise ValueError(
            "runtime.autoscale with engine.kind = 'vllm' on runtime.kind: ray is not built yet "
            "(vLLM engine actors cannot join a live run): drop runtime.autoscale, or use "
            "engine.kind: local on Ray, or runtime.kind: embedded")
    if rt.kind == "ray" and rt.ray.num_cpus is not None and \
            scale.max_engines * rt.ray.engine_num_cpus > rt.ray.num_cpus:
        raise ValueError(
            f"runtime.autoscale.max_engines = {scale.max_engines} engine actors of runtime.ray."
            f"engine_num_cpus = {rt.ray.engine_num_cpus} need more than runtime.ray.num_cpus = "
            f"{rt.ray.num_cpus}: Ray could never place them all")
