"""Tests for the dflash-serve CLI: bad flags fail fast naming the flag (in-process, no model loads),
streaming detokenisation never prints broken UTF-8, and (slow) `generate` and `bench` run end to
end as subprocesses on the default model."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_serve import cli
from engine.bench import BenchConfig, first_divergence, sampling_params, until_stop

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dflash_serve.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def prompt_files(tmp_path):
    good = tmp_path / "good.jsonl"  # data sets carry ids and other keys: ignored
    good.write_text('{"prompt": "Hello", "id": 7}\n{"id": "a", "messages": [{"role": "user", "content": "Hi", "name": "x"}], '
                    '"answer": "Hello"}\n')
    neither = tmp_path / "neither.jsonl"
    neither.write_text('{"prompt": "Hello"}\n{"id": 3, "text": "Hello"}\n')
    bad_json = tmp_path / "bad_json.jsonl"
    bad_json.write_text('{"prompt": "Hello"}\n{"prompt": \n')
    both = tmp_path / "both.jsonl"
    both.write_text('{"prompt": "Hello", "messages": [{"role": "user", "content": "Hi"}]}\n')
    return tmp_path


BAD_FLAGS = [  # (argv, text that stderr must contain)
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0, got -1"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature must be >= 0"),
    (["generate", "--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "--prompt", "x", "--top-k", "-2"], "--top-k must be >= 0"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
    (["generate", "--prompt", "x", "--block-size", "0"], "--block-size must be >= 1"),
    (["generate", "--prompt", "x", "--denoising-steps", "0"], "--denoising-steps must be >= 1"),
    (["generate", "--prompt", "x", "--target", "/no/such/model"], "--target /no/such/model"),
    (["generate", "--prompt", "x", "--draft", "/no/such/drafter"], "--draft /no/such/drafter"),
    (["generate", "--prompt", "x", "--dtype", "float16"], "--dtype"),
    (["generate", "--prompt", "x", "--device", "tpu"], "--device must be cpu or cuda"),
    (["generate", "--prompt", "x", "--policy", "greedy"], "--policy"),
    (["generate", "--prompt", " "], "--prompt must not be empty"),
    (["generate"], "--prompt"),
    (["serve", "--port", "0"], "--port must be a TCP port"),
    (["serve", "--max-slots", "0"], "--max-slots must be >= 1"),
    (["serve", "--num-replicas", "0"], "--num-replicas must be >= 1"),
    (["serve", "--draft", "/no/such/drafter"], "--draft /no/such/drafter"),
    (["serve", "--num-shards", "0"], "--num-shards must be >= 1"),
    (["serve", "--shard-placement", "ANYWHERE"], "--shard-placement"),
    (["bench", "--methods", "hf,nope"], "--methods: unknown method nope"),
    (["bench", "--block-sizes", "0,4"], "--block-sizes must all be >= 1"),
    (["bench", "--block-sizes", "4,x"], "--block-sizes"),
    (["bench", "--num-prompts", "99"], "--num-prompts 99"),
    (["bench", "--repeats", "0"], "--repeats must be >= 1"),
    (["bench", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["bench", "--draft", "none", "--methods", "hf,dflash"], "--draft none turns speculation off, which these methods need: dflash"),
    (["bench", "--json", "/no/such/dir/out.json"], "--json /no/such/dir/out.json"),
    (["bench", "--plot", "out.pdf"], "--plot must be a .png"),
    (["bench", "--prompts", "{tmp}/missing.jsonl"], "--prompts {tmp}/missing.jsonl: no such file"),
    (["bench", "--prompts", "{tmp}/bad_json.jsonl"], "bad_json.jsonl:2:"),
    (["bench", "--prompts", "{tmp}/both.jsonl"], 'both.jsonl:1: Value error, give one of "prompt" or "messages", not both'),
    (["bench", "--prompts", "{tmp}/neither.jsonl"], 'neither.jsonl:2: Value error, no "prompt" (text) or "messages" (chat)'),
    (["bench", "--prompts", "{tmp}/good.jsonl", "--num-prompts", "3"], "--num-prompts 3: there are only 2 prompts"),
]


@pytest.mark.parametrize("argv,message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_fail_before_loading(argv, message, prompt_files, capsys, monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", {})  # a command that got past validation would KeyError
    argv = [a.format(tmp=prompt_files) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code != 0
    assert message.format(tmp=prompt_files) in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--num-shards", "99"], "num_shards must be between 1 and the target's 30 layers, got 99"),
    (["--topology", "disaggregated", "--draft", "none"], "topology 'disaggregated' needs a drafter"),
])
def test_serve_config_errors_stop_before_ray_starts(argv, message, capsys, monkeypatch):
    from deployments import launch

    monkeypatch.setattr(launch, "serve_forever", lambda *a: pytest.fail("the server started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_serve_flags_make_the_app_config():
    from deployments.launch import reserved_cpus

    args = cli.build_parser()[0].parse_args(["serve", "--topology", "disaggregated", "--num-shards", "2",
                                              "--shard-placement", "SPREAD", "--num-replicas", "2",
                                              "--policy", "fixed", "--max-slots", "4", "--prefill-token-budget", "512"])
    config = cli.serve_config(args)
    assert (config.topology, config.num_shards, config.shard_placement) == ("disaggregated", 2, "SPREAD")
    assert (config.engine.policy, config.engine.max_slots, config.engine.prefill_token_budget) == ("fixed", 4, 512)
    assert reserved_cpus(config) == 2 * (1 + 2) + 1  # 2 verifiers with 2 shards each, and a drafter
    assert reserved_cpus(cli.serve_config(cli.build_parser()[0].parse_args(["serve"]))) == 1


def test_bad_flag_subprocess_exit_code():
    result = run_cli("generate", "--prompt", "x", "--top-p", "2", timeout=120)
    assert result.returncode == 2
    assert "--top-p must be in (0, 1], got 2.0" in result.stderr


class ByteTokenizer:
    """Each id is one UTF-8 byte, so a character can be split across tokens."""

    def decode(self, ids, **kw):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_split_characters():
    out = io.StringIO()
    stream = cli.TextStream(ByteTokenizer(), out)
    data = "héllo €1 🙂!".encode()
    writes = []
    for b in data:
        before = out.getvalue()
        stream.add([b])
        writes.append(out.getvalue()[len(before):])
    assert out.getvalue() == "héllo €1 🙂!"
    assert not any("\ufffd" in w for w in writes)


def test_prompt_files_ignore_keys_besides_prompt_and_messages(prompt_files):
    from engine.prompts import read_prompts

    prompts = read_prompts(prompt_files / "good.jsonl")
    assert prompts[0].prompt == "Hello" and prompts[1].messages[0].content == "Hi"


def test_divergence_helpers():
    assert until_stop([5, 6, 2, 7], {2}) == [5, 6]
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.slow
def test_generate_streams_text_and_stats():
    result = run_cli("generate", "--prompt", "Say hello.", "--max-new-tokens", "8", "--dtype", "float32", "--draft", "random")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    for line in ("tokens: ", "tokens/s", "mean acceptance length: ", "per-position acceptance: "):
        assert line in result.stderr


def test_bench_int8_drafter():
    """The int8 drafter is a quantised copy of the loaded (oneDNN-packed) one: a deep copy of packed
    weights used to fail (`Cannot access storage of OpaqueTensorImpl`)."""
    result = run_cli("bench", "--methods", "ar,dflash", "--int8-drafter", "--num-prompts", "1", "--max-new-tokens", "8",
                     "--block-sizes", "4", "--dtype", "float32", "--draft", "random")
    assert result.returncode == 0, result.stderr
    assert "--int8-drafter: our methods use the int8 drafter" in result.stdout


def test_bench_unseeded_requests_carry_no_seed():
    """Seeded by default (outputs comparable across methods); --unseeded sends what a server usually
    gets, and runs end to end (transformers' sampling with no seed set, ours by rejection sampling)."""
    assert sampling_params(BenchConfig(temperature=0.7, seed=5), 3).seed == 8
    assert sampling_params(BenchConfig(temperature=0.7, unseeded=True), 3).seed is None
    result = run_cli("bench", "--methods", "hf,dflash+suffix", "--unseeded", "--temperature", "0.8", "--num-prompts", "1",
                     "--max-new-tokens", "8", "--dtype", "float32", "--draft", "random")
    assert result.returncode == 0, result.stderr
    assert "dflash+suffix" in result.stdout


@pytest.mark.slow
def test_bench_json_plot_and_exactness(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    result = run_cli(
        "bench", "--methods", "hf,ar,dflash,zlab", "--block-sizes", "4", "--batch-size", "2", "--num-prompts", "2",
        "--max-new-tokens", "16", "--dtype", "float32", "--draft", "random", "--json", str(out), "--plot", str(png),
    )
    assert result.returncode == 0, result.stderr
    assert "key ratios" in result.stdout and "dflash/zlab" in result.stdout and "decoding alone" in result.stdout
    report = json.loads(out.read_text())
    assert report["config"]["max_new_tokens"] == 16 and report["config"]["machine"]["torch"]
    methods = report["methods"]
    assert list(methods) == ["hf", "ar", "dflash", "zlab", "dflash-b4"]
    for name, m in methods.items():
        for key in ("tokens_per_s", "median_tokens_per_s", "speedup", "tau", "matches_target", "match_rate", "first_divergence"):
            assert key in m, (name, key)
        assert m["tokens_per_s"] > 0 and len(m["prompts"]) == 2
        assert m["matches_target"] is True, (name, m["first_divergence"])  # float32 greedy: exact
        assert m["first_divergence"] == [None, None]
        for r in m["prompts"]:  # prefill, then the tokens after the first at their own pace
            assert 0 < r["ttft_s"] < r["seconds"], (name, r["ttft_s"], r["seconds"])
            assert r["decode_tokens_per_s"] == pytest.approx((r["output_tokens"] - 1) / (r["seconds"] - r["ttft_s"]))
        assert m["median_ttft_s"] > 0 and m["median_decode_tokens_per_s"] > 0
    assert methods["hf"]["speedup"] == 1 and methods["hf"]["median_decode_speedup"] == 1 and methods["hf"]["tau"] is None and methods["ar"]["tau"] is None
    assert methods["dflash"]["tau"] >= 1 and methods["zlab"]["tau"] >= 1
    for ours, ref in zip(methods["dflash"]["prompts"], methods["zlab"]["prompts"]):
        assert ours["acceptance_lengths"] == ref["acceptance_lengths"]
        assert ours["output_ids"] == ref["output_ids"]
    batch = report["batch"]
    assert batch["batch_size"] == 2 and set(batch["methods"]) == {"ar", "dflash"}
    assert batch["methods"]["dflash"]["matches_single"] is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def process_group(pgid: int) -> list[str]:
    """The processes of group `pgid` still running (name and pid)."""
    import psutil

    found = []
    for p in psutil.process_iter(["name", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{p.info['name']} ({p.pid})")
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "Ctrl-C, started in a script's background"])
def test_serve_stops_every_process_it_started(how, tmp_path):
    """`dflash-serve serve` in its own process group; SIGTERM to it (what `kill` sends), or SIGINT to the whole
    group (what Ctrl-C in a terminal sends): within 15 s no process of the group is left, Ray's
    DashboardAgent and RuntimeEnvAgent included. Also when the server inherited SIGINT ignored (`cmd &` in a
    script: a test run started that way once left the server deaf to Ctrl-C)."""
    from conftest import free_port

    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        ignored = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if "background" in how else None
        server = subprocess.Popen([sys.executable, "-m", "dflash_serve.cli", "serve", "--port", str(free_port()),
                                   "--draft", "none", "--dtype", "float32"], cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=ignored)
    try:
        deadline = time.monotonic() + 300
        while "dflash-serve: serving" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert "ray get-auth-token" in log.read_text()
        started = process_group(server.pid)
        assert len(started) > 3, started  # Ray's processes are in the group
        if how == "SIGTERM":
            server.send_signal(signal.SIGTERM)
        else:
            os.killpg(server.pid, signal.SIGINT)
        stopping = time.monotonic()
        while process_group(server.pid) and time.monotonic() - stopping < 15:
            time.sleep(0.5)
        signals = ""
        if process_group(server.pid) and server.poll() is None:  # hung: its signal masks, its threads' stacks
            status = Path(f"/proc/{server.pid}/status").read_text().splitlines()
            signals = "; ".join(line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
            server.send_signal(signal.SIGUSR1)
            time.sleep(1)
        assert not process_group(server.pid), (f"left after {how}: {process_group(server.pid)} (started: {started}); "
                                               f"{signals}; its log ends:\n{log.read_text()[-4000:]}")
        assert server.wait(1) == 0
    finally:
        if process_group(server.pid):
            os.killpg(server.pid, signal.SIGKILL)
