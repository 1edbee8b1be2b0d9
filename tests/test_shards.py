"""Pipeline-sharded targets (deployments/shards.py): shards of a tiny random model chain to exactly the
whole model; an Engine over N=2 TargetShard actors on the loopback Ray cluster decodes exactly what the
unsharded target does (greedy batched with the default drafter, seeded sampling); the disaggregated app
with num_shards=2 answers the OpenAI client with the in-process engine's text, frees every slot, and
its shards' placement group goes with the app; bad shard settings fail by name.
"""

import asyncio
import time

import httpx
import pytest
import ray
import torch
from pydantic import ValidationError
from ray import serve

from conftest import deploy, openai_client
from deployments.app import build_app
from deployments.config import AppConfig
from deployments.shards import ShardedTarget, layer_ranges
from engine.config import EngineConfig, build_engine, load_models
from engine.engine import SamplingParams
from engine.model import load_target
from engine.prompts import DEFAULT_PROMPTS
from test_disaggregated import chat_text, reference, wait_for_no_state  # noqa: F401 (reference: a fixture)
from test_model import random_hf

SHARD_CPUS = 0.25  # the loopback cluster has 2 CPUs: shards of both the engine and the server tests fit


def test_layer_ranges_are_contiguous_and_even():
    assert layer_ranges(30, 1) == [(0, 30)]
    assert layer_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert layer_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]
    for bad in (0, 31):
        with pytest.raises(ValueError, match=f"num_shards must be between 1 and the target's 30 layers, got {bad}"):
            layer_ranges(30, bad)


@pytest.mark.parametrize("arch", ["llama3-tied", "llama"])
def test_one_layer_shards_chain_to_the_whole_model(arch, tmp_path):
    """N = number of layers: each shard loads only its layer (the first the embedding, the last the
    norm and LM head, a tied one from the embedding's weights); chained over a prefill and a block
    step with padding, they give the whole model's logits and features bit for bit."""
    random_hf(arch, num_hidden_layers=3).save_pretrained(tmp_path)
    whole = load_target(tmp_path)
    shards = [load_target(tmp_path, layers=r) for r in layer_ranges(3, 3)]
    assert [(s.embed_tokens is not None, len(s.layers), s.lm_head is not None) for s in shards] == \
        [(True, 1, False), (False, 1, False), (False, 1, True)]
    caches = [whole.new_cache(2, 32)] + [s.new_cache(2, 32) for s in shards]
    torch.manual_seed(0)
    feature_layers = (2, 0)
    steps = [  # (input ids, positions) for slots [1, 0]: a padded prefill, then a 4-token block
        (torch.randint(0, 256, (2, 6)), torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, -1, -1]])),
        (torch.randint(0, 256, (2, 4)), torch.tensor([[6, 7, 8, 9], [4, 5, 6, -1]])),
    ]
    with torch.inference_mode():
        for input_ids, positions in steps:
            kv_len = int(positions.max()) + 1
            want_logits, want_features = whole(input_ids, positions, caches[0], [1, 0], kv_len, feature_layers)
            x, features = input_ids, {}
            for shard, cache in zip(shards, caches[1:]):
                x, more = shard.forward_shard(x, positions, cache, [1, 0], kv_len, feature_layers)
                features.update(more)
            assert torch.equal(x, want_logits)
            assert torch.equal(torch.cat([features[i] for i in feature_layers], -1), want_features)


# ---- an Engine over shard actors ----------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)  # as in each shard: the same kernels, so the same bits
    return load_models(EngineConfig())


@pytest.fixture(scope="module")
def sharded(serve_cluster, models):
    from engine.model import TargetHead

    target = ShardedTarget(None, 2, models.dtype, num_cpus=SHARD_CPUS, head=TargetHead(models.target))
    yield target
    target.close()


def engine_outputs(target, models, prompts, params):
    engine = build_engine(EngineConfig(policy="fixed", max_slots=len(prompts)), models, target=target)
    done = engine.generate_batch(prompts, params)
    assert engine.target_cache.num_used == 0
    return [r.output_ids for r in done], engine.stats


