"""`dflash-serve bench-serve` as a function, against the session's Ray cluster: tiny settings, every
variant (server with speculation, server without, in-process engine), the report's structure, sane
numbers, no errors, and greedy server text equal to the in-process engine's. Flag checks need no
cluster."""

import json

import pytest

from conftest import exits_naming_the_flag
from engine.config import EngineConfig

LEVELS = [1, 2]
RANDOM_FIXED = EngineConfig(draft="random", dtype="float32", policy="fixed")  # a fixed block: drafts to count
PERCENTILE_KEYS = {"p50", "p90", "p99", "mean"}


@pytest.mark.slow
def test_bench_serve_report(serve_cluster, tmp_path):
    from ray import serve

    from deployments import bench_serve

    # 0.5 CPUs per replica (torch still gets one thread): both apps fit beside another test module's app
    cfg = bench_serve.ServeBenchConfig(concurrency=LEVELS, num_requests=2, max_tokens=8, engine=RANDOM_FIXED,
                                       num_cpus=0.5, json=str(tmp_path / "r.json"), plot=str(tmp_path / "r.png"))
    report = bench_serve.run(cfg, cluster_url=serve_cluster)

    assert set(serve.status().applications).isdisjoint(bench_serve.APP_NAMES.values())  # cleaned up
    saved = json.loads((tmp_path / "r.json").read_text())
    assert (tmp_path / "r.png").stat().st_size > 0
    assert set(saved["results"]) == set(cfg.variants) == set(bench_serve.VARIANTS) - {"server-disagg"}
    assert saved["config"]["topologies"]["disaggregated"].startswith("not measured")
    assert saved["config"]["drafter"] == "random" and saved["config"]["torch_threads"] == 1
    for variant, levels in report["results"].items():
        assert list(levels) == LEVELS
        for c, m in levels.items():
            where = f"{variant} x{c}"
            assert m["errors"] == 0 and m["completed"] == 2, (where, m["error_messages"])
            assert m["output_tokens"] > 0 and m["output_tokens_per_s"] > 0 and m["requests_per_s"] > 0, where
            for name in ("ttft_s", "tpot_s", "e2e_s", "itl_s"):
                assert set(m[name]) == PERCENTILE_KEYS and m[name]["p50"] > 0, (where, name)
                assert m[name]["p50"] <= m[name]["p90"] <= m[name]["p99"], (where, name)
            assert m["ttft_s"]["p99"] <= m["e2e_s"]["p99"], where
            if variant == "server-nospec":
                assert m["mean_acceptance_length"] is None and m["num_drafts"] == 0, where
            else:
                assert m["mean_acceptance_length"] >= 1 and m["num_drafts"] > 0, where
            if variant != "in-process":  # greedy: the server's text is the in-process engine's
                assert m["match_in_process"] == 1.0, (where, m["mismatched_requests"])
    ratios = report["key_ratios"]
    assert ratios["server/in-process @1"] > 0 and ratios["spec on/off (server) @2"] > 0
    assert ratios["server @2/@1"] > 0


@pytest.mark.slow
def test_bench_serve_disaggregated(serve_cluster, tmp_path):
    """The disaggregated topology (router, drafter and verifier deployments) beside the in-process engine:
    same greedy text, and its ratios in the report."""
    from ray import serve

    from deployments import bench_serve

    cfg = bench_serve.ServeBenchConfig(concurrency=[1], num_requests=2, max_tokens=8, engine=RANDOM_FIXED,
                                       num_cpus=0.5, variants=["server-disagg", "in-process"])
    report = bench_serve.run(cfg, cluster_url=serve_cluster)

    assert bench_serve.APP_NAMES["server-disagg"] not in serve.status().applications
    assert report["config"]["topologies"] == {"colocated": "not measured", "disaggregated": "measured"}
    m = report["results"]["server-disagg"][1]
    assert m["errors"] == 0 and m["completed"] == 2 and m["num_drafts"] > 0, m["error_messages"]
    assert m["match_in_process"] == 1.0, m["mismatched_requests"]
    assert report["key_ratios"]["disaggregated/in-process @1"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0,2"], "--concurrency must be a list of integers >= 1"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--variants", "server,foo"], "--variants: unknown or none: foo"),
    (["--variants", "server-disagg", "--url", "http://127.0.0.1:8000"], "--url: server-disagg deploys its own app"),
    (["--draft", "none"], "--draft none: the server is already without speculation"),
    (["--url", "http://10.1.2.3:8000"], "--url must be a loopback address"),
    (["--plot", "out.pdf"], "--plot must be a .png path"),
    (["--json", "/no/such/dir/r.json"], "--json /no/such/dir/r.json"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--num-prompts", "99"], "--num-prompts must be in 1..8"),
], ids=["concurrency", "concurrency-type", "num-requests", "max-tokens", "variants", "disagg-url",
        "draft-none", "url", "plot", "json", "temperature", "num-prompts"])
def test_bench_serve_bad_flags_fail_before_ray(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("deployments.bench_serve.run", lambda cfg: pytest.fail("ran despite a bad flag"))
    exits_naming_the_flag(capsys, ["bench-serve", *argv], message)
