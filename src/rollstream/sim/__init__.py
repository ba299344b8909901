"""``rollstream sim``: the real schedulers on simulated engines, trainer and time.

The project's own Controller, Rollout (admission, StalenessPolicy, buffer, Lifecycle,
Ledger), Dispatcher and WeightSync, built by ``runtime.build.build_loop`` as in a run, drive
:class:`~rollstream.sim.engine.SimEngine` instances (continuous batching under a cost-model
profile) and a :class:`~rollstream.sim.trainer.SimTrainer` on a virtual-time asyncio loop
(:mod:`rollstream.sim.vloop`). Modules:

    scenario.py  the scenario YAML (cluster, workload, profile, modes)
    profile.py   cost-model profiles (profiles/*.yaml, with their sources)
    workload.py  tasks, sample lengths and answers (Seer-like generator)
    engine.py    the simulated engine (Engine protocol)
    trainer.py   the simulated trainer (TrainerLike)
    vloop.py     virtual time (looptime's loop; trainer steps on a virtual executor)
    run.py       one mode: build, run, measure
    report.py    all modes: table and JSON (``rollstream sim SCENARIO.yaml --json OUT``)
"""
