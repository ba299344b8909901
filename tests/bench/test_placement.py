"""The CPU placement the benchmarks rely on: ``cpu_affinity`` pins the engine's step thread and
the thread that runs the trainer, and nothing else (Linux pins per thread)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollstream.config.schema import LocalEngineConfig, TinyModelConfig, TrainConfig
from rollstream.engine.local import LocalEngine
from rollstream.models.tiny import build_tiny_model
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.staleness import StalenessPolicy
from rollstream.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                          intermediate_size=32, max_position=64)
    return build_tiny_model(cfg, build_char_tokenizer(), tmp_path_factory.mktemp("m"))


def test_engine_pins_its_step_thread_only(model):
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    engine = LocalEngine(model, LocalEngineConfig(max_slots=2, max_seq_len=32, device="cpu",
                                                  threads=1, cpu_affinity=(core,)))
    try:
        thread = next(t for t in threading.enumerate() if t.name.startswith("rollstream-local"))
        for _ in range(100):  # the thread pins itself as it starts
            if os.sched_getaffinity(thread.native_id) == {core}:
                break
            threading.Event().wait(0.01)
        assert os.sched_getaffinity(thread.native_id) == {core}
        assert os.sched_getaffinity(0) == before
    finally:
        engine.shutdown()


def test_trainer_pins_the_thread_that_computes_not_its_constructor(model):
    core = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    trainer = Trainer(TrainConfig(threads=1, cpu_affinity=(core,)), model,
                      staleness=StalenessPolicy(max_staleness=0))
    assert os.sched_getaffinity(0) == before
    with ThreadPoolExecutor(1) as pool:
        pinned = pool.submit(lambda: (trainer.step([], 0), os.sched_getaffinity(0))[1]).result()
    assert pinned == {core}
    assert os.sched_getaffinity(0) == before
