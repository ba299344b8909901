"""Bad scenario and profile input gives a clear error naming the field."""

from __future__ import annotations

import pytest

from rollstream.cli import main as cli_main
from rollstream.sim.profile import load_profile
from rollstream.sim.scenario import load_scenario


def _write(tmp_path, text: str):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(("text", "expected"), [
    ("engines: 0\n", "engines = 0: Input should be greater than or equal to 1"),
    ("engine: 4\n", "unknown key 'engine'"),
    ("workload: {sigma_prompt: -1}\n", "workload.sigma_prompt = -1"),
    ("workload: {mean_response_tokens: 9000, max_response_tokens: 4096}\n",
     "mean_response_tokens (9000) must be below max_response_tokens (4096)"),
    ("modes: [{name: a, mode: sync, staleness: {max_staleness: 2}}]\n",
     "modes.0 (a): rollout.staleness.max_staleness = 2 contradicts rollout.mode = sync"),
    ("modes: [{name: a}, {name: a}]\n", "names must be unique"),
    ("modes: [{name: a, mode: async, staleness: {max_staleness: 1, max_token_age: 2}}]\n",
     "modes.0 (a): rollout.staleness.max_token_age = 2 exceeds the staleness bound 1"),
    ("modes: [{name: a, mode: fast}]\n", "modes.0.mode = 'fast'"),
    ("modes: [{name: a, max_staleness: 2}]\n",
     "max_staleness was replaced by staleness.max_staleness"),
    ("- 1\n", "the top level must be a mapping"),
])
def test_bad_scenario_names_the_field(tmp_path, text, expected):
    with pytest.raises(ValueError) as e:
        load_scenario(_write(tmp_path, text))
    assert expected in str(e.value)


def test_cli_reports_a_bad_scenario_without_a_traceback(tmp_path, capsys):
    assert cli_main(["sim", str(_write(tmp_path, "token_block: 0\n"))]) == 2
    assert "token_block = 0" in capsys.readouterr().err


def test_profiles_name_their_sources_and_a_bad_one_names_the_field(tmp_path):
    for name in ("gpu_h100_7b", "cpu_this_machine"):
        assert len(load_profile(name).source) > 40
    bad = tmp_path / "p.yaml"
    bad.write_text((load_profile.__globals__["PROFILES_DIR"] / "gpu_h100_7b.yaml").read_text()
                   .replace("max_num_seqs: 256", "max_num_seqs: 0"))
    with pytest.raises(ValueError, match="max_num_seqs = 0"):
        load_profile(str(bad))
    with pytest.raises(ValueError, match="built-in profiles: cpu_this_machine, gpu_h100_7b"):
        load_profile("tpu")


def test_every_example_scenario_loads_with_its_profile_and_modes():
    from pathlib import Path

    from rollstream.sim.scenario import run_config

    examples = sorted((Path(__file__).resolve().parents[2] / "examples" / "sim").glob("*.yaml"))
    assert len(examples) >= 4
    for path in examples:
        sc = load_scenario(path)
        assert load_profile(sc.profile).max_num_seqs >= 1
        configs = [run_config(sc, m) for m in sc.modes]
        if path.stem == "dispatch_16":
            assert [c.rollout.dispatch for c in configs] == ["engine", "fifo", "longest_first"]
