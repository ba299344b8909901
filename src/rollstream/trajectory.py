"""The trajectory data model: Task -> Group -> Sample -> Segment -> per-token fields.

One source of truth for what flows from the data sources through the engines, the graders
and the trainer (DESIGN.md, "Data model"). Everything here is plain Python (no torch), so the
scheduler, the simulator and the config stay light.

Invariants checked at construction:
  * every per-token list of a Segment has ``len(token_ids)`` entries;
  * ``policy`` segments carry a real policy version on every token (>= 0); ``env`` segments
    (tokens the environment inserted: tool output, the next user turn) carry version -1 and a
    zero loss mask, because nothing sampled them;
  * ids are stable strings: ``task_uid`` (source + seed + index), ``group_id``
    (``{task_uid}#g{k}``) and ``sample_uid`` (``{group_id}/{sample_idx}``).

An agent episode whose chat template rewrote earlier turns carries ``Sample.contexts``: where
the model was served the conversation rendered anew instead of the tokens so far. It is still
one sample (one reward, advantage and ledger line), served and trained as its turn-samples
(:func:`turn_samples`); its segments hold only the tokens sampled or appended, so every
per-token view below is its response as the loss sees it.

Lifecycle: a Sample moves PENDING -> RUNNING (-> INTERRUPTED -> RUNNING)* -> GENERATED ->
GRADED and then reaches exactly one terminal status: TRAINED, FILTERED, DROPPED_STALE,
FAILED, EVALUATED (held-out samples that are scored, never trained) or ABORTED (the run
stopped before the sample could be used). Statuses change only through
``rollout.lifecycle.Lifecycle.move``, which checks each transition and writes terminal ones to
the ledger exactly once.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    INTERRUPTED = "interrupted"  # partial tokens kept, waiting to resume
    GENERATED = "generated"  # engine done, reward not yet known
    GRADED = "graded"  # reward known, waiting for the trainer
    # terminal
    TRAINED = "trained"
    FILTERED = "filtered"  # e.g. a group with zero reward variance
    DROPPED_STALE = "dropped_stale"  # would exceed max_staleness
    FAILED = "failed"  # engine error, reward error, bad data: see Sample.failure
    EVALUATED = "evaluated"  # held-out evaluation sample
    ABORTED = "aborted"  # the run stopped before the sample could be used

    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset(
    {
        SampleStatus.TRAINED,
        SampleStatus.FILTERED,
        SampleStatus.DROPPED_STALE,
        SampleStatus.FAILED,
        SampleStatus.EVALUATED,
        SampleStatus.ABORTED,
    }
)


class SegmentKind(str, enum.Enum):
    POLICY = "policy"  # sampled by the policy: trained on
    ENV = "env"  # inserted by the environment / tools: never trained on


@dataclass(slots=True, kw_only=True, frozen=True)
class ToolCall:
    """One tool call requested by the model."""

    id: str  # "call_<i>", i = the block's index within the turn (malformed blocks count too)
    name: str
    arguments: dict[str, Any]


@dataclass(slots=True, kw_only=True, frozen=True)
class ToolResult:
    """Outcome of one call: ``ok`` exactly when ``error`` is None."""

    call: ToolCall
    content: str  # what the model reads: the tool's output, or "error: <error>"
    ok: bool
    error: str | None
    duration_s: float  # from the moment the call had a concurrency slot (the event loop's clock)

    def __post_init__(self) -> None:
        assert self.ok == (self.error is None), (self.ok, self.error)


@dataclass(slots=True, kw_only=True)
class Turn:
    """One turn of a multi-turn episode, beside its segment (``Sample.turns[i]`` describes
    ``Sample.segments[i]``): who produced its tokens, when, and the tool calls it answered."""

    kind: SegmentKind  # POLICY: the model; ENV: the environment and its tools
    num_tokens: int
    started_s: float  # since the episode started (its current process, after a resume)
    duration_s: float
    finish_reason: str | None = None  # model turns: "stop" | "length" | "abort" | "error"
    num_interrupts: int = 0  # model turns: continuations after engine interrupts
    tool_calls: list[ToolCall] = field(default_factory=list)  # env turns: the calls answered
    tool_results: list[ToolResult] = field(default_factory=list)


@dataclass(slots=True, kw_only=True, frozen=True)
class EnvSnapshot:
    """Where an episode's environment stood at a turn boundary (an environment that can
    snapshot its state, ``agent.environment.Snapshottable``): after the first
    ``num_segments`` segments, its own ``state`` (what its ``snapshot()`` returned) and the
    conversation's messages then (what the chat template renders the next turns after). A
    resumed episode restores it instead of replaying its turns. Replaced at each boundary,
    never changed (its dicts are its own)."""

    num_segments: int
    state: dict[str, Any]  # a JSON object
    messages: list[dict[str, Any]]  # chat messages, as the template renders them


@dataclass(slots=True, kw_only=True, frozen=True)
class Context:
    """Where a chat template rewrote an episode's earlier turns (a thinking model's template
    that drops past ``<think>`` blocks): from segment ``num_segments`` on, the model was served
    ``token_ids``, the whole conversation as the template rendered it then (generation prompt
    included), in place of the prompt and the segments before. The episode is trained as one
    turn-sample per context (:func:`turn_samples`), replaying ``routing`` under
    ``train.routing_replay``: a mixture-of-experts model's routing, of the last request served
    from this context (its prompt was the context and what followed it in the turn-sample)."""

    num_segments: int  # the first segment served after it: a model turn's
    token_ids: tuple[int, ...]
    routing: Routing | None = None

    def __post_init__(self) -> None:
        if self.num_segments < 1 or not self.token_ids:
            raise ValueError(f"Context needs num_segments >= 1 and tokens, got "
                             f"{self.num_segments} and {len(self.token_ids)} tokens")


@dataclass(slots=True, kw_only=True, frozen=True)
class TurnSample:
    """One turn-sample of an episode: what the model was served as its context
    (``prompt_ids``), then the segments ``first`` to ``end`` (exclusive) that followed it."""

    prompt_ids: tuple[int, ...]
    first: int
    end: int


def turn_samples(prompt_ids: tuple[int, ...] | list[int], num_segments: int,
                 contexts: list[Context]) -> list[TurnSample]:
    """An episode as the model was served it: the prompt and the segments up to the first
    context, then each context and the segments after it up to the next (one turn-sample for
    an episode that was never split)."""
    starts = [0, *(c.num_segments for c in contexts)]
    if starts != sorted(set(starts)) or starts[-1] > num_segments:
        raise ValueError(f"contexts must start at increasing segments within the episode's "
                         f"{num_segments}, got {starts[1:]}")
    prompts = [tuple(prompt_ids), *(c.token_ids for c in contexts)]
    ends = [*starts[1:], num_segments]
    return [TurnSample(prompt_ids=p, first=a, end=b) for p, a, b in zip(prompts, starts, ends)]


SINGLE_TURN = "single_turn"  # Task.harness of a one-request task (prompt -> response)
# what of a finished sample's response a reward receives by declaring a keyword of that name
# (rollstream.reward.registry.Response; no dataset column may take these names)
RESPONSE_KWARGS = ("finish_reason", "token_ids", "episode")


@dataclass(slots=True, kw_only=True, frozen=True)
class Task:
    """A prompt and what its reward needs."""

    uid: str
    source: str
    prompt_ids: tuple[int, ...]
    prompt_text: str
    reference: str  # the answer its reward checks against
    harness: str = SINGLE_TURN  # what runs its samples: one engine request, or an agent loop
    # dataset columns its reward receives as keyword arguments (SourceConfig.reward_kwargs):
    # keyword -> JSON value; read-only by convention (a frozen Task is never hashed by it)
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not self.uid:
            raise ValueError("Task.uid must be a non-empty string")
        if not self.prompt_ids:
            raise ValueError(f"task {self.uid}: prompt_ids is empty")


@dataclass(slots=True, kw_only=True, frozen=True)
class Routing:
    """The experts each mixture-of-experts layer routed each token of a sequence to, as the
    engine last computed them (routing replay, ``train.routing_replay``): ``experts`` is a
    C-order ``[num_tokens, num_layers, top_k]`` array of expert ids, one byte each (two,
    little-endian, with ``wide``: models of 255 experts or more), ``NONE`` (the type's largest
    value) where a token was not computed: a sequence's last token, which no forward pass of
    the engine took as input. Bytes, not lists: a 1k-token sample of a 24-layer top-8 model
    holds 196k ids."""

    num_layers: int  # layers with experts, in model order
    top_k: int
    experts: bytes
    wide: bool = False

    def __post_init__(self) -> None:
        per_token = self.num_layers * self.top_k * (2 if self.wide else 1)
        if self.num_layers < 1 or self.top_k < 1 or len(self.experts) % per_token:
            raise ValueError(f"Routing needs num_layers, top_k >= 1 and whole tokens of "
                             f"{per_token} bytes, got {self.num_layers}, {self.top_k} and "
                             f"{len(self.experts)} bytes")

    @property
    def none(self) -> int:
        """The id that marks a token not computed."""
        return 0xFFFF if self.wide else 0xFF

    @property
    def num_tokens(self) -> int:
        return len(self.experts) // (self.num_layers * self.top_k * (2 if self.wide else 1))


@dataclass(slots=True, kw_only=True)
class Segment:
    """A run of consecutive response tokens from one producer."""

    kind: SegmentKind
    token_ids: list[int]  # [T]
    logprobs: list[float]  # [T] behaviour-policy logprob; 0.0 for env tokens
    versions: list[int]  # [T] policy version that sampled the token; -1 for env tokens
    loss_mask: list[bool]  # [T]

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n or len(self.loss_mask) != n:
            for name in ("logprobs", "versions", "loss_mask"):
                if len(getattr(self, name)) != n:
                    raise ValueError(f"Segment.{name} has {len(getattr(self, name))} entries, "
                                     f"token_ids has {n}")
        # min / count rather than a generator: a segment is built per request (the simulator
        # builds ~10^5 a minute)
        if self.kind is SegmentKind.POLICY:
            if min(self.versions, default=0) < 0:
                raise ValueError("policy tokens need a policy version >= 0")
        elif self.versions.count(-1) != n or any(self.loss_mask):
            raise ValueError("env tokens carry version -1 and loss_mask False")

    @classmethod
    def env(cls, token_ids: list[int]) -> Segment:
        n = len(token_ids)
        return cls(
            kind=SegmentKind.ENV,
            token_ids=list(token_ids),
            logprobs=[0.0] * n,
            versions=[-1] * n,
            loss_mask=[False] * n,
        )

    def __len__(self) -> int:
        return len(self.token_ids)


def group_id_of(task_uid: str, k: int = 0) -> str:
    """Training group ids: ``k`` is the admission index (a task drawn again gets a new id)."""
    return f"{task_uid}#g{k}"


EVAL_TAG = "#eval"


def eval_group_id(task_uid: str, round_index: int) -> str:
    """Held-out groups live in their own namespace, apart from every training group id."""
    return f"{task_uid}{EVAL_TAG}{round_index}"


def is_eval_uid(sample_or_group_uid: str) -> bool:
    return EVAL_TAG in sample_or_group_uid


@dataclass(slots=True, kw_only=True)
class Sample:
    """One trajectory of one task."""

    task: Task
    group_id: str
    sample_idx: int
    segments: list[Segment] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    reward: float | None = None
    finish_reason: str | None = None  # "stop" | "length" once generated; an episode: its
    # end ("done", "max_turns", "max_tokens", "max_wall": agent.loop.EpisodeEnd)
    failure: str | None = None  # why it FAILED / was FILTERED / DROPPED_STALE
    engine_id: str | None = None
    num_interrupts: int = 0
    trained_at_step: int | None = None
    min_trained_version: int | None = None  # oldest version among the tokens the loss kept
    num_trained_tokens: int | None = None  # tokens the loss kept (the trainer says: KeptTokens)
    trained_version_sum: int | None = None  # Σ of their versions (KeptTokens.version_sum)
    taken_at_step: int | None = None  # the trainer step whose batch held it (any outcome)
    num_restored_tokens: int = 0  # partial tokens it continued from after a restart (resume)
    turns: list[Turn] = field(default_factory=list)  # multi-turn episodes: one per segment
    env_snapshot: EnvSnapshot | None = None  # an episode's environment, at its last boundary
    # where the chat template rewrote the episode's earlier turns ([]: append-only), so that
    # it is served and trained as turn-samples (Context, turn_samples)
    contexts: list[Context] = field(default_factory=list)
    # the sampling temperature of its tokens, fixed at its first dispatch (None: not yet, or
    # not dispatched by a rollout); the trainer takes logprobs at the same temperature, so a
    # temperature reconfigured mid-run does not change the behaviour policy of older samples
    temperature: float | None = None
    # mixture-of-experts models: the experts every token of prompt + response was routed to,
    # as the engine last computed them (its latest request's output: a resumed request
    # recomputes the whole sequence); None: not recorded (a dense model, an engine that does
    # not record, an episode served as turn-samples)
    routing: Routing | None = None
    # an agent episode's record for its source's reward (the ``episode`` keyword): the JSON
    # object its agent returned (a verifiers rollout's state), kept until it is graded
    episode_record: dict[str, Any] | None = None
    # ``{group_id}/{sample_idx}``, built once: the dispatcher, ledger and predictor key by it
    # many times per request (group_id and sample_idx are fixed at construction)
    uid: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.uid = f"{self.group_id}/{self.sample_idx}"

    # --- concatenated per-token views (response only; the prompt is task.prompt_ids) ---
    # (chain: concatenated in C, not a Python loop per token)
    @property
    def response_ids(self) -> list[int]:
        return list(chain.from_iterable(s.token_ids for s in self.segments))

    @property
    def logprobs(self) -> list[float]:
        return list(chain.from_iterable(s.logprobs for s in self.segments))

    @property
    def versions(self) -> list[int]:
        return list(chain.from_iterable(s.versions for s in self.segments))

    @property
    def loss_mask(self) -> list[bool]:
        return list(chain.from_iterable(s.loss_mask for s in self.segments))

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def served_ids(self) -> list[int]:
        """What the model is served for its next tokens: the prompt and the response, or,
        after the template rewrote earlier turns, the last context and the segments since."""
        return served_ids(self.task.prompt_ids, self.segments, self.contexts)

    def turn_samples(self) -> list[TurnSample]:
        return turn_samples(self.task.prompt_ids, len(self.segments), self.contexts)

    def answer(self) -> tuple[list[int], str | None]:
        """What a reward reads, and how it ended: the whole response of a single-turn sample
        (``finish_reason``); the last model turn of an episode (that turn's finish reason)."""
        if not self.turns:
            return self.response_ids, self.finish_reason
        i = max((i for i, t in enumerate(self.turns) if t.kind is SegmentKind.POLICY),
                default=None)
        if i is None:
            return [], None
        return list(self.segments[i].token_ids), self.turns[i].finish_reason

    # per segment (min/max in C), not per token, and a plain loop, not a generator (most
    # samples have one segment): the simulator asks for every sample of every buffered group
    # at each step, at ~150 tokens a sample, and the ledger asks once per sample
    def min_version(self) -> int | None:
        """Oldest policy version among the sampled tokens (None: no sampled token yet)."""
        low = None
        for seg in self.segments:
            if seg.kind is SegmentKind.POLICY and seg.versions:
                v = min(seg.versions)
                if low is None or v < low:
                    low = v
        return low

    def max_version(self) -> int | None:
        """Newest policy version among the sampled tokens (None: no sampled token yet)."""
        high = None
        for seg in self.segments:
            if seg.kind is SegmentKind.POLICY and seg.versions:
                v = max(seg.versions)
                if high is None or v > high:
                    high = v
        return high

    def append_policy_tokens(
        self, token_ids: list[int], logprobs: list[float], versions: list[int],
        routing: Routing | None = None,
    ) -> None:
        """Append engine output, merging into the last policy segment (token-exact TITO);
        ``routing`` (of the request's prompt + output) replaces that of the turn-sample the
        request served: the sample's (prompt + response) while no context rewrote earlier
        turns, else its last context's."""
        append_policy_tokens(self.segments, token_ids, logprobs, versions)
        if routing is not None and self.contexts:
            self.contexts[-1] = replace(self.contexts[-1], routing=routing)
        elif routing is not None:
            self.routing = routing


def append_policy_tokens(segments: list[Segment], token_ids: list[int], logprobs: list[float],
                         versions: list[int]) -> None:
    """Append engine output to ``segments``, merging into a last policy segment (the tokens of
    one request continued after an interrupt stay one run)."""
    if not token_ids:
        return
    seg = Segment(kind=SegmentKind.POLICY, token_ids=list(token_ids), logprobs=list(logprobs),
                  versions=list(versions), loss_mask=[True] * len(token_ids))
    last = segments[-1] if segments else None
    if last is not None and last.kind is SegmentKind.POLICY:
        last.token_ids.extend(seg.token_ids)
        last.logprobs.extend(seg.logprobs)
        last.versions.extend(seg.versions)
        last.loss_mask.extend(seg.loss_mask)
    else:
        segments.append(seg)


def served_ids(prompt_ids: tuple[int, ...] | list[int], segments: list[Segment],
               contexts: list[Context]) -> list[int]:
    """The context of an episode's next request (``Sample.served_ids``)."""
    last = contexts[-1] if contexts else None
    head = list(prompt_ids) if last is None else list(last.token_ids)
    tail = segments if last is None else segments[last.num_segments:]
    return head + list(chain.from_iterable(s.token_ids for s in tail))


@dataclass(slots=True, kw_only=True)
class Group:
    """n samples of one task, graded together (the GRPO baseline)."""

    group_id: str
    task: Task
    samples: list[Sample]

    def __post_init__(self) -> None:
        idx = [s.sample_idx for s in self.samples]
        if idx != list(range(len(idx))):
            raise ValueError(f"group {self.group_id}: sample_idx must be 0..n-1, got {idx}")
        for s in self.samples:
            if s.group_id != self.group_id or s.task is not self.task:
                raise ValueError(f"group {self.group_id}: sample {s.uid} belongs elsewhere")

    @classmethod
    def new(cls, task: Task, size: int, k: int = 0, *, group_id: str | None = None) -> Group:
        """``size`` fresh samples of ``task``; id ``group_id_of(task.uid, k)`` unless given."""
        if size < 1:
            raise ValueError(f"group size must be >= 1, got {size}")
        gid = group_id or group_id_of(task.uid, k)
        return cls(
            group_id=gid,
            task=task,
            samples=[Sample(task=task, group_id=gid, sample_idx=i) for i in range(size)],
        )

    def min_version(self) -> int | None:
        """Oldest policy version among every sampled token of the group (None: no token)."""
        vs = [v for s in self.samples if (v := s.min_version()) is not None]
        return min(vs, default=None)

    def baseline_rewards(self, failed_reward: float | None) -> list[tuple[Sample, float]]:
        """(sample, reward) pairs that form the group's baseline: graded samples, plus FAILED
        ones scored ``failed_reward`` when it is not None (``train.failed_reward: zero``).
        The zero-variance filter and the advantages both use this, so they agree."""
        out = []
        for s in self.samples:
            if s.reward is not None:
                out.append((s, s.reward))
            elif failed_reward is not None and s.status is SampleStatus.FAILED:
                out.append((s, failed_reward))
        return out


@dataclass(slots=True, kw_only=True, frozen=True)
class KeptTokens:
    """What a trainer step's loss kept of one sample (loss mask, token age, truncated support, masked IS)."""

    num_tokens: int
    min_version: int | None  # oldest version among the kept tokens (None when none kept)
    # Σ of the kept tokens' versions: their token-weighted mean age at step s is
    # s − version_sum / num_tokens (exact where a sample's tokens span versions)
    version_sum: int = 0
    reason: str | None = None  # why nothing was kept, when num_tokens == 0


@dataclass(slots=True, kw_only=True)
class StepResult:
    """One trainer step: its metrics, and per sample uid what the loss kept."""

    metrics: dict[str, float]
    kept: dict[str, KeptTokens]
