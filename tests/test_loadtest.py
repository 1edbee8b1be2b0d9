"""`dflash-serve loadtest`: the traffic it builds (real ShareGPT conversations, BM25 retrieval over the
stdlib's docstrings, agent tasks with real tool results), and bounded Locust runs of every scenario
against real server apps on the session's Ray cluster (speculation off, a fixed block, adaptive),
with the report it writes. Flag checks need no cluster."""

import json
import math
import random

import pytest

from conftest import exits_naming_the_flag


def test_traffic_is_real_and_held_out(tmp_path):
    from engine.datagen import PromptItem, sharegpt_conversations
    from loadtest import scenarios

    data = scenarios.build(tmp_path / "s.json", num_items=30)
    assert json.loads((tmp_path / "s.json").read_text()) == data

    # chat: multi-turn conversations of ShareGPT's held-out split, turns as packaged (cut to a length)
    held_out = {t["value"].strip()[: scenarios.MAX_TURN_CHARS] for c in sharegpt_conversations()
                if PromptItem(f"sharegpt/{c['id']}", "sharegpt", "").held_out
                for t in c["conversations"] if t.get("from") == "human"}
    assert len(data["chat"]) >= 50
    for turns in data["chat"]:
        assert 2 <= len(turns) <= scenarios.MAX_TURNS and set(turns) <= held_out

    # rag: the passages are what BM25 ranks first for the question, and by-name questions find their function
    retriever = scenarios.Retriever(scenarios.stdlib_passages())
    assert len(retriever.passages) > 1000
    found_by_name = []
    for item in data["rag"]:
        assert [p["title"] for p in retriever.search(item["question"], scenarios.RAG_PASSAGES)] == item["passages"]
        assert item["question"] in item["prompt"] and all(f"[{i + 1}]" in item["prompt"] for i in range(4))
        if item["question"].startswith("What does `"):
            found_by_name.append(item["question"].split("`")[1] in item["passages"])
    assert sum(found_by_name) >= 0.6 * len(found_by_name), found_by_name

    # agent: tools as JSON schemas in the system prompt; each observation is the real tool result
    assert all(json.dumps(t["name"]) in data["agent"]["system"] for t in scenarios.TOOLS)
    for t in data["agent"]["tasks"]:
        call, observation = t["call"], json.loads(t["observation"])
        if call["tool"] == "calculator":
            assert observation["result"] == eval(call["arguments"]["expression"], {"__builtins__": {}})
        elif call["tool"] == "http_status":
            from http import HTTPStatus

            assert observation["phrase"] == HTTPStatus(call["arguments"]["code"]).phrase
        else:
            assert [o["title"] for o in observation] == [p["title"] for p in retriever.search(
                call["arguments"]["query"], 3)]
    with pytest.raises(ValueError, match="not arithmetic"):
        scenarios.calculate("__import__('os')")

    # the one-process scripts' conversations: the same traffic, turn by turn, as the users send it
    held = {s: scenarios.conversations(s, 3) for s in ("chat", "rag", "agent")}
    assert [[t[0].content for t in c] for c in held["chat"]] == data["chat"][:3]
    assert all(len(c) == 1 and c[0][0].content.startswith("Answer the question using") for c in held["rag"])
    for c in held["agent"]:
        assert [[m.role for m in turn] for turn in c] == [["system", "user"], ["tool"]]
        assert c[0][0].content == scenarios.AGENT_SYSTEM
    assert [t["observation"] for t in scenarios.agent_tasks(retriever, 3, random.Random(scenarios.SEED))] \
        == [c[1][0].content for c in held["agent"]]
    first = scenarios.first_turns("agent", 3)
    assert [p.messages for p in first] == [c[0] for c in held["agent"]]


def test_median_run_of_repeats():
    from loadtest.run import median_run

    runs = [{"output_tokens_per_s": t, "requests": 3, "failures": f, "tag": t} for t, f in ((30, 0), (10, 1), (20, 0))]
    cell = median_run(runs)
    assert cell["tag"] == 20 and cell["tokens_per_s_runs"] == [30, 10, 20]
    assert cell["requests"] == 9 and cell["failures"] == 1
    assert median_run(runs[:1]) == {**runs[0], "tokens_per_s_runs": [30]}  # one run still pools with the others


