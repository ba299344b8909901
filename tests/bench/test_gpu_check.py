"""The optional GPU check (``python -m rollstream.bench.gpu_check``) runs whole on CPU at a
tiny shape, each part writing its JSON, and skips a part whose imports are missing, saying
which."""

from __future__ import annotations

import json
from pathlib import Path

from rollstream.bench.gpu_check import SMALL, TINY, Check, main, run_part

KEYS = {
    "engine_vs_hf": ("engine_tok_s", "hf_tok_s", "engine_vs_hf_tok_s"),
    "trainer": ("trainer_tok_s", "shared_prefix_trainer_tok_s",
                "shared_prefix_vs_flat_trainer_step_s"),
    "prefix": ("prefix_cache_vs_none_gen_tok_s", "hit_share"),
    "rollout": ("partial_tok_s", "drain_tok_s", "partial_vs_drain_tok_s"),
    "broadcast": ("broadcast_s", "broadcast_exact"),
}


def test_the_gpu_check_runs_on_cpu_at_a_tiny_shape(tmp_path: Path) -> None:
    summary = main(["--device", "cpu", "--tiny", "--out", str(tmp_path)])
    parts = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(parts) == {"env", "model", *KEYS, "gpu_check"}
    assert parts["gpu_check"] == json.loads(json.dumps(summary))
    for name, part in parts.items():
        if name != "gpu_check":
            assert part["status"] == "ok", (name, part)
            assert part["part_s"] > 0
    for name, keys in KEYS.items():
        for key in keys:
            assert parts[name][key] > 0, (name, key, parts[name][key])
            assert summary["parts"][name][key] == parts[name][key]
    assert parts["env"]["missing"] == [] and parts["env"]["shape"] == TINY
    rollout = parts["rollout"]
    assert rollout["tokens"] > 0 and all(v > 0 for v in rollout["prefilled_tokens"].values())
    assert rollout["updates_done"] == {"partial": 2.0, "drain": 2.0}  # every update came
    assert (parts["broadcast"]["backend"], parts["broadcast"]["broadcast_exact"]) == ("gloo", 1.0)
    assert not list(tmp_path.rglob("*.safetensors"))  # the model folder is not left in --out


def test_a_part_whose_imports_are_missing_is_skipped_with_their_names(tmp_path: Path) -> None:
    check = Check(out=tmp_path, device="cpu", dtype="float32", sizes=SMALL, shape=TINY,
                  deadline=float("inf"))

    def never(_: Check) -> dict:
        raise AssertionError("a part without its imports must not run")

    result = run_part(check, "trainer", ("json", "no_such_module_here"), never)
    assert result["status"] == "skipped"
    assert result["reason"] == "missing imports: no_such_module_here"
    assert json.loads((tmp_path / "trainer.json").read_text()) == result
