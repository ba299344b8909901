"""``rollstream sim --out DIR`` (page, JSON, plots) and ``--study`` (the scaling study)."""

from __future__ import annotations

import json

import pytest

from rollstream.cli import main as cli_main
from rollstream.sim import outputs
from rollstream.sim.study import STUDY_MODES, scaled


def _scenario_file(tmp_path, small, modes):
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(small.model_copy(update={"modes": modes}).model_dump(mode="json")))
    return path


def test_out_writes_the_comparison_page_and_json_across_the_modes(tmp_path, small, monkeypatch):
    """Without matplotlib the page and JSON are still written and the page says why no plot."""
    monkeypatch.setattr(outputs, "have_matplotlib", lambda: False)
    path = _scenario_file(tmp_path, small, small.modes[:3])
    assert cli_main(["sim", str(path), "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "index.html").read_text()
    data = json.loads((tmp_path / "out" / "result.json").read_text())
    assert list(data["rows"]) == ["sync", "k1_partial", "k3_partial"]
    for name, row in data["rows"].items():  # each mode is a row of the table, with its ratio
        assert f"<td>{name}</td>" in page and f"<td>{row['vs_first']:.2f}</td>" in page
    assert "matplotlib is not installed" in page and not list((tmp_path / "out").glob("*.png"))


def test_out_plots_are_pngs_embedded_in_the_page(tmp_path, small):
    pytest.importorskip("matplotlib")
    path = _scenario_file(tmp_path, small, small.modes[:2])
    assert cli_main(["sim", str(path), "--out", str(tmp_path / "out")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert pngs == ["comparison.png", "staleness.png"]
    assert (tmp_path / "out" / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "index.html").read_text().count("data:image/png;base64,") == 2


def test_the_study_scales_groups_and_trainer_with_the_engines_and_writes_its_page(
        tmp_path, small, monkeypatch):
    monkeypatch.setattr(outputs, "have_matplotlib", lambda: False)
    big = scaled(small, 12, 2)
    assert (big.engines, big.groups_per_step, big.trainer_devices, big.steps) == (12, 24, 8, 2)
    assert [m.name for m in big.modes] == [m.name for m in STUDY_MODES]
    path = _scenario_file(tmp_path, small, small.modes[:1])
    assert cli_main(["sim", str(path), "--study", "2,6", "--steps", "2",
                     "--out", str(tmp_path / "st")]) == 0
    study = json.loads((tmp_path / "st" / "study.json").read_text())
    assert [p["engines"] for p in study["points"]] == [2, 6]
    for p in study["points"]:
        rows = p["rows"]
        assert p["async_speedup"] == pytest.approx(rows["async_k2_drain"]["trained_tok_s"]
                                                   / rows["sync"]["trained_tok_s"])
        assert p["partial_speedup"] == pytest.approx(rows["async_k2_partial"]["trained_tok_s"]
                                                     / rows["sync"]["trained_tok_s"])
        assert p["tail_share"] == rows["sync"]["tail_share_mean"]
        for row in rows.values():  # what each mode's samples became
            assert row["statuses"].get("trained", 0) == sum(row["staleness_hist"].values()) > 0
        assert rows["async_k2_partial"]["interrupts"] > 0 == rows["sync"]["interrupts"]
    page = (tmp_path / "st" / "index.html").read_text()
    assert "AReaL" in page and "Seer" in page and "<td>6</td>" in page


def test_study_arguments_are_checked(tmp_path, small, capsys):
    path = _scenario_file(tmp_path, small, small.modes[:1])
    assert cli_main(["sim", str(path), "--study", "8,x"]) == 2
    assert cli_main(["sim", str(path), "--steps", "3"]) == 2
    assert "--steps is an option of --study" in capsys.readouterr().err
