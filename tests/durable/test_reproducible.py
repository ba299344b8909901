"""A resumed run continues the run it resumes, token for token: every sample draws from its
own random stream (run seed, sample uid), so no engine RNG state needs saving, and the
trainer's RNG and optimizer are in the checkpoint. In sync mode nothing depends on timing,
so a run stopped at step 2 and resumed to step 4 in a fresh process writes the ledger and
the weights of a run that never stopped. A temperature reconfigured at step 1 (before the
checkpoint) is in force after the resume too: the checkpoint holds the changes applied. A
LoRA run resumes the same way from its adapter checkpoint (the engines load the base, then
the adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollstream.bench.tiny_run import tiny_run_config
from rollstream.data.ledger import read_ledger
from tests import warm

pytestmark = pytest.mark.slow


def _config(root: Path, name: str, steps: int, cache: Path, seed: int = 0,
            lora: dict | None = None) -> Path:
    cfg = tiny_run_config(name, root / "runs", steps=steps, checkpoint_every=2,
                          cache_dir=cache, rollout={"mode": "sync"})
    if lora is not None:
        cfg["model"]["lora"] = lora
        cfg["train"]["lr"] = 3e-3
    cfg["rollout"].pop("staleness")  # sync mode has no bound to set
    cfg["seed"] = seed
    cfg["reconfigure"] = {"schedule": [{"at_step": 1, "set": {"sampling.temperature": 0.8}}]}
    path = root / f"{name}-{steps}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _train(config: Path, *extra: str) -> None:
    proc = warm.run(["-m", "rollstream", "train", str(config), *extra], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _samples(run_dir: Path) -> dict[str, tuple]:
    lines = read_ledger(run_dir / "ledger.jsonl")
    out = {r.sample_uid: (r.status, r.num_tokens, r.reward, r.trained_at_step)
           for r in lines}
    assert len(out) == len(lines), "one line per sample"
    return out


def _weights(run_dir: Path, file: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoint" / file)


def test_a_resumed_run_samples_and_trains_as_the_run_that_never_stopped(
        tmp_path: Path, tiny_run_cache: Path) -> None:
    _train(_config(tmp_path, "whole", 4, tiny_run_cache))
    _train(_config(tmp_path, "resumed", 2, tiny_run_cache))
    _train(_config(tmp_path, "resumed", 4, tiny_run_cache), "--resume")
    _train(_config(tmp_path, "other-seed", 4, tiny_run_cache, seed=1))
    runs = tmp_path / "runs"
    whole, resumed = _samples(runs / "whole"), _samples(runs / "resumed")
    assert sum(s[3] is not None for s in whole.values()) == 4 * 4 * 8  # trained samples
    differ = [uid for uid in whole if whole[uid] != resumed.get(uid)]
    assert not differ and whole.keys() == resumed.keys(), differ[:5]
    for run in ("whole", "resumed"):  # applied once, recorded once, by the process before
        log = (runs / run / "reconfig.jsonl").read_text().splitlines()
        assert [json.loads(x)["changes"] for x in log] == [
            [{"key": "sampling.temperature", "old": 1.0, "new": 0.8}]]
    a, b = _weights(runs / "whole"), _weights(runs / "resumed")
    for name, w in a.items():
        torch.testing.assert_close(b[name], w, rtol=0, atol=1e-5)
    # the comparison can fail: another run seed samples other tokens
    other = _samples(runs / "other-seed")
    assert sum(other[uid] != whole[uid] for uid in whole) >= 10
    c = _weights(runs / "other-seed")
    assert max((c[name] - w).abs().max().item() for name, w in a.items()) > 1e-4


def test_a_resumed_lora_run_samples_and_trains_as_the_run_that_never_stopped(
        tmp_path: Path, tiny_run_cache: Path) -> None:
    lora = {"rank": 4, "alpha": 8}
    _train(_config(tmp_path, "whole", 4, tiny_run_cache, lora=lora))
    _train(_config(tmp_path, "resumed", 2, tiny_run_cache, lora=lora))
    _train(_config(tmp_path, "resumed", 4, tiny_run_cache, lora=lora), "--resume")
    runs = tmp_path / "runs"
    whole, resumed = _samples(runs / "whole"), _samples(runs / "resumed")
    assert sum(s[3] is not None for s in whole.values()) == 4 * 4 * 8
    differ = [uid for uid in whole if whole[uid] != resumed.get(uid)]
    assert not differ and whole.keys() == resumed.keys(), differ[:5]
    a = _weights(runs / "whole", "adapter_model.safetensors")
    b = _weights(runs / "resumed", "adapter_model.safetensors")
    assert a and a.keys() == b.keys() and all("lora_" in name for name in a)
    assert max(w.abs().max().item() for name, w in a.items() if "lora_B" in name) > 1e-4
    # atol 1e-4, a thirtieth of the adapter's lr (3e-3, ten times the full model's): a CI-as-run
    # of the whole suite (2026-12-07) once saw 8 of 256 elements of an adapter matrix part by
    # up to 2.5e-5 with every sample equal (float noise that Adam's normalised step carries to
    # elements whose gradient is near 0), while a step trained otherwise moves an element by
    # up to about the lr (Adam's step size)
    for name, w in a.items():
        torch.testing.assert_close(b[name], w, rtol=0, atol=1e-4)