def test_adaptive_is_compared_repeat_by_repeat():
    from loadtest.run import comparisons

    def cell(runs):
        return {"output_tokens_per_s": sorted(runs)[1], "tokens_per_s_runs": runs, "latency_ms": {}}

    cells = {"ar": cell([5, 5, 5]), "b2": cell([9, 13, 10]), "b4": cell([10, 11, 12]), "adaptive": cell([10, 12, 11])}
    row = comparisons({"chat": {4: cells}})["chat"][4]
    assert row["best_fixed"] == "b4" and row["adaptive_vs_best_fixed"] == 1.0  # medians: 11 against 11
    assert row["adaptive_vs_best_fixed_by_repeat"] == [1.0, 12 / 13, 11 / 12]  # each repeat's own best fixed block


def test_pooled_over_repeats_against_blocks_chosen_three_ways():
    from loadtest.run import pooled

    def cell(runs):
        return {"tokens_per_s_runs": runs}

    results = {"chat": {1: {"ar": cell([5, 5, 5]), "b2": cell([9, 13, 10]), "b4": cell([10, 11, 12]),
                            "adaptive": cell([10, 12, 11])}},
               "rag": {1: {"ar": cell([4, 4]), "b2": cell([8, 8]), "b4": cell([4, 4]), "adaptive": cell([8, 8])}}}
    pool = pooled(results)
    geo = lambda xs: math.prod(xs) ** (1 / len(xs))  # noqa: E731
    assert pool["same_repeat"]["n"] == 5
    assert pool["same_repeat"]["geomean"] == pytest.approx(geo([10 / 10, 12 / 13, 11 / 12, 1, 1]))
    # chat, from the other two repeats: b2 23 = b4 23 (the first listed wins ties), b4 22 > b2 19, b2 22 > b4 21
    assert pool["chosen_ahead"]["geomean"] == pytest.approx(geo([10 / 9, 12 / 11, 11 / 10, 1, 1]))
    assert pool["one_block"]["block"] == "b2"
    assert pool["one_block"]["geomean"] == pytest.approx(geo([10 / 9, 12 / 13, 11 / 10, 1, 1]))
    assert pool["ar"]["geomean"] == pytest.approx(geo([2, 12 / 5, 11 / 5, 2, 2]))
    one_run = {s: {1: {v: cell(c["tokens_per_s_runs"][:1]) for v, c in cells[1].items()}} for s, cells in results.items()}
    assert "chosen_ahead" not in pooled(one_run) and pooled(one_run)["same_repeat"]["n"] == 2  # no other repeats
    for g in pool.values():
        assert g["low"] <= g["geomean"] <= g["high"]
    assert pooled({"chat": {1: {"b2": cell([1, 2]), "adaptive": cell([1])}}}) is None  # unpaired repeats


def test_resume_reads_finished_runs_and_refuses_other_flags(tmp_path):
    """A resumed sweep reads a run's summary back instead of starting Locust (the URL here serves
    nothing, so a Locust run would fail), and refuses flags that differ from the runs it finds."""
    from loadtest.run import LoadTestConfig, check_config, run_cell, settings

    cfg = LoadTestConfig(scenarios=["chat"], users=[2], variants=["b2"], out=str(tmp_path), resume=True)
    summary = {"chat": {"requests": 8, "failures": 0, "output_tokens": 400, "num_drafts": 100,
                        "num_accepted_tokens": 50, "block_sizes": {"2": 100}}, "_wall": {"start": 10.0, "end": 30.0}}
    (tmp_path / "chat-u2-b2-r1.json").write_text(json.dumps(summary))
    cell = run_cell(cfg, "chat", 2, "b2", "http://127.0.0.1:9", tmp_path, tmp_path / "none.json", repeat=1)
    assert cell["output_tokens_per_s"] == 20.0 and cell["mean_acceptance_length"] == 1.5
    (tmp_path / "config.json").write_text(json.dumps(settings(cfg)))
    assert check_config(cfg) is None
    problem = check_config(LoadTestConfig(scenarios=["chat"], users=[2, 4], variants=["b2"], max_tokens=32,
                                          out=str(tmp_path), resume=True))
    assert "--users" in problem and "--max-tokens" in problem and "--scenarios" not in problem
    again = run_cell(LoadTestConfig(out=str(tmp_path), run_time=1), "chat", 2, "b2", "http://127.0.0.1:9", tmp_path,
                     tmp_path / "none.json", repeat=1)  # without --resume the run is made again: nothing served
    assert again["output_tokens"] == 0 and json.loads((tmp_path / "chat-u2-b2-r1.json").read_text()) != summary


