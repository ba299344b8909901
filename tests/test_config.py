from pathlib import Path

import pytest

from rollstream.config import ConfigError, RunConfig, load_config, validate
from rollstream.rollout.concurrency import concurrency_limits

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_example_config_loads_and_overrides_apply():
    cfg = load_config(EXAMPLES / "tick.yaml", ["train.lr=1e-3", "rollout.mode=sync",
                                               "tasks.sources.0.max_items=8", "engine.local.threads=2"])
    assert cfg.train.lr == 1e-3 and cfg.rollout.mode == "sync"
    assert cfg.tasks.sources[0].max_items == 8 and cfg.tasks.sources[0].kind == "tick"
    assert cfg.engine.local.threads == 2
    assert cfg.name == "tick-demo"  # untouched keys keep the file's values


def test_defaults_without_a_file():
    assert load_config(None) == RunConfig()


@pytest.mark.parametrize(
    "override, expected",
    [
        (["rollout.mode=fast"], ["rollout.mode", "'fast'", "'sync', 'one_step' or 'async'"]),
        (["train.lr=-1"], ["train.lr", "-1", "> 0"]),
        (["train.lrr=1"], ["unknown key 'train.lrr'", "did you mean 'lr'"]),
        (["engine.local.max_slot=3"], ["engine.local.max_slot", "did you mean 'max_slots'"]),
        (["rollout.group_size=zero"], ["rollout.group_size", "'zero'", "integer"]),
        (["nonsense=1"], ["unknown key 'nonsense'", "known keys under the top level"]),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    for text in expected:
        assert text in str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.lr=-1", "rollout.staleness.max_staleness=-2"])
    assert "2 problems" in str(info.value)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="not an index"):
        load_config(None, ["tasks.sources.5.kind=tick"])


def test_cross_field_check():
    with pytest.raises(ConfigError, match="multiple of model.tiny.num_kv_heads"):
        load_config(None, ["model.tiny.num_heads=4", "model.tiny.num_kv_heads=3"])


@pytest.mark.parametrize(
    "overrides, fields",
    [
        (["rollout.mode=sync", "rollout.staleness.max_staleness=3"],
         ["rollout.staleness.max_staleness = 3", "rollout.mode = sync"]),
        (["rollout.mode=one_step", "rollout.staleness.max_staleness=0"],
         ["rollout.staleness.max_staleness = 0", "rollout.mode = one_step"]),
        (["rollout.partial_rollout=false"],  # the field on_update replaced: its new spelling
         ["rollout: partial_rollout was replaced by on_update", "false is on_update: drain"]),
        (["rollout.staleness.max_staleness=1", "rollout.staleness.max_token_age=2"],
         ["rollout.staleness.max_token_age = 2", "rollout.staleness.max_staleness = 1"]),
        (["rollout.mode=sync", "rollout.staleness.max_token_age=1"],
         ["rollout.staleness.max_token_age = 1", "rollout.mode = sync"]),
        (["rollout.staleness.max_context_age=1"],
         ["rollout.staleness.max_context_age = 1", "rollout.staleness.max_staleness"]),
        (["rollout.staleness.max_staleness=3", "rollout.staleness.max_token_age=1",
          "rollout.staleness.max_context_age=2"],
         ["rollout.staleness.max_context_age = 2", "rollout.staleness.max_staleness"]),
        # the keys the staleness block replaced: each names its new path
        (["rollout.max_staleness=3"],
         ["rollout: max_staleness was replaced by rollout.staleness.max_staleness"]),
        (["rollout.max_context_age=4"],
         ["rollout: max_context_age was replaced by rollout.staleness.max_context_age"]),
        (["train.max_token_age=1"],
         ["train: max_token_age was replaced by rollout.staleness.max_token_age"]),
        (["rollout.group_size=1"], ["rollout.group_size = 1",
                                    "rollout.filter_zero_variance = true"]),
        (["sampling.temperature=0"], ["sampling.temperature = 0", "eval.temperature"]),
        (["rollout.concurrency=adaptive"], ["rollout.concurrency = adaptive",
                                            "rollout.dispatch = engine"]),
        (["rollout.concurrency_window_tokens=512"], ["rollout.concurrency_window_tokens",
                                                     "rollout.concurrency = adaptive"]),
        (["train.compile=true", "train.backend=fsdp"], ["train.compile = true",
                                                        "train.backend = local"]),
        (["engine.kind=vllm", "model.tiny.max_position=128"],
         ["engine.vllm.max_model_len = 512", "model.tiny.max_position = 128"]),
    ],
)
def test_contradicting_or_untrainable_settings_fail_at_load_naming_both(overrides, fields):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for text in fields:
        assert text in str(info.value)


def test_consistent_settings_load():
    load_config(None, ["rollout.mode=sync", "rollout.staleness.max_staleness=0"])  # as the mode
    load_config(None, ["rollout.mode=sync"])  # the async default is not a contradiction
    load_config(None, ["rollout.on_update=drain"])
    load_config(None, ["rollout.group_size=1", "rollout.filter_zero_variance=false"])
    cfg = load_config(None, ["rollout.dispatch=fifo", "rollout.concurrency=adaptive",
                             "rollout.concurrency_window_tokens=512",
                             "rollout.concurrency_min_gain=0.1"])
    made = concurrency_limits(cfg.rollout)(32)  # type: ignore[misc]
    assert (made.capacity, made.window_tokens, made.min_gain, made.limit) == (32, 512, 0.1, 8)
    assert concurrency_limits(load_config(None, []).rollout) is None
    load_config(None, ["rollout.staleness.max_token_age=2", "rollout.staleness.max_context_age=5"])
    load_config(None, ["rollout.staleness.max_context_age=4"])  # admission semantics (AReaL's)
    load_config(None, ["sampling.temperature=0.7", "eval.temperature=0"])
    load_config(EXAMPLES / "tick.yaml", ["rollout.mode=sync"])  # the README's override
    for example in ("tick.yaml", "tick_long.yaml"):  # the README's overrides
        for on_update in ("interrupt", "continue", "drain"):
            cfg = load_config(EXAMPLES / example, [f"rollout.on_update={on_update}"])
            assert cfg.rollout.on_update == on_update


def test_a_source_reward_contradicting_reward_name_is_an_error_naming_both():
    sources = "tasks.sources=[{kind: tick}, {kind: math, reward: math}]"
    with pytest.raises(ConfigError, match=r"tasks.sources.1.reward = 'math' contradicts "
                                          r"reward.name = 'exact_match'"):
        load_config(None, [sources, "reward.name=exact_match"])
    cfg = load_config(None, [sources])  # reward.name: auto lets each source choose
    assert [s.reward for s in cfg.tasks.sources] == [None, "math"]
    assert load_config(None, ["reward.name=math"]).reward.name == "math"


def test_config_is_frozen_and_light():
    import subprocess
    import sys

    cfg = RunConfig()
    with pytest.raises(Exception):
        cfg.train.lr = 1.0  # type: ignore[misc]
    out = subprocess.run([sys.executable, "-c", "import sys, rollstream.config; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_every_example_config_loads():
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert {"tick.yaml", "agent.yaml", "agent_openai.yaml"} <= set(names)
    for name in names:
        load_config(EXAMPLES / name)
    assert load_config(EXAMPLES / "agent_openai.yaml").tasks.sources[0].harness == "openai"


def test_the_long_prompt_example_reads_the_rows_its_script_writes(tmp_path, monkeypatch):
    """examples/tick_fewshot.yaml's dataset is what examples/make_tick_fewshot.py writes:
    few-shot instructions of 256 to about 1,030 tokens (one a character), answers of 20 to
    125, all within the config's positions."""
    import json
    import runpy

    script = runpy.run_path(str(EXAMPLES / "make_tick_fewshot.py"))
    monkeypatch.setitem(script["main"].__globals__, "OUT", tmp_path / "rows.jsonl")
    script["main"]()
    committed = EXAMPLES / "data" / "tick_fewshot.jsonl"
    assert (tmp_path / "rows.jsonl").read_text() == committed.read_text()
    cfg = load_config(EXAMPLES / "tick_fewshot.yaml")
    assert cfg.tasks.sources[0].path == "examples/data/tick_fewshot.jsonl"
    rows = [json.loads(line) for line in committed.read_text().splitlines()]
    instruction = [len(r["prompt"]) - len("T123#07=") for r in rows]
    answers = [len(r["answer"]) for r in rows]
    assert 256 <= min(instruction) and max(instruction) <= 1032
    assert 20 <= min(answers) and max(answers) <= 125 <= cfg.sampling.max_new_tokens
    longest = max(len(r["prompt"]) for r in rows) + cfg.sampling.max_new_tokens
    assert longest <= min(cfg.model.tiny.max_position, cfg.engine.local.max_seq_len)


def test_a_harness_on_a_single_turn_source_is_an_error():
    with pytest.raises(ConfigError, match="`harness` is read by dataset kinds and tally"):
        load_config(None, ["tasks.sources=[{kind: tick, harness: openai}]"])


def test_agent_harness_workers_is_checked_and_read_by_the_openai_harness():
    from rollstream.models.tokenizer import build_char_tokenizer
    from rollstream.runtime.build import build_harnesses

    with pytest.raises(ConfigError, match=r"agent\.harness_workers.*-1"):
        load_config(EXAMPLES / "agent_openai.yaml", ["agent.harness_workers=-1"])
    with pytest.raises(ConfigError, match="agent.harness_workers = 2 is read only by sources "
                                          "with harness: openai"):
        load_config(EXAMPLES / "agent.yaml", ["agent.harness_workers=2"])
    tokenizer = build_char_tokenizer()
    for n in (0, 3):
        cfg = load_config(EXAMPLES / "agent_openai.yaml", [f"agent.harness_workers={n}"])
        harness = build_harnesses(cfg, tokenizer)["openai"]
        assert (harness.workers.size if harness.workers else 0) == n  # started at first use


def test_rollstream_config_prints_every_setting_with_its_default_and_docstring(capsys):
    import yaml
    from pydantic import BaseModel

    from rollstream.cli import main
    from rollstream.config.describe import describe

    assert main(["config"]) == 0
    tree = capsys.readouterr().out
    assert validate(yaml.safe_load(tree)) == RunConfig()  # the printout is the default config

    def walk(model: type[BaseModel]) -> None:  # every documented field is shown with its doc
        for name, info in model.model_fields.items():
            assert f" {name}:" in tree or tree.startswith(f"{name}:") or f"\n{name}:" in tree
            if info.description:
                assert f"# {info.description.splitlines()[0]}".rstrip() in tree, name
            inner = getattr(info.annotation, "model_fields", None)
            args = getattr(info.annotation, "__args__", ())
            if inner is not None:
                walk(info.annotation)
            elif args and hasattr(args[0], "model_fields"):
                walk(args[0])

    walk(RunConfig)
    assert main(["config", "rollout"]) == 0
    rollout = capsys.readouterr().out
    assert rollout.startswith("rollout:\n") and "    max_staleness: 2  # >= 0\n" in rollout
    assert "  mode: async  # one of: sync, one_step, async\n" in rollout
    assert "train:" not in rollout
    sources = describe("tasks.sources")
    assert "  - kind: tick  # one of: tick, digits, math, jsonl, parquet, hf_dataset, tally" \
        in sources and "      answer: null" in sources
    assert describe("reward.timeout_s").endswith("timeout_s: 10.0  # > 0")
    assert main(["config", "rollout.nope"]) == 2
    err = capsys.readouterr().err
    assert "config has no 'rollout.nope'; keys under rollout: mode, staleness" in err
    assert main(["config", "reward.name.x"]) == 2
    assert "'reward.name' has no keys under it" in capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "message"), [
    (["runtime.ray.num_cpus=2"],
     "runtime.ray.num_cpus is read only with runtime.kind: ray (it is embedded)"),
    (["runtime.kind=ray", "runtime.ray.address=10.0.0.1:6379", "runtime.ray.num_cpus=2"],
     "runtime.ray.num_cpus sizes the local Ray a run starts, but runtime.ray.address = "
     "'10.0.0.1:6379' joins an existing cluster"),
    (["runtime.kind=ray", "engine.kind=vllm", "engine.vllm.urls=[http://127.0.0.1:8000]"],
     "engine.vllm.urls = ['http://127.0.0.1:8000'] attaches to running servers, but "
     "runtime.kind: ray launches each engine's server from an actor"),
    (["runtime.kind=ray", "engine.kind=vllm", "runtime.ray.weight_sync=broadcast"],
     "runtime.ray.weight_sync = 'broadcast' is read only by local engine actors, but "
     "engine.kind = 'vllm' (its engines stream over HTTP and reload weights from shared "
     "memory): drop runtime.ray.weight_sync (or set it to auto: by node, the server's actor "
     "writes them on its node)"),
    (["runtime.kind=ray", "engine.kind=vllm", "runtime.ray.episode_cache_tokens=0"],
     "runtime.ray.episode_cache_tokens = 0 is read only by local engine actors"),
    (["runtime.kind=ray", "engine.kind=vllm", "runtime.ray.delta=false"],
     "runtime.ray.delta = False is read only by local engine actors"),
    (["runtime.kind=ray", "engine.kind=vllm", "runtime.ray.placement=disaggregated"],
     "runtime.ray.placement = 'disaggregated' pins the local engine's threads to cores; a "
     "vLLM server places its own processes"),
    (["runtime.kind=ray", "engine.num_engines=3", "runtime.ray.num_cpus=2"],
     "engine.num_engines = 3 actors of runtime.ray.engine_num_cpus = 1.0 need 3 CPUs, more "
     "than runtime.ray.num_cpus = 2"),
    (["runtime.kind=ray", "runtime.ray.num_cpus=2", "runtime.ray.worker_num_cpus=0.25",
      "reward.num_workers=4", "engine.num_engines=2"],
     "runtime.ray.worker_num_cpus = 0.25 for 4 worker actors (reward.num_workers + "
     "agent.harness_workers) and 2 CPUs of engine actors need more than runtime.ray.num_cpus "
     "= 2"),
    (["runtime.kind=ray", "runtime.ray.worker_num_cpus=-1"], "runtime.ray.worker_num_cpus"),
    (["runtime.ray.worker_num_cpus=0.5"],
     "runtime.ray.worker_num_cpus is read only with runtime.kind: ray (it is embedded)"),
    (["runtime.kind=ray", "runtime.ray.object_store_bytes=1000"],
     "runtime.ray.object_store_bytes"),
    (["runtime.kind=ray", "runtime.ray.weight_sync=nccl"],
     "runtime.ray.weight_sync"),
    (["runtime.kind=ray", "runtime.ray.bucket_bytes=1048576"],
     "runtime.ray.bucket_bytes is read only with runtime.ray.weight_sync: broadcast, "
     "shared_memory or auto (it is object_store)"),
    (["runtime.kind=ray", "runtime.ray.weight_sync=broadcast", "runtime.ray.bucket_bytes=1000"],
     "runtime.ray.bucket_bytes"),
    (["runtime.kind=ray", "runtime.ray.weight_sync=shared_memory",
      "runtime.ray.address=10.0.0.1:6379"],
     "runtime.ray.weight_sync = 'shared_memory' reaches actors on this host only"),
    (["runtime.kind=ray", "runtime.ray.placement=colocated", "runtime.ray.address=h:6379"],
     "runtime.ray.placement = 'colocated' places processes on this host's CPUs"),
    (["runtime.kind=ray", "runtime.ray.placement=disaggregated", "train.cpu_affinity=[0]"],
     "train.cpu_affinity = [0] contradicts runtime.ray.placement = 'disaggregated'"),
    (["runtime.kind=ray", "runtime.ray.placement=disaggregated",
      "engine.local.cpu_affinity=[1]"],
     "engine.local.cpu_affinity = [1] contradicts runtime.ray.placement = 'disaggregated'"),
    (["runtime.kind=ray", "runtime.ray.placement=apart"], "runtime.ray.placement"),
    (["runtime.kind=ray", "runtime.ray.out_of_band_bytes=-1"], "runtime.ray.out_of_band_bytes"),
    (["runtime.kind=ray", "runtime.ray.episode_cache_tokens=-1"],
     "runtime.ray.episode_cache_tokens"),
    (["runtime.ray.episode_cache_tokens=0"],
     "runtime.ray.episode_cache_tokens is read only with runtime.kind: ray (it is embedded)"),
    (["runtime.ray.weight_sync=broadcast"],
     "runtime.ray.weight_sync is read only with runtime.kind: ray (it is embedded)"),
    (["runtime.kind=ray", "engine.num_engines=3", "runtime.ray.scale_units=2"],
     "engine.num_engines = 3 does not split into runtime.ray.scale_units = 2 equal units"),
    (["runtime.kind=ray", "engine.num_engines=2", "runtime.ray.scale_units=2",
      "train.backend=fsdp", "train.fsdp.world_size=3"],
     "train.fsdp.world_size = 3 does not split into runtime.ray.scale_units = 2 equal units: "
     "each unit holds an equal share: allowed scale_units divide engine.num_engines = 2 and "
     "train.fsdp.world_size = 3"),
    (["runtime.kind=ray", "runtime.ray.scale_units=0"], "runtime.ray.scale_units"),
    (["runtime.kind=ray", "runtime.ray.rank_num_cpus=0.5"],
     "runtime.ray.rank_num_cpus = 0.5 is read only with train.backend = fsdp (it is local)"),
    (["runtime.kind=ray", "train.backend=fsdp", "train.fsdp.device=cuda"],
     "train.fsdp.device = 'cuda' with runtime.kind: ray is not built yet"),
    (["runtime.kind=ray", "runtime.ray.num_cpus=2", "engine.num_engines=1",
      "train.backend=fsdp"],
     "engine.num_engines = 1 actors of runtime.ray.engine_num_cpus = 1.0 and "
     "train.fsdp.world_size = 2 rank actors of runtime.ray.rank_num_cpus = 1.0 need 3 CPUs, "
     "more than runtime.ray.num_cpus = 2"),
    (["runtime.ray.scale_units=2"],
     "runtime.ray.scale_units is read only with runtime.kind: ray (it is embedded)"),
    (["runtime.kind=ray", "runtime.ray.nodes.engines=rs_engines"],
     ("runtime.ray.nodes.engines = 'rs_engines' names nodes of a cluster, but runtime.ray."
      "address is null")),
    (["runtime.kind=ray", "runtime.ray.address=h:6379", "runtime.ray.nodes.trainer=rs_t"],
     ("runtime.ray.nodes.trainer = 'rs_t' places fsdp rank actors, but train.backend = "
      "'local' trains in the driver process")),
    (["runtime.kind=ray", "runtime.ray.address=h:6379", "runtime.ray.nodes.engines=rs_e",
      "engine.kind=vllm"],
     "runtime.ray.nodes.engines = 'rs_e' with engine.kind = 'vllm' places vLLM servers on "
     "other nodes, whose weights their actors must write on their node: set "
     "runtime.ray.weight_sync: auto (it is object_store)"),
    (["runtime.kind=ray", "runtime.ray.address=h:6379", "runtime.ray.nodes.rewards=GPU"],
     "runtime.ray.nodes.rewards = 'GPU' is not a custom resource name"),
    (["runtime.kind=ray", "runtime.ray.address=h:6379", "runtime.ray.nodes.rewards=a b"],
     "runtime.ray.nodes.rewards = 'a b' is not a custom resource name"),
    (["runtime.kind=ray", "runtime.ray.address=h:6379", "runtime.ray.nodes.driver=x"],
     "runtime.ray.nodes.driver"),
    (["runtime.ray.nodes.engines=rs_engines"],
     "runtime.ray.nodes is read only with runtime.kind: ray (it is embedded)"),
])
def test_runtime_settings_that_contradict_fail_at_load(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_runtime_ray_settings_load():
    cfg = load_config(None, ["runtime.kind=ray", "engine.num_engines=2",
                             "runtime.ray.num_cpus=2", "runtime.ray.engine_num_cpus=0.5"])
    assert (cfg.runtime.kind, cfg.runtime.ray.num_cpus, cfg.engine.num_engines) == ("ray", 2, 2)
    assert load_config(None, []).runtime.kind == "embedded"
    cfg = load_config(None, ["runtime.kind=ray", "runtime.ray.weight_sync=broadcast",
                             f"runtime.ray.bucket_bytes={8 << 20}"])
    assert (cfg.runtime.ray.weight_sync, cfg.runtime.ray.bucket_bytes) == ("broadcast", 8 << 20)
    cfg = load_config(None, ["runtime.kind=ray", "engine.num_engines=2", "train.backend=fsdp",
                             "train.fsdp.world_size=4", "runtime.ray.scale_units=2",
                             "runtime.ray.num_cpus=4", "runtime.ray.rank_num_cpus=0.5"])
    assert (cfg.runtime.ray.scale_units, cfg.runtime.ray.rank_num_cpus) == (2, 0.5)
    cfg = load_config(None, ["runtime.kind=ray", "runtime.ray.address=h:6379",
                             "train.backend=fsdp", "runtime.ray.nodes.trainer=rs_trainer",
                             "runtime.ray.nodes.engines=rs_engines",
                             "runtime.ray.nodes.rewards=rs_rewards"])
    assert cfg.runtime.ray.nodes.roles() == {"engines": "rs_engines", "trainer": "rs_trainer",
                                             "rewards": "rs_rewards"}
    # vLLM servers on other nodes: their actors write the weights on their node
    cfg = load_config(None, ["runtime.kind=ray", "runtime.ray.address=h:6379",
                             "engine.kind=vllm", "runtime.ray.weight_sync=auto",
                             "runtime.ray.nodes.engines=rs_engines"])
    assert (cfg.engine.kind, cfg.runtime.ray.weight_sync) == ("vllm", "auto")
