"""Optional external sinks for recorded scalars: TensorBoard, Weights & Biases, MLflow.

Each is imported only when switched on in ``MonitorConfig``; a missing package is a warning,
never a failed run (monitoring must not take training down). Scalars are tagged
``<kind>/<name>`` with the step as x-axis.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path
from typing import Any, Protocol

from rollstream.config.schema import MonitorConfig

log = logging.getLogger(__name__)

class Tracker(Protocol):
    def scalars(self, kind: str, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def scalars(self, kind: str, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(f"{kind}/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    def __init__(self, wandb: Any, project: str, name: str, log_dir: Path | None) -> None:
        self._wandb = wandb
        self._run = wandb.init(project=project, name=name,
                               dir=str(log_dir) if log_dir else None)

    def scalars(self, kind: str, step: int, values: dict[str, float]) -> None:
        # Kinds log at their own steps (eval at 0 after train at 5), and wandb insists on a
        # monotonic global step, so the step travels as a value instead.
        self._run.log({f"{kind}/step": step, **{f"{kind}/{k}": v for k, v in values.items()}})

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    def __init__(self, mlflow: Any, experiment: str, name: str) -> None:
        self._mlflow = mlflow
        mlflow.set_experiment(experiment)
        self._run = mlflow.start_run(run_name=name)

    def scalars(self, kind: str, step: int, values: dict[str, float]) -> None:
        self._mlflow.log_metrics({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _import(module: str, feature: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        log.warning(f"monitor: {feature} is on but {module!r} is not installed; skipping it")
        return None


def _tensorboard(log_dir: Path) -> Tracker | None:
    # torch.utils.tensorboard needs the tensorboard package; probe first to avoid importing
    # torch only to fail.
    if importlib.util.find_spec("tensorboard") is not None:
        mod = _import("torch.utils.tensorboard", "tensorboard")
    elif importlib.util.find_spec("tensorboardX") is not None:
        mod = _import("tensorboardX", "tensorboard")
    else:
        log.warning("monitor: tensorboard is on but neither 'tensorboard' nor 'tensorboardX' "
                    "is installed; skipping it")
        return None
    return TensorBoardTracker(mod.SummaryWriter(log_dir=str(log_dir))) if mod else None


def build_trackers(cfg: MonitorConfig, run_dir: Path | None) -> list[Tracker]:
    """The trackers switched on in cfg whose packages are importable."""
    name = run_dir.name if run_dir is not None else "run"
    trackers: list[Tracker] = []
    if cfg.tensorboard:
        if run_dir is None:
            log.warning("monitor: tensorboard needs a run directory; skipping it")
        elif (tb := _tensorboard(run_dir / "tensorboard")) is not None:
            trackers.append(tb)
    if "wandb" in cfg.trackers and (wandb := _import("wandb", "wandb")) is not None:
        trackers.append(WandbTracker(wandb, cfg.tracker_project, name, run_dir))
    if "mlflow" in cfg.trackers and (mlflow := _import("mlflow", "mlflow")) is not None:
        trackers.append(MlflowTracker(mlflow, cfg.tracker_project, name))
    return trackers