def test_json_replies_are_found_in_prose():
    from loadtest.replies import parse_json_object

    assert parse_json_object('Sure! ```json\n{"tool": "calculator", "arguments": {"expression": "1+1"}}\n```') == \
        {"tool": "calculator", "arguments": {"expression": "1+1"}}
    assert parse_json_object("{not json} then {\"answer\": \"42\"}") == {"answer": "42"}
    assert parse_json_object("no object [1, 2]") is None


@pytest.mark.slow
def test_loadtest_every_scenario_without_failures(serve_cluster, tmp_path):
    """Real Locust processes, real openai clients, real apps (ar, fixed block 2, adaptive, dflash+suffix with
    API keys on, a key per run): every scenario at 2 users, bounded by requests; 0 failures; the report's
    figures are consistent."""
    from ray import serve

    from loadtest import run

    cfg = run.LoadTestConfig(scenarios=["chat", "rag", "agent"], users=[2],
                             variants=["ar", "b2", "adaptive", "dflash+suffix"], run_time=20, max_requests=3,
                             max_tokens=8, num_cpus=0.3, out=str(tmp_path / "report"))
    report = run.run(cfg, cluster_url=serve_cluster)

    assert not any(name.startswith("loadtest-") for name in serve.status().applications)  # cleaned up
    out = tmp_path / "report"
    assert (out / "loadtest.png").stat().st_size > 0
    assert json.loads((out / "report.json").read_text())["results"].keys() == {"chat", "rag", "agent"}
    md = (out / "report.md").read_text()
    assert "## chat" in md and "## agent" in md and "Failures in all runs: 0." in md and "max_tokens 8," in md
    assert json.loads((out / "config.json").read_text())["users"] == [2]  # what --resume checks
    for scenario, by_users in report["results"].items():
        for variant, cell in by_users[2].items():
            where = f"{scenario} {variant}"
            assert cell["failures"] == 0 and 3 <= cell["requests"] <= 3 + 1, (where, cell)  # bounded: 3 + in flight
            assert cell["output_tokens_per_s"] > 0, where
            lat = cell["latency_ms"]
            assert lat["E2E"]["count"] == cell["requests"] and lat["E2E"]["failures"] == 0, where
            assert lat["TTFT"]["count"] >= cell["requests"], where  # a request cut at the bound may have a TTFT
            assert 0 < lat["TTFT"]["p50"] <= lat["E2E"]["p99"], where
            assert 0 < lat["TPOT"]["p50"] <= lat["TPOT"]["p90"], where
            drafted = any(int(block) > 1 and n for block, n in cell["block_sizes"].items())
            if variant == "ar":
                assert set(cell["block_sizes"]) <= {"1"}, where
            # The adaptive policy may choose block 1 for every step (slow drafter, short answers): no drafts then.
            if drafted:
                assert cell["mean_acceptance_length"] >= 1, where
            else:
                assert cell["mean_acceptance_length"] is None and variant != "b2", where
            if variant == "b2":
                assert set(cell["block_sizes"]) <= {"1", "2"} and cell["block_sizes"].get("2"), where
            if scenario == "agent":
                assert cell["json_expected"] == cell["requests"], where
        cmp = report["comparisons"][scenario][2]
        assert cmp["best_fixed"] == "b2" and cmp["adaptive_vs_best_fixed"] > 0
        assert cmp["b2"]["tokens_per_s_x"] > 0 and cmp["adaptive"]["tpot_x"] > 0


