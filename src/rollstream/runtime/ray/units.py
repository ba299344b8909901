"""Scale units: where a run's engine actors and fsdp rank actors go on a Ray cluster.

A scale unit is one node's worth of a run: ``engine.num_engines / runtime.ray.scale_units``
engine actors and, with ``train.backend: fsdp``, ``train.fsdp.world_size / scale_units`` rank
actors, placed together. The run reserves one Ray placement group with one bundle per unit,
holding the CPUs of all its actors (``engine_num_cpus`` each engine, ``rank_num_cpus`` each
rank). Ray places a bundle whole on one node, so a unit's actors always share a node (what a
``STRICT_PACK`` group of the unit's actors would give); the group's strategy is ``SPREAD``, so
the units go to different nodes where the cluster has them (and share the node on one host).
Engine ``i`` runs in unit ``i // engines_per_unit``, rank ``r`` in unit ``r // ranks_per_unit``,
so a unit's engines and ranks are neighbours, and a replaced engine actor returns to its unit.

The reservation is made before any actor starts; a cluster that cannot hold it fails the run
after ``PLACE_TIMEOUT_S`` naming what was asked and what Ray has. Reward and harness worker
actors are not in the units (they go where Ray places them, or on the driver's node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollstream.config.schema import RunConfig

PLACE_TIMEOUT_S = 120.0  # how long Ray may take to reserve the units (a cluster may scale up)


@dataclass(slots=True, kw_only=True)
class ScaleUnits:
    group: Any  # the Ray placement group
    num_units: int
    engines_per_unit: int
    ranks_per_unit: int  # 0: the trainer is not in the units (train.backend: local)

    @classmethod
    def reserve(cls, cfg: RunConfig) -> ScaleUnits:
        """Reserve ``cfg``'s units on the Ray this process is connected to."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        rt = cfg.runtime.ray
        units = rt.scale_units
        ranks = cfg.train.fsdp.world_size if cfg.train.backend == "fsdp" else 0
        self = cls(group=None, num_units=units,
                   engines_per_unit=cfg.engine.num_engines // units,
                   ranks_per_unit=ranks // units)
        bundle = {"CPU": self.engines_per_unit * rt.engine_num_cpus
                  + self.ranks_per_unit * rt.rank_num_cpus}
        self.group = placement_group([dict(bundle) for _ in range(units)], strategy="SPREAD",
                                     name="rollstream-units")
        try:
            ray.get(self.group.ready(), timeout=PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            raise RuntimeError(
                f"Ray could not reserve runtime.ray.scale_units = {units} units of "
                f"{bundle['CPU']:g} CPUs each ({self.engines_per_unit} engine actors of "
                f"runtime.ray.engine_num_cpus = {rt.engine_num_cpus} and {self.ranks_per_unit} "
                f"fsdp ranks of runtime.ray.rank_num_cpus = {rt.rank_num_cpus}) within "
                f"{PLACE_TIMEOUT_S:g} s; the cluster has {ray.cluster_resources().get('CPU', 0):g} "
                "CPUs: fewer units, actors or CPUs each") from None
        return self

    def engine(self, index: int) -> Any:
        """The scheduling strategy of engine ``index``'s actor (and its replacements)."""
        return self._in(index // self.engines_per_unit)

    def rank(self, rank: int) -> Any:
        """The scheduling strategy of fsdp rank ``rank``'s actor."""
        assert self.ranks_per_unit, "the trainer's ranks are not in the units"
        return self._in(rank // self.ranks_per_unit)

    def remove(self) -> None:
        """Give the reservation back (the actors in it are killed by Ray)."""
        from ray.util.placement_group import remove_placement_group

        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None

    def _in(self, unit: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=unit)
