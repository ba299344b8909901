"""Cost-model profiles: how long a simulated engine's forward passes and a simulated trainer's
steps take. A profile is a YAML file (``profiles/*.yaml``, or any path) with its sources.

Decode step of a batch of ``B`` running sequences holding ``C`` tokens of context in all::

    memory_s  = weights_s + per_context_token_s * C     (read the weights and the KV cache)
    compute_s = per_seq_s * B                            (the matmuls of B new tokens)
    step_s    = overhead_s + max(memory_s, compute_s)    (combine: max, a GPU roofline)
              | overhead_s + memory_s + compute_s        (combine: sum, a CPU that does both
                                                          on the same cores)

During ``n`` steps of one batch ``B`` stays fixed and ``C`` grows by ``B`` per step, so the
time of ``n`` steps has a closed form (:meth:`DecodeCost.steps_s`), and the steps done in a
span of time follow by bisection (:meth:`DecodeCost.steps_in`): the engine needs no event per
token. Prefill of ``t`` tokens: ``overhead_s + per_token_s * t`` (no decode meanwhile, as an
engine without chunked prefill). Weight sync: ``weight_sync_s`` per load, decode paused.
Trainer step: ``step_overhead_s + tokens / (tokens_per_s_per_device * devices)`` over the
prompt and response tokens of the samples it trains.

Contention (``contention``; 0 for engines and trainer on devices of their own): on one CPU
the engine and the trainer slow each other when they compute at once. While a trainer step
computes, every engine pass takes ``1 + contention.engine`` times its cost; a trainer step
takes ``1 + contention.trainer * u`` times its cost, ``u`` the engines' busy share when it
starts. Both fitted from runs that record which passes overlapped a trainer step
(``sim/calibrate.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollstream.config.loader import read_yaml_mapping, validate_model

PROFILES_DIR = Path(__file__).parent / "profiles"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class DecodeCost(_Section):
    overhead_s: float = Field(ge=0)
    """Fixed cost of a decode step (kernel launches, sampling, scheduling)."""
    weights_s: float = Field(ge=0)
    """Reading the weights once per step (memory-bound part that does not grow with C)."""
    per_context_token_s: float = Field(ge=0)
    """Reading one token of KV cache (attention over the context), per step."""
    per_seq_s: float = Field(ge=0)
    """Compute of one sequence's new token (2 x parameters FLOPs at the achieved rate)."""
    combine: Literal["max", "sum"] = "max"
    """``max``: memory and compute overlap (GPU roofline); ``sum``: they add (CPU)."""

    def step_s(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` sequences holding ``context`` tokens in all."""
        mem = self.weights_s + self.per_context_token_s * context
        comp = self.per_seq_s * batch
        return self.overhead_s + (max(mem, comp) if self.combine == "max" else mem + comp)

    def steps_s(self, batch: int, context: int, n: int) -> float:
        """``n`` steps from ``context`` tokens, ``batch`` sequences each adding one per step."""
        if n <= 0:
            return 0.0
        k, comp = self.per_context_token_s * batch, self.per_seq_s * batch
        m0 = self.weights_s + self.per_context_token_s * context  # memory_s of step 0
        if self.combine == "sum":
            return n * (self.overhead_s + m0 + comp) + k * n * (n - 1) / 2
        # steps before memory overtakes compute take comp each; the rest m0 + k*i
        if k > 0:
            first_mem = min(n, max(0, math.ceil((comp - m0) / k)))
        else:
            first_mem = n if comp > m0 else 0
        rest = n - first_mem
        mem_sum = rest * m0 + k * (first_mem * rest + rest * (rest - 1) / 2)
        return n * self.overhead_s + first_mem * comp + mem_sum

    def steps_in(self, batch: int, context: int, seconds: float, limit: int) -> int:
        """Whole steps (at most ``limit``) done in ``seconds``, a step counted when more than
        half of it is (so event times rounded by the clock land on the right step): the
        largest ``n`` whose step's midpoint is due by then. Estimated by inverting the closed
        form, then moved step by step to the exact answer (a bisection costs ~30 closed forms
        per event; this one or two)."""
        def due(n: int) -> bool:  # the midpoint of step n (1-based) is done
            return (self.steps_s(batch, context, n - 1) + self.steps_s(batch, context, n)) / 2 \
                <= seconds
        est = self._inverse(batch, context, seconds)
        n = limit if est >= limit else max(0, math.floor(est + 0.5))
        while n < limit and due(n + 1):
            n += 1
        while n > 0 and not due(n):
            n -= 1
        return n

    def _inverse(self, batch: int, context: int, seconds: float) -> float:
        """The (real) number of steps whose closed-form time is ``seconds``."""
        k, comp = self.per_context_token_s * batch, self.per_seq_s * batch
        m0 = self.weights_s + self.per_context_token_s * context
        if self.combine == "sum":
            return _quadratic_root(k / 2, self.overhead_s + m0 + comp - k / 2, seconds)
        compute_bound = (max(0, math.ceil((comp - m0) / k)) if k > 0
                         else (math.inf if comp > m0 else 0))
        step = self.overhead_s + comp
        if compute_bound * step >= seconds:
            return seconds / step if step > 0 else math.inf
        f = compute_bound
        return f + _quadratic_root(k / 2, self.overhead_s + m0 + k * f - k / 2,
                                   seconds - f * step)


def _quadratic_root(a: float, b: float, c: float) -> float:
    """The non-negative ``x`` with ``a x^2 + b x = c`` (a >= 0, c >= 0)."""
    if c <= 0:
        return 0.0
    if a <= 0:
        return c / b if b > 0 else math.inf
    return 2 * c / (b + math.sqrt(b * b + 4 * a * c))


class PrefillCost(_Section):
    overhead_s: float = Field(ge=0)
    """Fixed cost of a prefill pass."""
    per_token_s: float = Field(ge=0)
    """Compute per prompt token (a resumed sample re-prefills its partial tokens too)."""

    def time_s(self, tokens: int) -> float:
        return self.overhead_s + self.per_token_s * tokens


class TrainerCost(_Section):
    step_overhead_s: float = Field(ge=0)
    """Fixed cost of a trainer step (optimizer step, gathers, checkpoint of the weights)."""
    tokens_per_s_per_device: float = Field(gt=0)
    """Trained tokens (prompt + response, forward + backward + logprob recompute) per second
    per trainer device."""

    def step_s(self, tokens: int, devices: int) -> float:
        return self.step_overhead_s + tokens / (self.tokens_per_s_per_device * devices)


class Contention(_Section):
    engine: float = Field(0.0, ge=0)
    """Extra share of an engine pass's (prefill, decode) time while a trainer step computes:
    the pass takes ``1 + engine`` times its cost (0: the trainer has devices of its own)."""
    trainer: float = Field(0.0, ge=0)
    """Extra share of a trainer step's time per unit of the engines' busy share ``u`` when it
    starts: the step takes ``1 + trainer * u`` times its cost."""


class Profile(_Section):
    name: str
    """Short name shown in tables."""
    source: str = Field(min_length=1)
    """Where the numbers come from (published figures, a fit, assumptions): required."""
    decode: DecodeCost
    """Decode step cost (module docstring)."""
    prefill: PrefillCost
    """Prefill pass cost."""
    kv_capacity_tokens: int = Field(ge=1)
    """KV-cache capacity of one engine in tokens (prompt + response of running sequences);
    a batch that would exceed it preempts its newest sequence (recomputed later)."""
    max_num_seqs: int = Field(ge=1)
    """Most sequences an engine runs at once (the continuous batch's width)."""
    weight_sync_s: float = Field(ge=0)
    """Seconds an engine spends loading a new weight version (decode paused)."""
    trainer: TrainerCost
    """Trainer step cost."""
    contention: Contention = Contention()
    """How engines and trainer slow each other when they compute at once (module docstring)."""


def load_profile(name_or_path: str) -> Profile:
    """A profile by built-in name (``gpu_h100_7b``) or YAML path; a bad field is a ValueError
    naming it."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
        raise ValueError(f"profile {name_or_path!r}: no such file (built-in profiles: {known})")
    return validate_model(Profile, read_yaml_mapping(path, "profile"), f"profile {path}")