@pytest.mark.slow
def test_locust_by_its_own_convention_builds_the_traffic_on_first_use(serve_cluster, tmp_path):
    """`locust -f loadtest/locustfile.py --host URL --headless ... RagUser`, with no --scenario-file: the traffic
    is built into the cache directory on first use and the users run against a real server."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ray import serve

    from conftest import ROOT, deploy
    from deployments.app import build_app
    from deployments.config import AppConfig

    url = deploy(build_app(AppConfig(draft="none", dtype="float32", max_slots=2, num_cpus=0.3)), "locust-own",
                 serve_cluster, "/locust-own")
    try:
        env = dict(os.environ, DFLASH_SERVE_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
        locust = Path(sys.executable).parent / "locust"
        r = subprocess.run([str(locust), "-f", "loadtest/locustfile.py", "--host", url, "--headless", "-u", "1", "-t",
                            "60s", "--max-requests", "2", "--max-tokens", "4", "--summary-json",
                            str(tmp_path / "summary.json"), "RagUser"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert list((tmp_path / "cache" / "loadtest").glob("scenarios-*.json"))
        rag = json.loads((tmp_path / "summary.json").read_text())["rag"]
        assert rag["requests"] >= 2 and rag["failures"] == 0, rag
    finally:
        serve.delete("locust-own")


@pytest.mark.parametrize("command, argv, message", [
    ("loadtest", ["--scenarios", "chat,video"], "--scenarios: unknown or none: video"),
    ("loadtest", ["--users", "0,4"], "--users must be a list of integers >= 1"),
    ("loadtest", ["--variants", "ar,b0"], "--variants: unknown or none: b0"),
    ("loadtest", ["--variants", "fast"], "--variants: unknown or none: fast"),
    ("loadtest", ["--run-time", "0"], "--run-time must be > 0"),
    ("loadtest", ["--max-requests", "0"], "--max-requests must be >= 1"),
    ("loadtest", ["--requests-per-user", "-1"], "--requests-per-user must be >= 0"),
    ("loadtest", ["--min-requests", "-1"], "--min-requests must be >= 0"),
    ("loadtest", ["--repeats", "0"], "--repeats must be >= 1"),
    ("loadtest", ["--shape", "poisson", "--think-time", "0"], "--think-time must be > 0"),
    ("loadtest", ["--url", "http://10.0.0.1:8000"], "--url must be a loopback address"),
    ("loadtest", ["--out", "/nonexistent/folder/report"], "--out /nonexistent/folder/report: the folder"),
    ("loadtest", ["--draft", "/nonexistent"], "--draft /nonexistent: no drafter there"),
    ("soak", ["--minutes", "0"], "--minutes must be > 0"),
    ("soak", ["--users", "0"], "--users must be >= 1"),
    ("soak", ["--sample-every", "-1"], "--sample-every must be > 0"),
    ("soak", ["--max-slots", "0"], "--max-slots must be >= 1"),
    ("lockstep", ["--scenarios", "chat,video"], "--scenarios: unknown or none: video"),
    ("lockstep", ["--variants", "b2,fast"], "--variants: unknown or none: fast"),
    ("lockstep", ["--batch", "0"], "--batch must be >= 1"),
    ("lockstep", ["--max-block", "0"], "--max-block must be >= 1"),
    ("lockstep", ["--draft", "/nonexistent"], "--draft /nonexistent: no drafter there"),
])
def test_bad_flags_fail_naming_the_flag(command, argv, message, capsys):
    exits_naming_the_flag(capsys, [command, *argv], message)


def test_request_limit_per_user_with_a_floor():
    """--requests-per-user scales a run with its users; --min-requests keeps 1-user runs from being a few seconds."""
    from loadtest.run import LoadTestConfig, request_limit

    cfg = LoadTestConfig(requests_per_user=4, min_requests=16, max_requests=50)
    assert [request_limit(cfg, u) for u in (1, 4, 16)] == [16, 16, 50]
    assert request_limit(LoadTestConfig(requests_per_user=4), 1) == 4
    assert request_limit(LoadTestConfig(min_requests=16, max_requests=30), 1) == 30  # no per-user limit: max only


def test_each_run_has_its_own_key_on_the_suffix_app():
    """Keys split the shared suffix index: the dflash+suffix app holds one key per run and each run's users
    send theirs, so no run drafts from the server's replies to an earlier run's identical requests."""
    from pathlib import Path

    from loadtest.run import LoadTestConfig, apps, locust_command, run_key

    cfg = LoadTestConfig(scenarios=["chat", "rag"], users=[1, 4], repeats=2, variants=["ar", "dflash+suffix"])
    keys = {run_key(s, u, r) for s in cfg.scenarios for u in cfg.users for r in range(2)}
    assert len(keys) == 8 and set(apps(cfg)["suffix"]["api_keys"]) == keys and "api_keys" not in apps(cfg)["ar"]
    command = locust_command(cfg, ["rag"], 4, "http://127.0.0.1:1", Path("p"), None, Path("s"), run_key("rag", 4, 1))
    assert command[command.index("--api-key") + 1] == "loadtest-rag-u4-r1"


def test_variants_run_in_reverse_every_other_repeat():
    """No variant always runs right after the same one (b4 after b2 on the same warm app)."""
    from loadtest.run import run_order

    variants = ["ar", "b2", "b4", "adaptive"]
    assert [run_order(variants, r) for r in range(3)] == [variants, variants[::-1], variants]
    assert variants == ["ar", "b2", "b4", "adaptive"]  # not reordered in place


@pytest.mark.slow
def test_soak_mixed_traffic_leaves_nothing_behind(serve_cluster, tmp_path):
    """A short soak (the README's is 10 minutes): mixed users, no failures, the replicas' memory
    sampled, every KV slot free once the load stops, and the suffix index within its bound (a few replies'
    tokens here, so it evicts)."""
    from ray import serve

    from loadtest import soak

    cfg = soak.SoakConfig(minutes=0.3, users=3, max_tokens=16, sample_every=3, policy="fixed", max_slots=2,
                          suffix_index_tokens=40, num_cpus=0.5, out=str(tmp_path / "soak"))
    report = soak.run(cfg, cluster_url=serve_cluster)

    assert soak.APP not in serve.status().applications
    assert set(report["traffic"]) == {"chat", "rag", "agent"}
    assert all(t["requests"] > 0 and t["failures"] == 0 for t in report["traffic"].values()), report["traffic"]
    assert set(report["memory"]) == {"EngineReplica", "OpenAIIngress"}
    assert all(100 < m["baseline_mb"] < 8000 for m in report["memory"].values())
    assert len(report["samples"]) >= 5 and report["max_used_slots"] == 2  # 3 users queue for 2 slots
    assert report["end_used_slots"] == 0
    assert 0 < report["max_suffix_tokens"] <= 40
    assert (tmp_path / "soak" / "soak.png").stat().st_size > 0 and "# Soak" in (tmp_path / "soak" / "soak.md").read_text()


@pytest.mark.slow
def test_lockstep_compares_policies_on_the_same_requests(tmp_path):
    """`dflash-serve lockstep`: every variant's engine decodes the same conversations, turn by turn, the engines
    taking turns; greedy, so with the same model every lane commits the same tokens; the report is written."""
    from loadtest import lockstep

    cfg = lockstep.LockstepConfig(scenarios=["agent"], batch=[2], prompts=2, turns="all",
                                  variants=["b1", "b2", "adaptive", "dflash+suffix"], max_block=2, max_tokens=8,
                                  out=str(tmp_path / "lockstep"))
    (cell,) = lockstep.run(cfg)
    assert set(cell["tok_s"]) == {"b1", "b2", "adaptive", "dflash+suffix"} and all(r > 0 for r in cell["tok_s"].values())
    assert cell["best_fixed"] == "b2" and cell["adaptive_vs_best_fixed"] > 0 and cell["adaptive_vs_b1"] > 0
    assert set(cell["verified_rows_by_block"]["b1"]) == {1} and 2 in cell["verified_rows_by_block"]["b2"]
    report = (tmp_path / "lockstep" / "report.md").read_text()
    assert "| agent | 2 |" in report and (tmp_path / "lockstep" / "lockstep.png").stat().st_size > 0


@pytest.mark.slow
def test_lockstep_lanes_do_not_charge_each_other_their_steps():
    """The adaptive policy adds what its caller spends between steps to every step's cost (observe_gap). In
    lockstep that time is the other lanes' steps, not the caller's: counted, it made wide blocks look cheap
    (~80 ms a step at batch 16 on RAG, and adaptive drafted block 4 where not drafting was fastest)."""
    from dataclasses import replace

    from engine.config import build_engine, load_models
    from loadtest import lockstep
    from loadtest.scenarios import conversations

    cfg = lockstep.LockstepConfig(scenarios=["rag"], batch=[2], prompts=2, variants=["b2", "adaptive"], max_block=4,
                                  max_tokens=8)
    cfg = replace(cfg, engine=replace(cfg.engine, dtype="float32"))
    loaded = load_models(cfg.engine)
    engines = {v: build_engine(lockstep.lane_config(cfg, v, 2), loaded) for v in cfg.variants}
    out = lockstep.run_lanes(engines, loaded.tokenizer, conversations("rag", 2), cfg, 2)
    assert all(tokens > 0 for _, tokens, _ in out.values())
    assert engines["adaptive"].policy.overhead == 0.0  # the b2 lane's steps (tens of ms each) were not its own

