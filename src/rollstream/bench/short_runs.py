"""Short training runs of one config that differ in a setting or two, one after another in
this process, for a ratio of trained samples per second between them.

Each run is the base YAML with the bench's ``common`` overrides and then its own
(``bench modes``' :func:`~rollstream.bench.modes.row_config`), measured as ``bench modes``
measures a row (:func:`~rollstream.bench.modes.run_config`: trained samples ÷ the training
wall time, model load and evaluations left out). Back to back and once each: a drift in the
shared machine's load lands on one side only, which the JSON's load averages record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def run_back_to_back(config: Path, common: Sequence[str], rows: Mapping[str, Sequence[str]],
                     *, bench: str) -> dict[str, dict[str, Any]]:
    """Run each row (label -> its overrides) in order; label -> its overrides and
    ``run_config``'s reading."""
    from rollstream.bench.modes import row_config, run_config

    out = {}
    for label, extra in rows.items():
        print(f"bench {bench}: training run {label} ...", flush=True)
        cfg = row_config(config, common, [*extra, f"name={label}"])
        out[label] = {"overrides": list(extra), **run_config(cfg)}
    return out


def samples_per_s_ratio(runs: Mapping[str, Mapping[str, Any]], over: str, under: str) -> float:
    """Trained samples/s of run ``over`` ÷ that of run ``under``."""
    return runs[over]["trained_samples_per_s"] / runs[under]["trained_samples_per_s"]
