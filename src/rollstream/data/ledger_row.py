"""One ledger line, typed: :class:`LedgerRow`, the one definition every writer and reader of
``ledger.jsonl`` uses (the ledger, the resume and the audit, the run log, the simulator's
replay and calibration, the benchmarks).

msgspec at the file edge: a line decodes straight into the struct, its types checked, faster
than ``json.loads`` into a dict. Lines are versioned by ``format`` (:data:`FORMAT`); a line
without it is format 1 (written before the field), and fields added since read at their
defaults, so old ledgers still read. Keys a reader does not know are ignored.

Written only when set: ``turn_samples`` (an episode whose chat template rewrote earlier
turns, trained as turn-samples: one row per turn-sample, ``data.ledger.turn_sample_rows``) and
``token_extras`` (per-token values recorded beside the response tokens, one list per name,
e.g. an MoE router's choices). Neither changes the format: a reader that does not know them
ignores them.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from rollstream.trajectory import SampleStatus

FORMAT = 2  # 1: lines written before the field existed


class PolicyTurn(msgspec.Struct, kw_only=True, tag="policy", tag_field="kind"):
    """A model turn of an agent episode: its tokens (the end-of-turn token included) and
    seconds from its first request to its last token (queueing and interrupts included)."""

    num_tokens: int
    started_s: float = 0.0  # from the episode's start
    duration_s: float = 0.0
    finish_reason: str | None = None
    num_interrupts: int = 0
    num_tool_calls: int = 0  # an SDK agent's, after this turn (format 1 lines: 0)


class EnvTurn(msgspec.Struct, kw_only=True, tag="env", tag_field="kind"):
    """The environment's answer in an agent episode: the tokens it appended; ``tool_s`` the
    longest of its tool calls (they run concurrently: what the episode waited on tools)."""

    num_tokens: int
    tool_s: float  # what a replay of the episode waits (sim/replay.py)
    started_s: float = 0.0
    duration_s: float = 0.0
    num_tool_calls: int = 0


TurnRow = PolicyTurn | EnvTurn


class LedgerRow(msgspec.Struct, kw_only=True):
    """A sample's terminal record (docs/run-dir.md, "Ledger line")."""

    format: int = 1
    sample_uid: str
    task_uid: str
    source: str
    status: SampleStatus
    reason: str | None = None
    reward: float | None = None
    num_tokens: int = 0  # response tokens
    prompt_tokens: int | None = None
    min_version: int | None = None
    max_version: int | None = None
    num_interrupts: int = 0
    finish_reason: str | None = None
    num_turns: int = 0  # an agent episode's model turns
    turns: list[TurnRow] = msgspec.field(default_factory=list)
    trained_at_step: int | None = None
    min_trained_version: int | None = None  # of the tokens the loss kept
    num_trained_tokens: int | None = None
    trained_version_sum: int | None = None  # Σ of the kept tokens' versions (older lines: None)
    taken_at_step: int | None = None  # the step whose batch held it
    restored_tokens: int = 0  # partial tokens it continued from after a resume
    t_s: float | None = None
    # Written only when set (UNSET: not in the line). ledger.superseded.jsonl: the step of
    # the resume that moved the line there.
    superseded_at_resume_step: int | UnsetType = UNSET
    # an episode split where its template rewrote earlier turns: one row per turn-sample
    turn_samples: list[LedgerRow] | UnsetType = UNSET
    # name -> one value per response token (len num_tokens)
    token_extras: dict[str, list[float]] | UnsetType = UNSET

    def __post_init__(self) -> None:
        extras = self.token_extras if self.token_extras is not UNSET else {}
        for name, values in extras.items():
            if len(values) != self.num_tokens:
                raise ValueError(f"ledger row {self.sample_uid}: token_extras[{name!r}] has "
                                 f"{len(values)} values for {self.num_tokens} tokens")

    @property
    def trained_version(self) -> int | None:
        """The weight version of the oldest token the loss kept, which staleness is counted
        from (a format 1 line may predate ``min_trained_version``: its ``min_version``)."""
        if self.min_trained_version is None and self.format == 1:
            return self.min_version
        return self.min_trained_version

    @property
    def is_dataset_row(self) -> bool:
        """A dataset row that could not become a task (``<task_uid>#row``), not a sample."""
        return self.sample_uid.endswith("#row")


_decode = msgspec.json.Decoder(LedgerRow).decode
_encoder = msgspec.json.Encoder()


def decode_row(raw: bytes | str) -> LedgerRow:
    """One line's row; ValueError saying why it is not one (not JSON, or a field's type)."""
    try:
        return _decode(raw)
    except msgspec.ValidationError as e:
        raise ValueError(f"not a ledger row ({e})") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"not JSON ({e})") from None


def encode_row(row: LedgerRow) -> bytes:
    """``row`` as one line, newline included."""
    return _encoder.encode(row) + b"\n"
