"""cluster/ and scripts/local_cluster.sh: each file's structure (the YAML loads, has what its tool needs,
its Serve config matches AppConfig), and the loopback Serve config really deployed with `serve deploy`
to a two-node local cluster started by the test, answered, shut down and stopped.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import ROOT, free_port
from deployments.config import AppConfig

CLUSTER = ROOT / "cluster"
SCRIPT = ROOT / "scripts" / "local_cluster.sh"
CHECKPOINTS = {"target", "draft"}  # folders on the GPU nodes, absent here


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
    if name == "serve_config_gpu.yaml":
        assert Path(args["target"]).is_absolute() and Path(args["draft"]).is_absolute()
        args = {**args, "target": None, "draft": "random"}  # the checkpoints exist on the GPU nodes only
    config = AppConfig.model_validate(args)
    assert config.api_keys == []  # keys never live in a checked-in file


def test_loopback_serve_config_binds_only_loopback():
    schema = serve_schema(yaml.safe_load((CLUSTER / "serve_config.yaml").read_text()))
    assert schema.http_options.host == "127.0.0.1"
    assert schema.proxy_location == "HeadOnly"  # several local nodes on one machine share one port


def test_gpu_serve_config_fits_the_gpu_nodes():
    args = app_args(yaml.safe_load((CLUSTER / "serve_config_gpu.yaml").read_text()))
    assert args["device"] == "cuda" and args["num_gpus"] == 1
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


# ---- serve deploy to a local two-node cluster --------------------------------------------------------


@pytest.fixture
def local_cluster(tmp_path_factory):
    """scripts/local_cluster.sh with its own short temp dir and free ports; yields (env, dashboard URL),
    then stops exactly its processes and checks that none is left."""
    run_dir = Path(f"/tmp/dfc-{os.getpid()}")  # short: Ray puts unix sockets under it
    env = {**os.environ, "DFLASH_CLUSTER_DIR": str(run_dir), "DFLASH_CLUSTER_PORT": str(free_port()),
           "DFLASH_CLUSTER_DASHBOARD_PORT": str(free_port()), "RAY_AUTH_MODE": "token",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    start = subprocess.run([str(SCRIPT), "start", "2"], env=env, capture_output=True, text=True, timeout=180)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        status = subprocess.run([str(SCRIPT), "status"], env=env, capture_output=True, text=True, timeout=60)
        assert "dflash_node_0" in status.stdout and "dflash_node_1" in status.stdout, status.stdout
        yield env, f"http://127.0.0.1:{env['DFLASH_CLUSTER_DASHBOARD_PORT']}"
    finally:
        stop = subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        left = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
        assert f"{run_dir}/session_" not in left, "processes of the local cluster are still running"


@pytest.mark.slow
def test_serve_deploy_to_a_local_two_node_cluster_answers(local_cluster, tmp_path):
    env, dashboard = local_cluster
    raw = yaml.safe_load((CLUSTER / "serve_config.yaml").read_text())
    port = free_port()
    raw["http_options"]["port"] = port  # the file as checked in, on a free port
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    serve = str(ROOT / ".venv" / "bin" / "serve")
    deploy = subprocess.run([serve, "deploy", str(config_path), "-a", dashboard], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, subprocess.run(
                [serve, "status", "-a", dashboard], env=env, capture_output=True, text=True).stdout
            time.sleep(2)
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": raw["applications"][0]["args"]["model_name"], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        status = subprocess.run([serve, "status", "-a", dashboard], env=env, capture_output=True, text=True)
        assert "RUNNING" in status.stdout, status.stdout
    finally:
        shutdown = subprocess.run([serve, "shutdown", "-a", dashboard, "-y"], env=env, capture_output=True,
                                  text=True, timeout=120)
        assert shutdown.returncode == 0, shutdown.stderr
