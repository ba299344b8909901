"""A live run's RunLog keeps a window of metric lines and spans; the report keeps all."""


def test_a_windowed_runlog_stays_bounded_and_keeps_global_cursors():
    """A live run's RunLog holds at most N metric lines and spans (flat memory over a long
    run): the newest whole, older ones thinned (a whole-run chart still has points from the
    start); cursors index the whole stream."""
    from rollstream.monitor.runlog import RunLog

    log = RunLog(window=8)
    for i in range(100):
        log.add_record({"kind": "train", "step": i})
        log.add_span({"sample_uid": f"s{i}"})
        assert len(log.records(0)[0]) < 8
    recs, nxt = log.records(0)
    steps = [r["step"] for r in recs]
    assert nxt == 100 and steps == sorted(steps) and steps[-1] == 99
    assert steps[0] < 50, "the thinned history still reaches back"
    assert [r["step"] for r in log.records(97)[0]] == [97, 98, 99]  # the newest are whole
    assert log.records(100) == ([], 100)
    spans, nxt = log.spans(99)
    assert [s["sample_uid"] for s in spans] == ["s99"] and nxt == 100
    assert log.state()["num_metric_lines"] == 100 and log.state()["step"] == 99
    whole = RunLog()
    for i in range(100):
        whole.add_record({"kind": "train", "step": i})
    assert [r["step"] for r in whole.records(0)[0]] == list(range(100))
