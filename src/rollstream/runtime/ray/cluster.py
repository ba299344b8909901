"""The Ray a run uses: a local one it starts (and stops), or an existing cluster it joins.

:class:`RayCluster` owns that lifecycle and nothing else; the engine actors it hosts are
``engines.py``'s. A local Ray is bound to 127.0.0.1 with the dashboard off. Its session folder
lives under a short temporary path (Ray's Unix sockets must fit ~100 characters, which a run
directory may not) and its logs are moved into the run directory's ``ray-logs`` at the end.
A cluster address on loopback (``127.0.0.1:PORT``, a cluster started with ``ray start`` on
this host, docs/distributed.md "One host") is joined on loopback too. A process that already
called ``ray.init`` (the Python API, tests) keeps its Ray: the run
uses it and leaves it running.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.config.runtime import RayConfig

if TYPE_CHECKING:
    from rollstream.runtime.ray.units import ScaleUnits

log = logging.getLogger(__name__)


def require_ray() -> None:
    """ValueError naming the setting when Ray is not installed (runs check this first)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ValueError("runtime.kind: ray needs Ray: pip install 'rollstream[ray]'")


@dataclass(slots=True, kw_only=True)
class RayCluster:
    owned: bool  # started by this run: stopped by :meth:`stop`
    temp_dir: Path | None = None  # the local Ray's session folder (owned only)
    log_dir: Path | None = None  # where its logs go at the end
    units: ScaleUnits | None = None  # the run's reservation (runtime/ray/units.py), if made

    @classmethod
    def start(cls, cfg: RayConfig, log_dir: Path | None = None) -> RayCluster:
        """Join ``cfg.address``, keep a Ray this process started already, or start a local
        one sized by ``cfg`` (its logs end up in ``log_dir``)."""
        require_ray()
        import ray

        if ray.is_initialized():
            return cls(owned=False)
        if cfg.address is not None:
            if _on_loopback(cfg.address):
                _keep_loopback()
            ray.init(address=cfg.address, log_to_driver=False)
            return cls(owned=False)
        # a run's private Ray has no business on the network
        _keep_loopback()
        temp_dir = Path(tempfile.mkdtemp(prefix="rs-ray-"))
        ray.init(address="local", num_cpus=cfg.num_cpus or os.cpu_count(),
                 object_store_memory=cfg.object_store_bytes, include_dashboard=False,
                 _node_ip_address="127.0.0.1", _temp_dir=str(temp_dir), log_to_driver=False)
        return cls(owned=True, temp_dir=temp_dir, log_dir=log_dir)

    def stop(self) -> None:
        """Give back the run's scale units, then stop the local Ray this run started (its
        processes exit) and keep its logs; a Ray the run joined is left running."""
        if self.units is not None:
            self.units.remove()
            self.units = None
        if not self.owned:
            return
        import ray

        ray.shutdown()
        assert self.temp_dir is not None
        logs = self.temp_dir / "session_latest" / "logs"
        if self.log_dir is not None and logs.is_dir():
            shutil.rmtree(self.log_dir, ignore_errors=True)
            shutil.copytree(logs, self.log_dir, ignore_dangling_symlinks=True)
        _remove(self.temp_dir)
        self.owned = False


def _on_loopback(address: str) -> bool:
    """Whether a cluster address (``host:port``, or Ray's ``auto``) names this host's
    loopback."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def _keep_loopback() -> None:
    """Keep Ray on 127.0.0.1 in this process. Without this Ray takes 127.0.0.1 (a local
    Ray's node address, or a cluster address on loopback) for the machine's routable address,
    and listens, or looks for the cluster, there: a cluster started on loopback
    (docs/distributed.md, "One host") is then not found."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _remove(folder: Path, timeout_s: float = 10.0) -> None:
    """Remove Ray's session folder. Its processes may still write logs there for a moment
    after ``ray.shutdown()`` returns (seen on a loaded machine: the folder was left with a
    file written after the removal), so remove again until it stays gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists() or time.monotonic() > deadline:
            return
        time.sleep(0.2)
