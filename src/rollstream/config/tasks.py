"""The config of what a run trains on: task sources (generated families, datasets and agent
tasks, with their columns and rewards) and how agent episodes run. Part of the config tree of
``config/schema.py``, which imports these sections."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from rollstream.config.openenv import OpenEnvConfig
from rollstream.config.section import Section
from rollstream.trajectory import RESPONSE_KWARGS

_DATASET_KINDS = ("jsonl", "parquet", "hf_dataset")  # the kinds that read a dataset at `path`
_COLUMN_PATH = r"^[^.\s]+(\.[^.\s]+)*$"  # dotted path into nested fields: reward_model.ground_truth
_IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"  # module:attribute
_IMPORT_OR_MODULE = r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$"  # module:attribute or module
EPISODE_ROW = "row"  # task.extra key of an agentic dataset task's whole row
MISSING = object()  # lookup: no value at the path
# what the tally kind's episodes run with unless its source names others: written as a user
# writes theirs (agent/tally.py)
_TALLY = "rollstream.agent.tally"
TALLY_EPISODES = {"environment": f"{_TALLY}:TallyEnvironment", "agent": f"{_TALLY}:openai_agent",
                  "tools": (f"{_TALLY}:calc",), "tool_parser": f"{_TALLY}:command_parser"}


class ColumnsConfig(Section):
    """Which dataset columns mean what (dotted paths reach into nested fields, e.g.
    ``reward_model.ground_truth``)."""

    prompt: str = Field("prompt", pattern=_COLUMN_PATH)
    """The prompt: a string (tokenized as is) or chat messages, a list of ``{role, content}``
    (rendered with the model's chat template and its generation prompt, as TRL and verl do)."""
    answer: str | None = Field(None, pattern=_COLUMN_PATH)
    """The reference answer (``task.reference``; a number is turned into its text). Null =
    the first of ``answer``, ``solution``, ``reward_model.ground_truth`` (verl) that the row
    has."""
    id: str | None = Field(None, pattern=_COLUMN_PATH)
    """A row id naming the task ``<source>/<id>`` (a non-empty string or an integer). Null
    = ``id`` when the row has one; a row without an id is named by its line (JSONL) or row
    number."""


class ReasoningGymConfig(Section):
    """One of reasoning-gym's task generators (the ``reasoning-gym`` package, the
    ``reasoning_gym`` extra): ``reasoning_gym.create_dataset(dataset, size=, seed=,
    **options)``, generated locally (docs/data.md)."""

    dataset: str = Field(pattern=r"^[a-z0-9_]+$")
    """The generator's name as reasoning-gym registers it (``chain_sum``,
    ``basic_arithmetic``, ...); checked when the run is built."""
    size: int = Field(1000, ge=1, le=1_000_000)
    """Entries generated (indices ``0..size-1``), all when the run is built; training cycles
    through those that fall in the training split."""
    seed: int | None = Field(None, ge=0)
    """The generator's seed (entry ``i`` is a pure function of seed and ``i``); null =
    ``tasks.seed``."""
    options: dict[str, Any] = {}
    """The generator's own options (its config class's fields, e.g. chain_sum's
    ``min_terms``, ``max_digits``), JSON values; checked by the generator when the run is
    built."""


class SourceConfig(Section):
    kind: Literal["tick", "digits", "math", "jsonl", "parquet", "hf_dataset", "tally",
                  "reasoning_gym"] = "tick"
    """Task family: ``tick`` (count up/down, long-tailed length), ``digits`` (count a
    fixed-width number down by 3, long-tailed), ``math`` (small arithmetic, graded by
    math-verify), ``tally`` (a multi-turn agent episode: sum a list with a calculator tool, one
    call per item; run by the agent loop with the ``agent`` settings; docs/agents.md),
    ``reasoning_gym`` (a reasoning-gym generator named in ``reasoning_gym``, graded by its own
    scorer); or a dataset at ``path``: ``jsonl`` (one JSON object per line), ``parquet`` (a
    Parquet file, e.g. verl's), ``hf_dataset`` (a folder written by Hugging Face ``datasets``'
    ``Dataset.save_to_disk``, one split)."""
    reasoning_gym: ReasoningGymConfig | None = None
    """``kind: reasoning_gym`` only (and required there): the generator, its size, seed and
    options."""
    path: str | None = None
    """The dataset of a ``jsonl``, ``parquet`` (a file) or ``hf_dataset`` (a folder) source
    (``~`` is expanded)."""
    columns: ColumnsConfig = ColumnsConfig()
    """Which columns of a dataset source hold the prompt, the answer and the row id."""
    reward_kwargs: tuple[str, ...] = ()
    """Columns of a dataset source passed to its reward as keyword arguments, each named by
    its last path segment (``extra_info`` -> ``extra_info=...``, ``reward_model.style`` ->
    ``style=...``); values must be JSON values (a checkpoint keeps them). The reward's
    signature is checked against them when the run is built."""
    reward: str | None = Field(None, min_length=1)
    """The reward that grades this source's tasks: a registered reward name (``exact_match``,
    ``math``, ``math_answer``, or one registered with ``@register_reward``) or an import path
    ``module:function``; not with ``harness: verifiers`` (the environment's rubric grades).
    Null = the kind's own (math: ``math_answer``; reasoning_gym:
    ``reasoning_gym``, the generator's own scorer; the others: ``exact_match``). Only with
    ``reward.name: auto``; checked when the run is built."""
    name: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Source name used in task uids and metrics (null = the kind); unique within a mix."""
    weight: float = Field(1.0, gt=0)
    """This source's target share of trained samples (weights are normalised over the
    sources): ``tasks.mix: quota`` keeps the trained mixture there, ``weighted`` draws this
    share of the groups (docs/data.md)."""
    max_oversample: float = Field(4.0, ge=1)
    """``tasks.mix: quota`` only: the correction may draw at most this many times the share of
    groups the weight gives (a source whose groups are mostly filtered needs more draws; one
    that never trains cannot take the whole rollout, its trained share falls short instead,
    as ``mixture_error_pp`` shows)."""
    max_in_flight: int | None = Field(None, ge=1)
    """Groups of this source generating at once (null = no cap): when it is reached, the next
    groups come from the other sources, or wait for one of this source's to finish."""
    max_in_flight_per_task: int | None = Field(None, ge=1)
    """Dataset kinds only: groups of one task (row) generating at once (null = no cap); a row
    at its cap is passed over until the cursor comes round again."""
    harness: Literal["agent", "openai", "verifiers"] | None = None
    """How this source's tasks run (docs/agents.md): null = one engine request per sample;
    ``agent`` = multi-turn episodes of the built-in agent loop with ``environment``;
    ``openai`` = episodes driven by ``agent``, a function written with the ``openai`` SDK
    against rollstream's OpenAI-compatible proxy on 127.0.0.1; ``verifiers`` = episodes
    that a ``vf.Environment`` named in ``environment`` (the ``verifiers`` extra) rolls out
    against that proxy, graded by its rubric. For dataset kinds and ``tally`` (whose default
    is ``agent``; not ``verifiers``). A dataset row's ``prompt`` is the episode's opening (a
    string is one user message); the whole row is ``task.extra["row"]``."""
    environment: str | None = Field(None, pattern=_IMPORT_OR_MODULE)
    """``harness: agent``: the environment, an import path ``module:name`` of a class or
    function called for each episode as ``name(row=..., **environment_kwargs)`` (plus
    ``tools=`` and ``parser=`` when it declares them) and returning an environment (async or
    plain ``reset()`` / ``step(turn)``; docs/agents.md). Required for a dataset kind; tally's
    is ``rollstream.agent.tally:TallyEnvironment``. ``harness: verifiers`` (required): an
    import path of a ``vf.Environment`` or of a function returning one (given
    ``environment_kwargs``, as a hub module's ``load_environment``), or the name of an
    installed verifiers environment module; loaded and checked when the run is built."""
    environment_kwargs: dict[str, Any] = {}
    """Keyword arguments of ``environment`` besides the row (JSON values); with ``harness:
    verifiers``, those of its ``load_environment``."""
    openenv: OpenEnvConfig | None = None
    """``harness: agent``, instead of ``environment``: the episodes run in an OpenEnv
    environment (its server, launched by the run or given by URL; docs/agents.md); it grades
    them, so the source names no ``reward``."""
    agent: str | None = Field(None, pattern=_IMPORT_PATH)
    """``harness: openai``: the agent, an import path ``module:function`` of an ``async def
    (session, task, sampling)`` that runs one episode with the ``openai`` SDK. Required for a
    dataset kind; tally's is ``rollstream.agent.tally:openai_agent``."""
    tools: tuple[str, ...] = ()
    """Tools its episodes may call: built-in names (``calculator``, ``python``: runs the
    model's program in an ``agent.sandbox``) or import paths of a tool object or of a
    function or class that makes one (given ``sandbox=``, the run's sandbox pool, when it
    declares it). Tally's: ``rollstream.agent.tally:calc``."""
    tool_parser: str | None = Field(None, pattern=r"^(hermes|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$")
    """How its model writes tool calls: ``hermes`` (``<tool_call>{json}</tool_call>``, Qwen2.5
    and Hermes models; the default) or an import path of a parser object, or of a function or
    class that makes one (``parse(text)`` and ``render(call)``, agent/tools.py). Tally's:
    ``rollstream.agent.tally:command_parser`` (``#calc 1+2``)."""
    max_items: int = Field(32, ge=1)
    """Upper bound on answer items (caps the long tail)."""
    pareto_alpha: float = Field(1.1, gt=0)
    """Shape of the Pareto distribution of the number of items (smaller = longer tail)."""

    @property
    def source_name(self) -> str:
        """The name in task uids, metrics and reconfiguration keys: ``name``, else the kind."""
        return self.name or self.kind

    @property
    def reads_dataset(self) -> bool:
        return self.kind in _DATASET_KINDS

    @property
    def task_harness(self) -> str | None:
        """``Task.harness`` of its tasks: a verifiers environment's episodes run on the
        proxy harness (``openai``), the environment driving them as an SDK agent would."""
        return "openai" if self.harness == "verifiers" else self.harness

    @property
    def episodic(self) -> bool:
        """Its tasks are multi-turn episodes (a harness runs them)."""
        return self.harness is not None or self.kind == "tally"

    def episode_setting(self, key: str) -> Any:
        """``environment``, ``agent``, ``tools`` or ``tool_parser`` as the run uses it: the
        source's own, else its kind's (tally's are import paths like a user's)."""
        value = getattr(self, key)
        if value not in (None, ()) or not self.episodic:
            return value
        if self.kind == "tally":
            return TALLY_EPISODES[key]
        return "hermes" if key == "tool_parser" else value

    @property
    def reward_kwarg_columns(self) -> dict[str, str]:
        """Keyword name -> column path of ``reward_kwargs``."""
        return {c.rsplit(".", 1)[-1]: c for c in self.reward_kwargs}

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> SourceConfig:
        self._episode_fields()
        if (self.kind == "reasoning_gym") != (self.reasoning_gym is not None):
            raise ValueError("kind reasoning_gym needs `reasoning_gym` (the generator: dataset, "
                             "size, seed, options)" if self.reasoning_gym is None else
                             f"`reasoning_gym` is read only by kind reasoning_gym; kind "
                             f"{self.kind} does not read it (drop it)")
        if self.reads_dataset and self.path is None:
            raise ValueError(f"kind {self.kind} needs `path` (its dataset)")
        if not self.reads_dataset:
            defaults = SourceConfig.model_fields
            for key in ("path", "columns", "reward_kwargs", "max_in_flight_per_task"):
                if getattr(self, key) != defaults[key].default:
                    raise ValueError(
                        f"`{key}` is read only by a jsonl, parquet or hf_dataset source; kind "
                        f"{self.kind} generates its tasks (drop {key} or use a dataset kind)")
        for col in self.reward_kwargs:
            if not re.fullmatch(_COLUMN_PATH, col):
                raise ValueError(f"reward_kwargs: {col!r} is not a column path (names joined "
                                 "by dots, e.g. extra_info or reward_model.style)")
        names = [c.rsplit(".", 1)[-1] for c in self.reward_kwargs]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise ValueError(f"reward_kwargs {list(self.reward_kwargs)} pass more than one "
                             f"column as keyword {clash}; a keyword is a column's last segment")
        if self.reads_dataset and self.episodic and EPISODE_ROW in names:
            raise ValueError(f"reward_kwargs: keyword {EPISODE_ROW!r} is the whole row of an "
                             "agentic source's task (task.extra['row']); pass another column")
        taken = sorted(set(names) & set(RESPONSE_KWARGS))
        if taken:
            raise ValueError(f"reward_kwargs: keyword {taken} is the response's, which a "
                             "reward receives by declaring it; drop it from reward_kwargs")
        return self

    def _episode_fields(self) -> None:
        """The episode settings fit the harness: each is read by one harness only."""
        if self.harness is not None and not (self.reads_dataset or self.kind == "tally"):
            raise ValueError(f"`harness` is read by dataset kinds and tally; kind {self.kind} "
                             "generates single-turn tasks (drop harness)")
        if not self.episodic:
            for key in ("environment", "environment_kwargs", "agent", "tools", "tool_parser",
                        "openenv"):
                if getattr(self, key) != SourceConfig.model_fields[key].default:
                    raise ValueError(f"`{key}` is read only by a source whose tasks are "
                                     "episodes: set harness (agent, openai or verifiers) or "
                                     "drop it")
            return
        if self.harness == "verifiers":
            self._verifiers_fields()
            return
        harness = self.harness or "agent"
        own, other = ("environment", "agent") if harness == "agent" else ("agent", "environment")
        if getattr(self, other) is not None:
            reader = "openai" if other == "agent" else "agent or verifiers"
            raise ValueError(f"`{other}` is read by harness {reader}; this source's harness is "
                             f"{harness} (drop {other})")
        if self.environment is not None and not re.fullmatch(_IMPORT_PATH, self.environment):
            raise ValueError(f"environment {self.environment!r}: harness agent takes an import "
                             "path module:name (a bare module name is read by harness "
                             "verifiers)")
        if self.environment_kwargs and harness != "agent":
            raise ValueError("`environment_kwargs` is read only with harness: agent or verifiers")
        if self.environment_kwargs and self.environment is None and self.kind != "tally":
            raise ValueError("`environment_kwargs` needs `environment`")
        if self.openenv is not None:
            self._openenv_fields(harness)
        elif self.reads_dataset and getattr(self, own) is None:
            raise ValueError(f"harness {harness} needs `{own}` (an import path module:name)"
                             + (" or `openenv`" if harness == "agent" else ""))

    def _openenv_fields(self, harness: str) -> None:
        """``openenv`` is the environment of a dataset source's agent episodes."""
        if harness != "agent" or not self.reads_dataset:
            raise ValueError(f"`openenv` is read by a dataset source with harness: agent; this "
                             f"one is kind {self.kind}, harness {harness} (drop openenv)")
        for key in ("environment", "environment_kwargs", "reward"):
            if getattr(self, key):
                raise ValueError(f"`{key}` and `openenv` both say what runs (or grades) the "
                                 f"episodes: drop {key}")

    def _verifiers_fields(self) -> None:
        """``harness: verifiers``: a dataset's rows, rolled out and graded by the
        environment, whose own tools run inside its rollout."""
        if not self.reads_dataset:
            raise ValueError(f"harness verifiers is read by dataset kinds (jsonl, parquet, "
                             f"hf_dataset): its rows are the rollouts' inputs; kind {self.kind} "
                             "is not one")
        if self.environment is None:
            raise ValueError("harness verifiers needs `environment` (an import path "
                             "module:name of a vf.Environment or of a function returning one, "
                             "or an installed environment module's name)")
        for key, why in (("agent", "the environment drives its episodes"),
                         ("tools", "the environment runs its own tools"),
                         ("reward", "the environment's rubric grades its episodes"),
                         ("reward_kwargs", "the environment's rubric grades its episodes"),
                         ("openenv", "the verifiers environment runs the episodes")):
            if getattr(self, key) not in (None, ()):
                raise ValueError(f"`{key}` is not read with harness verifiers ({why}); "
                                 f"drop {key}")


