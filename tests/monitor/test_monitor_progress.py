"""Terminal progress: plain lines off a terminal, a rich bar on one."""

from __future__ import annotations

import io

import pytest

from rollstream.config.schema import MonitorConfig
from rollstream.monitor.progress import Progress, format_duration


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    p = Progress(MonitorConfig(), 4, file=out)
    assert not p.live
    p.update(0, {"reward_mean": 0.25, "gen_tok_s": 1234.5, "staleness_mean": 0.5,
                 "staleness_max": 2, "loss": 0.1})
    p.update(0, {"reward_mean": 0.3})  # same step: no second line
    p.update(1, {"reward_mean": 0.5, "gen_tok_s": None})
    p.update(3, {})
    p.close()
    rows = out.getvalue().splitlines()
    assert len(rows) == 3
    assert rows[0].startswith("step 1/4 | reward 0.250 | 1,234 tok/s | staleness 0.50 (max 2)")
    assert rows[1].startswith("step 2/4 | reward 0.500 | 1,234 tok/s")
    assert rows[2].startswith("step 4/4") and rows[2].endswith("eta 0s")
    assert "\x1b" not in out.getvalue()


def test_progress_off_prints_plain_lines_even_on_a_terminal() -> None:
    out = FakeTty()
    p = Progress(MonitorConfig(progress=False), 2, file=out)
    assert not p.live
    p.update(0, {"reward": 0.1})
    p.close()
    assert out.getvalue().startswith("step 1/2 | reward 0.100 | - tok/s | staleness - | eta ")


def test_rich_bar_on_a_terminal() -> None:
    out = FakeTty()
    with Progress(MonitorConfig(), 10, file=out) as p:
        assert p.live
        p.update(4, {"reward_mean": 0.75, "gen_tok_s": 900.0, "staleness_mean": 1.25})
    text = out.getvalue()
    assert "5/10" in text and "0.750" in text and "900" in text and "1.25" in text


def test_eta_and_durations() -> None:
    assert format_duration(None) == "?"
    assert format_duration(42.4) == "42s"
    assert format_duration(200) == "3m20s"
    assert format_duration(3725) == "1h02m"
    p = Progress(MonitorConfig(), 10, file=io.StringIO(), start_step=5)
    assert p.eta_s() is None
    p._t0 -= 10.0  # pretend 10 s passed
    p.update(6, {})  # 2 steps done since start at 10 s -> 5 s/step, 3 left
    assert p.eta_s() == pytest.approx(15.0, rel=0.05)
    with pytest.raises(ValueError):
        Progress(MonitorConfig(), 0)