@pytest.mark.slow
def test_sharded_engine_equals_unsharded(models, sharded):
    assert sharded.layer_ranges == [(0, 15), (15, 30)]
    prompts = [p.token_ids(models.tokenizer) for p in DEFAULT_PROMPTS[:4]]
    greedy = SamplingParams(max_tokens=24)
    want, _ = engine_outputs(models.target, models, prompts, greedy)
    got, stats = engine_outputs(sharded, models, prompts, greedy)
    assert got == want
    assert stats.num_accepted_tokens > 0  # the drafter's blocks were verified through the shards
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=11)
    want, _ = engine_outputs(models.target, models, prompts[:1], seeded)
    assert engine_outputs(sharded, models, prompts[:1], seeded)[0] == want


@pytest.mark.slow
def test_a_lost_shard_fails_the_health_check(sharded):
    """What a replica's check_health awaits: Serve then replaces the replica, its shards and placement group."""
    asyncio.run(sharded.check())
    ray.kill(sharded.shards[1])  # asynchronous: a check right after it can still reach the shard
    deadline = time.monotonic() + 30
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            asyncio.run(sharded.check())
            time.sleep(0.2)


# ---- the disaggregated app with a sharded verifier ----------------------------------------

APP_NAME = "dflash-shards-test"
PREFIX = "/shards"
CONFIG = AppConfig(policy="fixed", topology="disaggregated", dtype="float32", max_slots=2, num_cpus=0.5, drafter_num_cpus=0.5,
                   num_shards=2, shard_num_cpus=SHARD_CPUS)
CHAT_PROMPT = "Write a haiku about the sea."


def shard_groups() -> list[dict]:
    """The live placement groups with a shard bundle."""
    return [g for g in ray.util.placement_group_table().values()
            if g["state"] != "REMOVED" and {"CPU": SHARD_CPUS} in g["bundles"].values()]


@pytest.fixture(scope="module")
def server(serve_cluster):
    yield deploy(build_app(CONFIG), APP_NAME, serve_cluster, PREFIX)
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def handles(server):
    return {name: serve.get_deployment_handle(name, APP_NAME) for name in ("Router", "DrafterReplica", "VerifierReplica")}


@pytest.mark.slow
def test_sharded_verifier_serves_the_engine_text_and_frees_everything(server, handles, reference, sharded):
    groups = [g for g in shard_groups() if len(g["bundles"]) == 3]  # the verifier replica + its 2 shards
    assert len(groups) == 1 and groups[0]["strategy"] == "PACK"
    assert handles["VerifierReplica"].info.remote().result().num_shards == 2
    client = openai_client(server)
    want = reference.text(reference.chat_ids(CHAT_PROMPT))
    assert chat_text(client, CHAT_PROMPT, temperature=0) == want
    assert chat_text(client, CHAT_PROMPT, stream=True, temperature=0) == want
    wait_for_no_state(handles)

    body = {"model": CONFIG.model_name, "messages": [{"role": "user", "content": CHAT_PROMPT}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:  # leaves mid-stream
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
    wait_for_no_state(handles)

    serve.delete(APP_NAME)  # the replica's placement group, and with it the shards, go with the app
    deadline = time.monotonic() + 10
    while [g for g in shard_groups() if len(g["bundles"]) == 3]:
        assert time.monotonic() < deadline, "the sharded verifier's placement group outlived its app"
        time.sleep(0.2)


# ---- bad settings -------------------------------------------------------------------------


def test_bad_shard_settings_fail_by_name():
    with pytest.raises(ValidationError, match="num_shards"):
        AppConfig(num_shards=0)
    with pytest.raises(ValidationError, match="shard_placement"):
        AppConfig(shard_placement="DIAGONAL")
    with pytest.raises(ValidationError, match="shard_num_cpus"):
        AppConfig(shard_num_cpus=0)
    with pytest.raises(ValidationError, match="shard_num_gpus > 0"):
        AppConfig(device="cuda", num_gpus=1, num_shards=2)
    for topology in ("disaggregated", "colocated"):
        with pytest.raises(ValueError, match="num_shards must be between 1 and the target's 30 layers, got 31"):
            build_app(AppConfig(topology=topology, num_shards=31))