class ProxyConfig(Section):
    """Limits of the OpenAI-compatible agent proxy (``agent/proxy.py``): what one call and one
    session may cost it, whatever a harness sends."""

    max_request_bytes: int = Field(8 << 20, ge=1024)
    """Largest request body in bytes: a larger one is answered HTTP 413 before it is read
    whole or parsed."""
    max_session_calls: int = Field(1024, ge=1)
    """Calls one session (one episode's key) may make; later ones are refused (HTTP 400).
    Must exceed ``agent.max_turns``, so that a training episode ends by its turn budget."""
    max_session_history_bytes: int = Field(16 << 20, ge=1024)
    """Bytes of message text one session's samples may hold (what its calls added, counted
    as UTF-8); a call that would pass it is refused (HTTP 400)."""


class SandboxConfig(Section):
    """The run's sandbox pool (``agent/sandbox.py``): where the built-in ``python`` tool, the
    ``code`` reward and any tool that asks for ``sandbox`` run programs. Started at the first
    program; each program runs in a fresh interpreter of a warm sandbox, reset after it."""

    backend: Literal["auto", "bwrap", "unshare"] = "auto"
    """What isolates a sandbox: ``bwrap`` (bubblewrap), ``unshare`` (util-linux; fewer
    guarantees, docs/agents.md), ``auto`` = bwrap when it is on the PATH."""
    size: int = Field(2, ge=1, le=1000)
    """Warm sandboxes: programs running at once (more wait for a free one)."""
    wall_s: float = Field(10.0, gt=0)
    """Wall time of one program."""
    cpu_s: float = Field(5.0, gt=0)
    """CPU time of each of its processes."""
    memory_mb: int = Field(512, gt=0)
    """Memory of a sandbox's processes together (per process where no cgroup is available)."""
    max_procs: int = Field(16, gt=0)
    """Processes and threads of a program, together."""
    file_size_mb: int = Field(16, gt=0)
    """The largest file it may write."""
    disk_mb: int = Field(32, gt=0)
    """What its writable folders may hold together."""
    max_output_bytes: int = Field(65536, gt=0)
    """Bytes of its stdout, and of its stderr, kept; the rest is cut."""
    pass_env: tuple[str, ...] = ()
    """Names of the run's environment variables its programs get (nothing else of it)."""
    allow_net: tuple[str, ...] = ()
    """``IP:PORT`` endpoints its programs may connect to (each at ``127.0.0.1:PORT``
    inside); empty = no network at all."""
    artifacts: str | None = None
    """A folder every sandbox sees read-only at ``/artifacts`` (a test suite, data)."""

    @model_validator(mode="after")
    def _limits_fit(self) -> SandboxConfig:
        if self.file_size_mb > self.disk_mb:
            raise ValueError(f"file_size_mb = {self.file_size_mb} must be <= disk_mb = "
                             f"{self.disk_mb}: no file can be larger than the disk")
        from rollstream.agent.sandbox_net import parse_allow_net  # stdlib only

        parse_allow_net(list(self.allow_net), field="allow_net")
        return self


