"""cluster/ and scripts/local_cluster.sh: each file's structure (the YAML loads, has what its tool needs,
its Serve config matches AppConfig), and the loopback Serve config really deployed with `serve deploy`
to a two-node local cluster started by the test, answered, shut down and stopped; then the disaggregated
topology placed across a three-node one (drafter on one node, the verifier's two shards SPREAD over the
other two, seen through Ray's state API) answering the official openai client with a one-node engine's text.
"""

import json
import os
import subprocess
import time
from dataclasses import fields
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import ROOT, free_port, openai_client
from deployments.app import target_placement
from deployments.config import AppConfig
from engine.config import EngineConfig
from test_disaggregated import reference  # noqa: F401 (a fixture: the in-process engine on one node)

CLUSTER = ROOT / "cluster"
SCRIPT = ROOT / "scripts" / "local_cluster.sh"
BIN = ROOT / ".venv" / "bin"


def serve_schema(raw: dict):
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema.model_validate(raw)


def app_args(raw: dict) -> dict:
    (application,) = serve_schema(raw).applications
    assert application.import_path == "deployments.app:build_app"
    return application.args


# ---- structure --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config_gpu.yaml"])
def test_serve_configs_list_every_appconfig_field(name):
    args = app_args(yaml.safe_load((CLUSTER / name).read_text()))
    assert set(args) == set(AppConfig.model_fields), "args and AppConfig's fields differ"
    assert set(args["engine"]) == {f.name for f in fields(EngineConfig)}, "engine and EngineConfig's fields differ"
    if name == "serve_config_gpu.yaml":
        engine = args["engine"]
        assert Path(engine["target"]).is_absolute() and Path(engine["draft"]).is_absolute()
        args = {**args, "engine": {**engine, "target": None, "draft": "random"}}  # on the GPU nodes only
    config = AppConfig.model_validate(args)
    assert config.api_keys == []  # keys never live in a checked-in file


def test_loopback_serve_config_binds_only_loopback():
    schema = serve_schema(yaml.safe_load((CLUSTER / "serve_config.yaml").read_text()))
    assert schema.http_options.host == "127.0.0.1"
    assert schema.proxy_location == "HeadOnly"  # several local nodes on one machine share one port


def test_gpu_serve_config_fits_the_gpu_nodes():
    args = app_args(yaml.safe_load((CLUSTER / "serve_config_gpu.yaml").read_text()))
    assert args["engine"]["device"] == "cuda" and args["num_gpus"] == 1
    launcher = yaml.safe_load((CLUSTER / "ray_cluster_aws.yaml").read_text())
    gpu = launcher["available_node_types"]["gpu_worker"]
    assert gpu["resources"]["GPU"] >= args["num_gpus"] and gpu["resources"]["CPU"] >= args["num_cpus"]
    assert args["autoscaling_config"]["max_replicas"] == gpu["max_workers"]


def test_ray_cluster_launcher_yaml_passes_rays_own_schema():
    import jsonschema
    import ray

    config = yaml.safe_load((CLUSTER / "ray_cluster_aws.yaml").read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    assert config["provider"]["type"] == "aws"
    assert config["head_node_type"] in config["available_node_types"]
    assert config["available_node_types"]["head"]["resources"]["GPU"] == 0
    assert any("--head" in c for c in config["head_start_ray_commands"])
    assert all("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"] if "--head" in c)
    assert any("pip install" in c and ".[serve]" in c for c in config["setup_commands"])


