"""Forward-pass times of the local engine, aggregated by shape: what a cost model is fitted
from (``rollstream.sim.calibrate``, docs/simulator.md "Calibration").

Each pass adds to the bin of its (kind, rows, tokens // TOKEN_BIN, whether a trainer step was
computing meanwhile: ``training``, a callable the run gives, read once per pass): a count, the
seconds and
the tokens summed. A bin's sums are all a linear least-squares fit needs (its mean tokens are
exact, whatever the bin's width), and the number of bins stays bounded however long the run
(at most rows x max tokens / TOKEN_BIN per kind). Kinds: ``decode`` (rows: live sequences,
tokens: their context, the token being decoded included), ``prefill`` (rows: the sequences
admitted in the pass, tokens: their prompts), ``load`` (a weight load: rows in flight, tokens
recomputed). Written by the engine thread only; read when the engine has stopped
(``rollstream train`` writes them to ``engine_passes.jsonl``), or as a copy taken between
steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TOKEN_BIN = 256
KINDS = ("decode", "prefill", "load")


def _never() -> bool:
    return False


class PassTimes:
    def __init__(self, *, training: Callable[[], bool] | None = None) -> None:
        """``training``: whether the trainer computes now (the controller's ``training``
        flag); a pass that ends while it does is binned as one that shared the CPU with it.
        None: never."""
        self.bins: dict[tuple[str, int, int, bool], list[float]] = {}
        self.training: Callable[[], bool] = training if training is not None else _never

    def add(self, kind: str, rows: int, tokens: int, seconds: float,
            training: bool | None = None) -> None:
        """``training``: the flag as read when the pass's compute ended (None: read now). A
        pass that finishes samples reads it before delivering them: a batch they complete
        may start a trainer step before the pass is recorded."""
        key = (kind, rows, tokens // TOKEN_BIN, self.training() if training is None else training)
        b = self.bins.get(key)
        if b is None:
            self.bins[key] = [1, seconds, tokens]
        else:
            b[0] += 1
            b[1] += seconds
            b[2] += tokens

    def lines(self) -> list[dict[str, Any]]:
        """One dict per bin: kind, rows, count, seconds (summed), tokens (summed), and
        ``trainer`` (1: passes during a trainer step)."""
        return [{"kind": k, "rows": r, "count": int(c), "seconds": s, "tokens": int(t),
                 "trainer": int(tr)}
                for (k, r, _, tr), (c, s, t) in sorted(self.bins.items())]
