"""The session's warm-start cache and the tiny run's warm-started model, and a random kit
model folder for tests that need a whole model folder but no trained one.

A warm start's cache entry is keyed by the model and task settings (models/warmstart.py), so
tests that pass this one cache as ``model.cache_dir`` build each shape once per session."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

# Test modules that import an optional extra at their top. `make test` installs every extra
# (with vLLM); `make test-fast` installs the dev extra alone, and there they are left out
# instead of failing to collect. Where vLLM is installed the extras were meant to be too, so
# nothing is left out: a missing extra fails loudly.
_EXTRA_MODULES = {"data/test_reasoning_gym.py": "reasoning_gym",
                  "agent/test_openenv.py": "openenv", "train/test_lora.py": "peft"}
collect_ignore = ([] if importlib.util.find_spec("vllm") else
                  [path for path, module in _EXTRA_MODULES.items()
                   if importlib.util.find_spec(module) is None])


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist's ``--dist loadgroup`` (`make test` runs two workers): the tests that
    start vLLM servers or Ray clusters run one after another on one worker (they share the
    session's vLLM server, and two of them at once stall each other on a 2-core machine);
    every other module runs whole on one worker, so its module fixtures are built once."""
    if not getattr(config.option, "loadgroup", False):  # set on a worker of --dist loadgroup
        return
    for item in items:
        heavy = item.get_closest_marker("vllm") or item.get_closest_marker("ray")
        item.add_marker(pytest.mark.xdist_group("servers" if heavy else item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def tiny_run_cache(tmp_path_factory) -> Path:
    """The warm-start cache every test that warm-starts a kit model shares: one folder for all
    of pytest-xdist's workers too (an entry is renamed into place whole, so two workers that
    build the same shape at once both end with one good entry)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    path = root / "tiny-run-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_run_model(tmp_path_factory, tiny_run_cache: Path) -> Path:
    """The folder of the tiny run's warm-started model (bench/tiny_run.py: tick tasks of up
    to 6 items), for runs that need a model that answers tick but not a warm start of their
    own: the same cache entry as the tiny runs' (built once)."""
    from rollstream.bench.tiny_run import tiny_run_config
    from rollstream.config import load_config
    from rollstream.models.warmstart import prepare_model

    root = tmp_path_factory.mktemp("tiny-run-model")
    path = root / "config.json"
    path.write_text(json.dumps(tiny_run_config("model", root, steps=1, checkpoint_every=0,
                                               cache_dir=tiny_run_cache)))
    cfg = load_config(path, [])
    return prepare_model(cfg.model, cfg.tasks)


@pytest.fixture(scope="session")
def kit_model(tmp_path_factory) -> Path:
    from tests.durable.whole import save_kit_model

    return save_kit_model(tmp_path_factory.mktemp("kit") / "model")
