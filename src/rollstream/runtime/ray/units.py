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

With ``runtime.ray.nodes`` (``nodes.py``), a bundle also asks for its role's node resource,
so it lands on a node of that role. When engines and ranks are given different nodes, each
unit has two bundles, its engines' and its ranks' (bundle ``2u`` and ``2u + 1``), so each goes
to a node of its own role; otherwise a unit is one bundle (bundle ``u``), as above.

The reservation is made before any actor starts; a cluster that cannot hold it fails the run
after ``PLACE_TIMEOUT_S`` naming what was asked and what Ray has. Reward and harness worker
actors are not in the units (they go where Ray places them, on their ``nodes.rewards`` nodes,
or on the driver's node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollstream.config.schema import RunConfig

PLACE_TIMEOUT_S = 120.0  # how long Ray may take to reserve the units (a cluster may scale up)


@dataclass(slots=True, kw_only=True)
class ScaleUnits:
    group: Any  # the Ray placement group (None until reserved)
    num_units: int
    engines_per_unit: int
    ranks_per_unit: int  # 0: the trainer is not in the units (train.backend: local)
    engine_bundle: dict[str, float]  # what one unit's engines reserve
    rank_bundle: dict[str, float]  # one unit's ranks ({} without ranks)
    ranks_apart: bool  # ranks in a bundle of their own (their nodes differ from the engines')

    @classmethod
    def of(cls, cfg: RunConfig) -> ScaleUnits:
        """``cfg``'s units, not reserved yet."""
        from rollstream.runtime.ray.nodes import role_resources

        rt = cfg.runtime.ray
        units = rt.scale_units
        ranks = cfg.train.fsdp.world_size if cfg.train.backend == "fsdp" else 0
        engines, ranks = cfg.engine.num_engines // units, ranks // units
        engine = {"CPU": engines * rt.engine_num_cpus, **role_resources(rt.nodes, "engines")}
        rank = {"CPU": ranks * rt.rank_num_cpus,
                **role_resources(rt.nodes, "trainer")} if ranks else {}
        return cls(group=None, num_units=units, engines_per_unit=engines,
                   ranks_per_unit=ranks, engine_bundle=engine, rank_bundle=rank,
                   ranks_apart=bool(ranks) and rt.nodes.engines != rt.nodes.trainer)

    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles: per unit, its engines' and ranks' together, or
        (``ranks_apart``) its engines' then its ranks'."""
        if self.ranks_apart:
            return [dict(b) for _ in range(self.num_units)
                    for b in (self.engine_bundle, self.rank_bundle)]
        together = {**self.rank_bundle, **self.engine_bundle,
                    "CPU": self.engine_bundle["CPU"] + self.rank_bundle.get("CPU", 0.0)}
        return [dict(together) for _ in range(self.num_units)]

    @classmethod
    def reserve(cls, cfg: RunConfig) -> ScaleUnits:
        """Reserve ``cfg``'s units on the Ray this process is connected to."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        self = cls.of(cfg)
        bundles = self.bundles()
        self.group = placement_group(bundles, strategy="SPREAD", name="rollstream-units")
        try:
            ray.get(self.group.ready(), timeout=PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            rt = cfg.runtime.ray
            raise RuntimeError(
                f"Ray could not reserve runtime.ray.scale_units = {self.num_units} units "
                f"({self.engines_per_unit} engine actors of runtime.ray.engine_num_cpus = "
                f"{rt.engine_num_cpus} and {self.ranks_per_unit} fsdp ranks of "
                f"runtime.ray.rank_num_cpus = {rt.rank_num_cpus} each: bundles "
                f"{bundles[:2 if self.ranks_apart else 1]} per unit) within "
                f"{PLACE_TIMEOUT_S:g} s; the cluster has {ray.cluster_resources().get('CPU', 0):g} "
                "CPUs: fewer units, actors or CPUs each") from None
        return self

    def engine(self, index: int) -> Any:
        """The scheduling strategy of engine ``index``'s actor (and its replacements)."""
        unit = index // self.engines_per_unit
        return self._in(2 * unit if self.ranks_apart else unit)

    def rank(self, rank: int) -> Any:
        """The scheduling strategy of fsdp rank ``rank``'s actor."""
        assert self.ranks_per_unit, "the trainer's ranks are not in the units"
        unit = rank // self.ranks_per_unit
        return self._in(2 * unit + 1 if self.ranks_apart else unit)

    def remove(self) -> None:
        """Give the reservation back (the actors in it are killed by Ray)."""
        from ray.util.placement_group import remove_placement_group

        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None

    def _in(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=bundle)
