"""Engine kinds are registered in one place (engine/factory.py): what config accepts and what
the factory builds are the same names, and each kind's Ray builder exists."""

from __future__ import annotations

import inspect
import typing

import pytest

from rollstream.config.schema import EngineConfig
from rollstream.engine.factory import KINDS, engine_kind


def test_config_accepts_exactly_the_registered_kinds():
    accepted = typing.get_args(EngineConfig.model_fields["kind"].annotation)
    assert set(accepted) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_builds_on_ray_with_the_same_arguments(kind):
    params = inspect.signature(KINDS[kind].ray_builder()).parameters
    assert list(params) == ["cfg", "model_path", "version", "units", "run_dir"]


def test_an_unknown_kind_names_the_known_ones():
    with pytest.raises(ValueError, match="'local', 'vllm', got 'tgi'"):
        engine_kind("tgi")
