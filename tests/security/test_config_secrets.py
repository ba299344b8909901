"""Secrets kept out of every config a run writes or serves: config.yaml, a checkpoint's
saved config (which a resume compares), the dashboard's config view (over real HTTP) and the
report."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from rollstream.config import ConfigError, load_config
from rollstream.config.redact import saved_config
from rollstream.config.schema import MonitorConfig, RunConfig
from rollstream.durable import checkpoint as durable
from rollstream.monitor.dashboard import Dashboard
from rollstream.monitor.report import write_report
from rollstream.runtime.build import prepare_run_dir
from rollstream.runtime.train import resume_point
from tests.durable.whole import ROLLOUT, model_saver, save_trainer
from tests.monitor.synth import synth_run

CFG = MonitorConfig(progress=False, dashboard=True)
SECRETS = ("sk-live-0123", "hf_secret_4567", "wandb-89ab", "s3cr3t-pw", "ghp_cdef")


def test_secrets_are_redacted_wherever_a_config_is_written_or_served(tmp_path: Path) -> None:
    # written by a run: a secret flag of the vLLM server, as a pair and as `--flag=value`
    run_dir = tmp_path / "run"
    cfg = RunConfig(engine={"vllm": {"extra_args": ["--api-key", SECRETS[0],
                                                    f"--hf-token={SECRETS[1]}",
                                                    "--max-num-seqs", "8"]}})
    prepare_run_dir(cfg, run_dir)
    written = (run_dir / "config.yaml").read_text()
    assert not [s for s in SECRETS if s in written], written
    args = yaml.safe_load(written)["engine"]["vllm"]["extra_args"]
    assert args == ["--api-key", "<redacted>", "--hf-token=<redacted>", "--max-num-seqs", "8"]

    # a config.yaml written by another tool (or an older version) is redacted when served
    other = tmp_path / "other"
    synth_run(other, num_steps=3)
    tree = yaml.safe_load((other / "config.yaml").read_text())
    tree["env"] = {"WANDB_API_KEY": SECRETS[2], "DB_PASSWORD": SECRETS[3], "LANG": "C.UTF-8"}
    tree["env_list"] = [f"GITHUB_TOKEN={SECRETS[4]}", "PATH=/usr/bin"]
    (other / "config.yaml").write_text(yaml.safe_dump(tree))
    dash = Dashboard(None, other, CFG)
    url = dash.start()
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            served = [http.get("/api/config").text, http.get("/api/poll").text]
    finally:
        dash.stop()
    served.append(write_report(other).read_text())
    for text in served:
        assert not [s for s in SECRETS if s in text]
        assert "WANDB_API_KEY" in text and "C.UTF-8" in text and "/usr/bin" in text


def test_a_checkpoint_keeps_no_secret_and_resumes_the_run_that_has_it(tmp_path: Path,
                                                                       kit_model: Path) -> None:
    """A resume compares the checkpoint's saved config with the run's own, both as a run keeps
    them: the redacted secret is no change, a changed setting beside it still is."""
    flags = ["--api-key", SECRETS[0]]
    cfg = load_config(None, ["name=r", f"run_root={tmp_path}", "resume=true",
                             f"engine.vllm.extra_args={flags}"])
    saved = saved_config(cfg)
    assert SECRETS[0] not in str(saved)
    durable.write(tmp_path / "r", 2, {"config": saved, "rollout": ROLLOUT},
                  save_model=model_saver(kit_model), save_trainer=save_trainer, keep=2)
    assert resume_point(cfg, tmp_path / "r").step == 2
    with pytest.raises(ConfigError, match=r"differs in seed;") as refused:
        resume_point(cfg.model_copy(update={"seed": 7}), tmp_path / "r")
    assert "extra_args" not in str(refused.value)