def test_kuberay_rayservice_embeds_the_gpu_serve_config():
    manifest = yaml.safe_load((CLUSTER / "kuberay_rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve_config == yaml.safe_load((CLUSTER / "serve_config_gpu.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == __import__("ray").__version__
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (worker,) = cluster["workerGroupSpecs"]
    (container,) = worker["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == serve_config["applications"][0]["args"]["num_gpus"]
    assert worker["maxReplicas"] == serve_config["applications"][0]["args"]["autoscaling_config"]["max_replicas"]
    for pod in (head["template"]["spec"], worker["template"]["spec"]):  # keys from a Secret, models mounted
        (c,) = pod["containers"]
        assert {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"]} == \
            {"DFLASH_API_KEYS": "dflash-api-keys"}
        assert any(m["mountPath"] == "/models" for m in c["volumeMounts"])


def test_local_cluster_script_is_valid_bash_and_never_runs_a_bare_ray_stop():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert "ray stop" not in "\n".join(line for line in SCRIPT.read_text().splitlines()
                                       if not line.lstrip().startswith("#"))
    r = subprocess.run([str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr


# ---- custom resources: where replicas and shards may go ------------------------------------------------


def test_custom_resources_reach_the_replicas_and_their_placement_group_bundles():
    config = AppConfig(num_cpus=0.5, resources={"dflash_node_0": 0.01}, num_shards=2, shard_num_cpus=0.25,
                       shard_resources={"gpu_host": 1}, shard_placement="SPREAD")
    options = target_placement(config)
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0, "resources": {"dflash_node_0": 0.01}}
    assert options["placement_group_bundles"] == [{"CPU": 0.5, "dflash_node_0": 0.01}] + \
        [{"CPU": 0.25, "gpu_host": 1}] * 2
    assert options["placement_group_strategy"] == "SPREAD"
    assert "resources" not in target_placement(AppConfig())["ray_actor_options"]  # none asked, none passed
    cli = AppConfig.model_validate({"resources": '{"a": 1}', "drafter_resources": '{"b": 0.5}', "shard_resources": "{}",
                                    "drafter_autoscaling_config": '{"max_replicas": 2}'})  # key=value: strings
    assert (cli.resources, cli.drafter_resources, cli.shard_resources) == ({"a": 1}, {"b": 0.5}, {})
    assert cli.drafter_autoscaling_config == {"max_replicas": 2}


@pytest.mark.parametrize("field, value, message", [
    ("resources", {"CPU": 1}, "resources: CPU is set with num_cpus"),
    ("drafter_resources", {"GPU": 1}, "drafter_resources: GPU is set with drafter_num_gpus"),
    ("shard_resources", {"CPU": 1}, "shard_resources: CPU is set with shard_num_cpus"),
    ("resources", {"dflash_node_0": 0}, "resources: dflash_node_0 must be at least 0.0001, got 0"),
    ("drafter_resources", {"x": -1}, "drafter_resources: x must be at least 0.0001"),
    ("shard_resources", {" ": 1}, "shard_resources: a resource needs a name"),
    ("resources", "{nope", "resources: not a JSON object"),
    ("drafter_resources", {"x": "many"}, "drafter_resources"),
])
def test_bad_custom_resources_fail_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        AppConfig(**{field: value})


# ---- serve deploy to a local multi-node cluster --------------------------------------------------------


def cluster_ports(num_nodes: int) -> tuple[int, int]:
    """A free GCS port and a free dashboard port for scripts/local_cluster.sh, which derives every node's other
    ports from the GCS port up to 1,200 + 200 per node above it: the dashboard's must not fall among them (a
    dashboard port drawn inside the worker port range failed `ray start`), nor may they pass 65535."""
    span = 1200 + 200 * num_nodes
    while True:
        gcs, dashboard = free_port(), free_port()
        if gcs + span <= 65535 and not gcs <= dashboard < gcs + span:
            return gcs, dashboard


@pytest.fixture
def local_cluster(request):
    """scripts/local_cluster.sh with its own short temp dir and free ports, one CPU per node, and 2 nodes
    (or request.param: parametrize with indirect=True); yields (env, dashboard URL), then stops exactly
    its processes and checks that none is left."""
    num_nodes = getattr(request, "param", 2)
    run_dir = Path(f"/tmp/dfc-{os.getpid()}")  # short: Ray puts unix sockets under it
    gcs, dashboard = cluster_ports(num_nodes)
    env = {**os.environ, "DFLASH_CLUSTER_DIR": str(run_dir), "DFLASH_CLUSTER_PORT": str(gcs),
           "DFLASH_CLUSTER_DASHBOARD_PORT": str(dashboard), "DFLASH_CLUSTER_CPUS": "1", "RAY_AUTH_MODE": "token",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    start = subprocess.run([str(SCRIPT), "start", str(num_nodes)], env=env, capture_output=True, text=True,
                           timeout=180)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        status = subprocess.run([str(SCRIPT), "status"], env=env, capture_output=True, text=True, timeout=60)
        assert all(f"dflash_node_{i}" in status.stdout for i in range(num_nodes)), status.stdout
        yield env, f"http://127.0.0.1:{env['DFLASH_CLUSTER_DASHBOARD_PORT']}"
    finally:
        stop = subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        left = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
        assert f"{run_dir}/session_" not in left, "processes of the local cluster are still running"


def serve_deploy(raw: dict, tmp_path, env, dashboard) -> str:
    """`serve deploy` the config `raw` (its HTTP on a free loopback port) and wait until /health answers 200;
    returns the base URL. The caller runs serve_shutdown in a finally."""
    port = free_port()
    raw["http_options"]["port"] = port
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    deploy = subprocess.run([str(BIN / "serve"), "deploy", str(config_path), "-a", dashboard], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                return base
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, subprocess.run(
            [str(BIN / "serve"), "status", "-a", dashboard], env=env, capture_output=True, text=True).stdout
        time.sleep(2)


def serve_shutdown(env, dashboard):
    shutdown = subprocess.run([str(BIN / "serve"), "shutdown", "-a", dashboard, "-y"], env=env, capture_output=True,
                              text=True, timeout=120)
    assert shutdown.returncode == 0, shutdown.stderr


@pytest.mark.slow
def test_serve_deploy_to_a_local_two_node_cluster_answers(local_cluster, tmp_path):
    env, dashboard = local_cluster
    raw = yaml.safe_load((CLUSTER / "serve_config.yaml").read_text())  # the file as checked in, on a free port
    serve = str(BIN / "serve")
    try:
        base = serve_deploy(raw, tmp_path, env, dashboard)
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": raw["applications"][0]["args"]["model_name"], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        status = subprocess.run([serve, "status", "-a", dashboard], env=env, capture_output=True, text=True)
        assert "RUNNING" in status.stdout, status.stdout
    finally:
        serve_shutdown(env, dashboard)


# The disaggregated topology on three one-CPU nodes. The drafter and the verifier replica (which keeps only
# the slot bookkeeping) are pinned to node 0 and fill its CPU, so the two shards must go to the workers:
# SPREAD puts them on one each (PACK puts both on one worker: this test then fails).
PLACED_ENGINE = {"policy": "fixed", "dtype": "float32", "max_slots": 2}
PLACED_ARGS = {
    "topology": "disaggregated", "max_ongoing_requests": None,
    "num_replicas": 1, "autoscaling_config": None, "num_cpus": 0.5, "resources": {"dflash_node_0": 0.01},
    "num_shards": 2, "shard_placement": "SPREAD", "shard_num_cpus": 0.5,
    "drafter_num_cpus": 0.5, "drafter_resources": {"dflash_node_0": 0.01},
}
PLACED_PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?", "Name three colours."]
PLACED_MAX_TOKENS = 16


def ray_list(kind: str, env, dashboard, *filters: str) -> list[dict]:
    """`ray list <kind> --detail` through the cluster's dashboard (Ray's state API), as JSON."""
    args = [str(BIN / "ray"), "list", kind, "--address", dashboard, "--detail", "--format", "json"]
    out = subprocess.run(args + [a for f in filters for a in ("-f", f)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("local_cluster", [3], indirect=True)
def test_disaggregated_shards_spread_over_nodes_answer_like_one_node(local_cluster, reference, tmp_path):
    env, dashboard = local_cluster
    raw = yaml.safe_load((CLUSTER / "serve_config.yaml").read_text())
    args = raw["applications"][0]["args"]
    args.update(PLACED_ARGS)
    args["engine"].update(PLACED_ENGINE)
    try:
        base = serve_deploy(raw, tmp_path, env, dashboard)
        node_names = {n["node_id"]: next(r for r in n["resources_total"] if r.startswith("dflash_node_"))
                      for n in ray_list("nodes", env, dashboard)}
        actors = ray_list("actors", env, dashboard, "state=ALIVE")

        def where(class_name: str) -> list[dict]:
            return [a for a in actors if a["class_name"] == class_name]

        shards = where("TargetShard")
        (verifier,) = where("ServeReplica:dflash:VerifierReplica")
        (drafter,) = where("ServeReplica:dflash:DrafterReplica")
        assert len(shards) == 2 and {s["placement_group_id"] for s in shards} == {verifier["placement_group_id"]}
        (group,) = ray_list("placement-groups", env, dashboard, f"placement_group_id={verifier['placement_group_id']}")
        bundles = sorted(group["bundles"], key=lambda b: b["bundle_id"]["bundle_index"])
        assert [b["unit_resources"] for b in bundles] == \
            target_placement(AppConfig.model_validate(args))["placement_group_bundles"]  # the replica's, 2 shards'
        assert bundles[0]["node_id"] == verifier["node_id"]
        assert {b["node_id"] for b in bundles[1:]} == {s["node_id"] for s in shards}
        shard_nodes = [node_names[s["node_id"]] for s in shards]
        assert len(set(shard_nodes)) == 2, f"both shards on {shard_nodes[0]}"
        assert node_names[drafter["node_id"]] not in shard_nodes
        assert (node_names[drafter["node_id"]], node_names[verifier["node_id"]], sorted(shard_nodes)) == \
            ("dflash_node_0", "dflash_node_0", ["dflash_node_1", "dflash_node_2"])

        want = [reference.text(reference.chat_ids(p), max_tokens=PLACED_MAX_TOKENS) for p in PLACED_PROMPTS]
        client, num_drafts = openai_client(base), 0
        request = {"model": args["model_name"], "max_tokens": PLACED_MAX_TOKENS, "temperature": 0}
        for prompt, text in zip(PLACED_PROMPTS, want):
            out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **request)
            assert out.choices[0].message.content == text
            num_drafts += out.usage.model_extra["spec_decoding"]["num_drafts"]
        assert num_drafts > 0  # the drafter on node 0 drafted blocks that the shards on nodes 1 and 2 verified
        stream = client.chat.completions.create(messages=[{"role": "user", "content": PLACED_PROMPTS[0]}], stream=True,
                                                **request)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want[0]
    finally:
        serve_shutdown(env, dashboard)
