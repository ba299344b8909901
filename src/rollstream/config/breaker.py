"""``rollout.breaker``: engines that fail while they say they are UP are taken out of routing
for a while (docs/dispatch.md, "Engines that fail grey")."""

from __future__ import annotations

from pydantic import Field, model_validator

from rollstream.config.section import Section


class BreakerConfig(Section):
    failures: int = Field(3, ge=0)
    """Requests of an UP engine that fail in a row without a token (an HTTP 5xx, a dropped
    connection, an engine actor that raised) before the router quarantines it: it takes no
    request until ``quarantine_s`` have passed, then one at a time until one brings a token
    (routed again) or fails (quarantined again). 0 = never quarantine. Each failed request
    is tried again on another engine with its tokens, whatever this is."""
    quarantine_s: float = Field(30.0, gt=0)
    """Seconds a quarantined engine takes no request before it is probed with one."""

    @model_validator(mode="after")
    def _check(self) -> BreakerConfig:
        if self.failures == 0 and "quarantine_s" in self.model_fields_set:
            raise ValueError("rollout.breaker.quarantine_s is read only with "
                             "rollout.breaker.failures > 0 (it is 0: never quarantine); drop "
                             "it or set failures")
        return self
