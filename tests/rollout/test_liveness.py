"""Liveness keeps bounded memory however large ``max_untrainable_streak`` is (``bench soak``
sets 10^6), and its diagnostics count the whole streak."""

from types import SimpleNamespace

from rollstream.config import RolloutConfig
from rollstream.rollout.liveness import Liveness
from rollstream.trajectory import SampleStatus


def _group(i: int, reason: str, status: SampleStatus = SampleStatus.FILTERED) -> SimpleNamespace:
    return SimpleNamespace(group_id=f"g{i}", samples=[
        SimpleNamespace(uid=f"g{i}/{j}", status=status, failure=f"{reason} {i}") for j in range(2)])


def test_memory_stays_bounded_with_a_huge_streak_limit():
    live = Liveness(RolloutConfig(max_untrainable_streak=1_000_000, min_trainable_share=0.0,
                                  trainable_share_window=64))
    for i in range(20_000):
        live.untrainable(_group(i, "zero reward variance"))
        if i % 1000 == 999:
            live.trainable()
        assert live.verdict() is None
    assert len(live._outcomes) <= 64
    assert len(live._streak_counts) <= 1 and len(live._streak_examples) <= 1  # one reason


def test_the_streak_diagnostic_counts_every_group_of_the_streak():
    live = Liveness(RolloutConfig(max_untrainable_streak=5, trainable_share_window=2))
    live.untrainable(_group(0, "old reason"))
    live.trainable()  # ends that streak: its reasons are forgotten
    for i in range(1, 8):
        live.untrainable(_group(i, "bad" if i % 3 else "worse", SampleStatus.FAILED))
    why = live.verdict()
    assert why.startswith("7 groups in a row could not be trained")
    assert "5 x failed: bad N (e.g. g1/0: bad 1)" in why
    assert "2 x failed: worse N (e.g. g3/0: worse 3)" in why
    assert "old reason" not in why
