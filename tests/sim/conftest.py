from __future__ import annotations

import pytest

from rollstream.sim.scenario import Scenario


@pytest.fixture
def small() -> Scenario:
    """A few engines and short samples: each mode runs in well under a second."""
    return Scenario.model_validate({
        "name": "small", "seed": 3, "profile": "gpu_h100_7b", "engines": 3, "token_block": 32,
        "steps": 5, "groups_per_step": 6, "group_size": 4, "trainer_devices": 2,
        "workload": {"mean_response_tokens": 3000, "max_response_tokens": 12288},
        "modes": [
            {"name": "sync", "mode": "sync"},
            {"name": "k1_partial", "mode": "async", "staleness": {"max_staleness": 1}},
            {"name": "k3_partial", "mode": "async", "staleness": {"max_staleness": 3}},
            {"name": "k2_continue", "mode": "async", "staleness": {"max_staleness": 2},
             "on_update": "continue"},
            {"name": "k2_drain", "mode": "async", "staleness": {"max_staleness": 2},
             "on_update": "drain"},
            {"name": "k2_mask", "mode": "async",
             "staleness": {"max_staleness": 2, "max_token_age": 1}},
            {"name": "k1_admission", "mode": "async",
             "staleness": {"max_staleness": 1, "max_context_age": 3}},
        ],
    })