class AgentConfig(Section):
    max_turns: int = Field(32, ge=1)
    """Model turns of an agent episode (then it ends with ``max_turns``)."""
    max_turn_tokens: int = Field(64, ge=1)
    """Tokens of one model turn (a turn cut by it is closed by the chat template and the
    episode goes on). An episode's tokens in all (model and environment) are capped by
    ``sampling.max_new_tokens``."""
    max_wall_s: float | None = Field(None, gt=0)
    """Wall time of an episode (None = no limit); a turn or tool still running then is
    stopped and the episode ends with ``max_wall``."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Per tool call (the loop's, and those an SDK agent runs through its session): a call
    still running then ends with an error message to the model."""
    max_tool_concurrency: int | None = Field(None, ge=1)
    """Tool calls running at once per agent source, across its episodes (None = no bound)."""
    max_tool_output_chars: int = Field(16384, ge=1)
    """Characters of one tool call's output the model is shown; the rest is cut, with a note
    saying so, before it is tokenized (a program may print far more than a turn's budget)."""
    harness_workers: int = Field(0, ge=0, le=256)
    """Where the agents of ``harness: openai`` sources run: 0 = as coroutines in the run's
    process; N > 0 = in a pool of N long-lived worker processes, started at the first such
    episode and reused, one episode each at a time (so at most N of these episodes run at
    once). A worker that dies, or whose agent runs past ``max_wall_s``, is killed and
    replaced, failing only that episode's sample. Use them for agents that block or use CPU
    (they would stall the engine's process) or that must not share its interpreter."""
    sandbox: SandboxConfig = SandboxConfig()
    """The sandbox pool of the ``python`` tool, the ``code`` reward and tools that ask for
    one."""
    proxy: ProxyConfig = ProxyConfig()
    """Limits of the proxy that ``harness: openai`` agents talk to (also ``rollstream
    proxy``'s)."""

    @model_validator(mode="after")
    def _calls_outlast_turns(self) -> AgentConfig:
        if self.proxy.max_session_calls <= self.max_turns:
            raise ValueError(
                f"agent.proxy.max_session_calls = {self.proxy.max_session_calls} must exceed "
                f"agent.max_turns = {self.max_turns}: a training episode's call after its "
                "last turn is how it learns the turn budget is spent")
        return self


