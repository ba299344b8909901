"""Every task-source kind and what builds it, in one place: the synthetic ones
(``data/sources.py``), the datasets (``data/dataset.py``) and the agent episodes
(``agent/tally.py``). The last two build on ``data/sources.py``; this module sits above all
three, so none imports another in a circle. The dataset and agent modules are imported only
when a run has such a source (the agent's pulls in the chat template and the proxy)."""

from __future__ import annotations

from rollstream.config.tasks import SourceConfig
from rollstream.data.sources import SYNTHETIC_KINDS, PromptTokenizer, TaskSource


def build_source(cfg: SourceConfig, tokenizer: PromptTokenizer, seed: int) -> TaskSource:
    """The source ``cfg.kind`` named ``cfg.name`` (default: the kind)."""
    if cfg.reads_dataset:
        from rollstream.data.dataset import DatasetSource

        return DatasetSource(name=cfg.source_name, cfg=cfg, tokenizer=tokenizer, seed=seed)
    if cfg.kind == "tally":  # an agent task: needs the chat template (agent/tally.py)
        from rollstream.agent.tally import TallySource

        return TallySource(name=cfg.source_name, cfg=cfg, tokenizer=tokenizer, seed=seed)
    return SYNTHETIC_KINDS[cfg.kind](name=cfg.source_name, cfg=cfg, tokenizer=tokenizer,
                                     seed=seed)
