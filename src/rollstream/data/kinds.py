"""Every task-source kind and what builds it, in one place: the synthetic ones
(``data/sources.py``), the datasets (``data/dataset.py``), reasoning-gym's generators
(``data/reasoning_gym.py``) and the agent episodes (``agent/tally.py``). The last three build
on ``data/sources.py``; this module sits above them all, so none imports another in a circle.
The dataset, generator and agent modules are imported only when a run has such a source (the
agent's pulls in the chat template and the proxy, the generators' the reasoning-gym package)."""

from __future__ import annotations

from rollstream.config.tasks import SourceConfig
from rollstream.data.sources import SYNTHETIC_KINDS, PromptTokenizer, TaskSource


def build_source(cfg: SourceConfig, tokenizer: PromptTokenizer, seed: int) -> TaskSource:
    """The source ``cfg.kind`` named ``cfg.name`` (default: the kind)."""
    if cfg.reads_dataset:
        from rollstream.data.dataset import DatasetSource

        return DatasetSource(name=cfg.source_name, cfg=cfg, tokenizer=tokenizer, seed=seed)
    if cfg.kind == "reasoning_gym":
        from rollstream.data.reasoning_gym import ReasoningGymSource

        return ReasoningGymSource(name=cfg.source_name, cfg=cfg, tokenizer=tokenizer, seed=seed)
    if cfg.kind == "tally":  # an agent task: needs the chat template (agent/tally.py)
        from rollstream.agent.tally import TallySource

        return TallySource(name=cfg.source_name, cfg=cfg, tokenizer=tokenizer, seed=seed)
    return SYNTHETIC_KINDS[cfg.kind](name=cfg.source_name, cfg=cfg, tokenizer=tokenizer,
                                     seed=seed)