class PassRateConfig(Section):
    """Pass-rate-aware task sampling (docs/data.md): tasks whose recent groups were all
    correct or all wrong are drawn less, down to a floor."""

    enabled: bool = False
    """Track pass rates online and draw tasks by how likely their next group is to have
    reward variance. Per task for a dataset; per difficulty bucket (the number of items) for
    a generated source; a source without buckets is drawn in order."""
    floor: float = Field(0.1, gt=0, le=1)
    """A task's (bucket's) draw weight is the chance its next group has reward variance
    (from a Beta posterior whose prior is fitted to its source), but at least this: whatever
    its groups did, it is drawn at least this share as often as a task sure to train, so
    nothing starves and a change of difficulty is seen."""
    half_life_groups: float = Field(8.0, gt=0)
    """A task's evidence halves every this many of its groups (recent groups count more)."""


class TasksConfig(Section):
    sources: tuple[SourceConfig, ...] = (SourceConfig(),)
    """Task sources, mixed by ``weight`` as ``mix`` says."""
    mix: Literal["quota", "weighted"] = "quota"
    """How the next group's source is chosen. ``quota``: keep the *trained* mixture at the
    weights, whatever each source's length and share of filtered groups (deficit-corrected
    with the rollout's feedback; docs/data.md). ``weighted``: draw a source with probability
    ∝ weight, seeded; the trained mixture drifts toward sources whose groups are filtered
    less."""
    pass_rate: PassRateConfig = PassRateConfig()
    """Pass-rate-aware sampling of the tasks within each source."""
    num_eval: int = Field(64, ge=0)
    """Held-out prompts scored at the start and the end of a run."""
    seed: int = 0
    """Seed of task generation (train and eval streams are disjoint)."""

    @model_validator(mode="after")
    def _fields_read(self) -> TasksConfig:
        default = SourceConfig.model_fields["max_oversample"].default
        for i, src in enumerate(self.sources):
            if self.mix == "weighted" and src.max_oversample != default:
                raise ValueError(f"tasks.sources.{i}.max_oversample = {src.max_oversample:g} "
                                 "is read only by tasks.mix = quota (drop it or use quota)")
        if not self.pass_rate.enabled and self.pass_rate != PassRateConfig():
            raise ValueError("tasks.pass_rate settings are read only with "
                             "tasks.pass_rate.enabled = true (set it or drop them)")
        return self


def lookup(row: Mapping[str, Any], path: str) -> Any:
    """The value at a column's dotted ``path`` (``columns``) of a row's nested mappings;
    ``MISSING`` when a key on the way is absent or a value on the way is not a mapping (a
    null one included)."""
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node
