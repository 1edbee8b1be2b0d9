"""The prepared run for a lent GPU machine, in phases a session picks to fit its minutes:

  check  the CUDA tests (tests/test_gpu.py) and a short bf16 bench (hf, ar, dflash, dflash-adaptive)
  train  engine.train_online within a wall-clock budget; the drafter and its log land in OUT/train
  costs  step costs of a Qwen3-8B-shaped target and a 5-layer drafter (random weights) beside
         transformers' generate(), and the speed-up ceiling they give at the paper's tau

It needs only the machine's python3 with torch and transformers, and what scripts/gpu_run.sh sets up
(carried wheels, the default model's GGUF). Each phase is timed into OUT/phases.json; a phase that
fails is recorded and the next one still runs. `--tiny` runs every phase on a tiny random target
(the CPU dry run the test suite makes).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("check", "train", "costs")
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                qk_norm=True, model_type="qwen3")
TINY_COSTS = dict(QWEN3_8B, vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16)
PAPER_TAU = 6.5  # DFlash's mean acceptance length with Qwen3-8B at T=0 (REFERENCE.md, Table 1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gpu_run", description=__doc__.split("\n\n")[0])
    p.add_argument("phases", nargs="?", default="check,train,costs", help=f"comma list of {', '.join(PHASES)}")
    p.add_argument("--out", default="results/gpu")
    p.add_argument("--device", default="cuda")
    p.add_argument("--train-budget", type=float, default=390.0, help="seconds for the whole train phase")
    p.add_argument("--init", default="random", help="random, or a drafter folder to go on training")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's, 6e-4)")
    p.add_argument("--seqs-per-step", type=int, default=None,
                   help="sequences a training step takes, 128 blocks each (default: the recipe's, 64)")
    p.add_argument("--traffic-prompts", default=None, metavar="PATH",
                   help="bench prompt file of RAG and agent requests trained on too, or none "
                        "(default: the recipe's, data/prompts/traffic-train.jsonl.xz)")
    p.add_argument("--traffic-share", type=float, default=None,
                   help="share of each step's sequences drawn from the traffic replies (default: the recipe's, 0.15)")
    p.add_argument("--target", default=None, help="target folder (default: the default model)")
    p.add_argument("--tiny", action="store_true", help="dry run: a tiny random target, small shapes, short budgets")
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    if args.lr is not None and args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.seqs_per_step is not None and args.seqs_per_step < 1:
        p.error(f"--seqs-per-step must be >= 1, got {args.seqs_per_step}")
    if args.traffic_share is not None and not 0 <= args.traffic_share <= 1:
        p.error(f"--traffic-share must be between 0 and 1, got {args.traffic_share}")
    if args.traffic_prompts not in (None, "none") and not Path(args.traffic_prompts).is_file():
        p.error(f"--traffic-prompts {args.traffic_prompts}: no such file")
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phase(s) {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(machine(args.device)), flush=True)
    record = {"machine": machine(args.device), "phases": {}}
    if (out / "phases.json").exists():  # an earlier call of the same run (its phases are kept unless run again)
        record["phases"] = json.loads((out / "phases.json").read_text())["phases"]
    for name in args.phases:
        start = time.monotonic()
        print(f"== phase {name}", flush=True)
        try:
            result, ok = globals()[f"phase_{name}"](args, out), True
        except Exception:
            result, ok = traceback.format_exc(), False
            print(result, flush=True)
        record["phases"][name] = {"ok": ok, "seconds": round(time.monotonic() - start, 1), "result": result}
        print(f"== phase {name}: {'ok' if ok else 'FAILED'} in {record['phases'][name]['seconds']} s", flush=True)
        (out / "phases.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def machine(device):
    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def target_of(args, out: Path) -> str | None:
    """The phase's target: --target, the tiny random one with --tiny, else None (the default model)."""
    if args.tiny and args.target is None:
        args.target = str(tiny_target(out / "tiny-target"))
    return args.target


def tiny_target(path: Path) -> Path:
    """A tiny random Llama with the default model's tokenizer (so prompts and chat templates are real)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.default_model import default_model_path
    from engine.loading import load_tokenizer

    if (path / "config.json").exists():
        return path
    source = default_model_path()
    tokenizer = load_tokenizer(source)
    config = json.loads((source / "config.json").read_text())
    small = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                        bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
                        tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(small).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---- check -------------------------------------------------------------------------------------


def phase_check(args, out: Path) -> dict:
    """The CUDA tests, then the bench with the drafter this run trained (else the shipped one)."""
    tests = run_logged([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                       out / "check-tests.txt", timeout=240)
    trained = out / "train" / "drafter"
    draft = "random" if args.tiny else str(trained) if (trained / "config.json").exists() else "default"
    bench_cmd = [sys.executable, "-m", "dflash_serve.cli", "bench", "--device", args.device, "--dtype", "bfloat16",
                 "--methods", "hf,ar,dflash,dflash-adaptive", "--draft", draft, "--num-prompts", "2" if args.tiny else "6",
                 "--max-new-tokens", "8" if args.tiny else "128", "--json", str(out / "check-bench.json")]
    if target_of(args, out):
        bench_cmd += ["--target", args.target]
    bench = run_logged(bench_cmd, out / "check-bench.txt", timeout=180)
    return {"tests": tests, "bench": bench, "draft": draft}


def run_logged(cmd, path: Path, timeout) -> dict:
    """Run a command, its output to `path` and to stdout; its exit status and last lines."""
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        text, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text, code = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s", -1
    path.write_text(text)
    tail = [line for line in text.splitlines() if line.strip()][-25:]
    print("\n".join(tail), flush=True)
    return {"returncode": code, "seconds": round(time.monotonic() - start, 1), "tail": tail}


# ---- train -------------------------------------------------------------------------------------


def phase_train(args, out: Path) -> dict:
    from engine.train_online import OnlineConfig, train_online

    cfg = OnlineConfig(out=str(out / "train"), target=target_of(args, out), init=args.init, device=args.device,
                       budget_s=args.train_budget)
    if args.tiny:
        cfg.generate_batch, cfg.seqs_per_step, cfg.anchors, cfg.held_out_limit, cfg.prompt_limit = 16, 4, 16, 4, 64
        cfg.max_new_tokens, cfg.eval_every_s, cfg.reserve_s, cfg.bf16 = 16, 5.0, 3.0, False
        cfg.intermediate_size, cfg.generate_share, cfg.traffic_limit = 0, 0.3, 8
    cfg.lr = args.lr or cfg.lr
    cfg.seqs_per_step = args.seqs_per_step or cfg.seqs_per_step
    if args.traffic_prompts is not None:
        cfg.traffic_prompts = None if args.traffic_prompts == "none" else args.traffic_prompts
    cfg.traffic_share = cfg.traffic_share if args.traffic_share is None else args.traffic_share
    summary = train_online(cfg)
    keys = ("replies", "reply_tokens", "by_source", "generate_seconds", "train_seconds", "steps", "blocks", "final")
    return {k: summary[k] for k in keys} | {"lr": cfg.lr, "seqs_per_step": cfg.seqs_per_step,
                                            "traffic_prompts": cfg.traffic_prompts, "traffic_share": cfg.traffic_share}


# ---- costs -------------------------------------------------------------------------------------


def phase_costs(args, out: Path) -> dict:
    """Median seconds of an AR step, a 16-position draft and a 16-position verify at batch 1, 8 and 32
    (512 tokens of context), the AR step and verify again replayed as CUDA graphs (the launch overhead
    the engine's eager steps pay), transformers' generate() per token, and the ceilings they give."""
    from engine.drafter import Drafter, DrafterConfig, DraftHead
    from engine.model import ModelConfig, TargetModel

    device, dtype = torch.device(args.device), torch.bfloat16
    shape = TINY_COSTS if args.tiny else QWEN3_8B
    config = ModelConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        target = TargetModel(config).to(dtype).eval()
        drafter = Drafter(DrafterConfig.for_target(config, num_layers=5, mask_token_id=0, block_size=16)).to(dtype).eval()
    for p in target.parameters():  # small weights keep the activations finite through 36 random layers
        p.data.normal_(0, 0.02) if p.dim() == 2 else None
    head = DraftHead(target.lm_head)
    context, block, repeats = (64, 16, 3) if args.tiny else (512, 16, 20)
    rows = {}
    for batch in (1, 8, 32):
        rows[batch] = step_costs(target, drafter, head, batch, context, block, repeats)
        print(f"batch {batch}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in rows[batch].items()), flush=True)
    del target, drafter
    hf = hf_token_costs(shape, device, context, (1, 8, 32), 16 if args.tiny else 32)
    result = {"shape": shape, "context": context, "block": block, "tau": PAPER_TAU, "rows": {}}
    for batch, r in rows.items():
        step = r["draft"] + r["verify"]
        result["rows"][batch] = dict(r, hf_token=hf[batch], ceiling_vs_ar=PAPER_TAU * r["ar"] / step,
                                     ceiling_vs_hf=PAPER_TAU * hf[batch] / step)
    lines = ["| batch | AR step ms | draft 16 ms | verify 16 ms | AR step, graph ms | verify 16, graph ms | "
             "HF generate ms/token | ceiling vs AR | vs HF |", "|---|---|---|---|---|---|---|---|---|"]
    for batch, r in result["rows"].items():
        ms = " | ".join(f"{r[k] * 1e3:.2f}" for k in ("ar", "draft", "verify", "ar_graph", "verify_graph", "hf_token"))
        lines.append(f"| {batch} | {ms} | {r['ceiling_vs_ar']:.2f}x | {r['ceiling_vs_hf']:.2f}x |")
    print("\n".join(lines), flush=True)
    (out / "costs.md").write_text("\n".join(lines) + "\n")
    return result


def timed_median(fn, device, repeats) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def step_costs(target, drafter, head, batch, context, block, repeats) -> dict:
    """An engine step's parts at `context` cached tokens: the target on 1 and on `block` new tokens,
    the drafter's block pass (with the ~tau new context features a step brings) and its head."""
    device, c = target.device, target.config
    slots = list(range(batch))
    cache = target.new_cache(batch, context + block + 1)
    ids = torch.randint(c.vocab_size, (batch, context), device=device)
    positions = torch.arange(context, device=device).expand(batch, -1)
    layers = drafter.config.target_layer_ids
    _, features = target(ids, positions, cache, slots, context, layers, logits_index=positions[:, -1:])
    draft_cache = drafter.new_cache(batch, context + block + 1)
    drafter.take_context(features, positions, draft_cache, slots)

    def ar():
        target(ids[:, :1], torch.full((batch, 1), context, device=device), cache, slots, context + 1,
               logits_index=torch.zeros(batch, 1, dtype=torch.long, device=device))

    new = 7  # features the drafter takes in per step at about the paper's tau
    block_pos = torch.arange(context - new, context + block, device=device).expand(batch, -1)
    block_ids = torch.zeros(batch, block, dtype=torch.long, device=device)

    def draft():
        embeds = target.embed_tokens(block_ids)
        hidden = drafter(features[:, -new:], embeds, block_pos, draft_cache, slots, context + block,
                         torch.full((batch,), context + block, device=device))
        head.scores(hidden[:, 1:]).argmax(-1)

    verify_pos = torch.arange(context, context + block, device=device).expand(batch, -1)

    def verify():
        target(ids[:, :block], verify_pos, cache, slots, context + block, layers)

    index = cache.batch_index(slots)  # the capturable forward's slots: made once, outside the graph
    ar_pos = torch.full((batch, 1), context, device=device)
    first = torch.zeros(batch, 1, dtype=torch.long, device=device)

    def ar_graph():
        target(ids[:, :1], ar_pos, cache, index, context + 1, logits_index=first, capturable=True)

    def verify_graph():
        target(ids[:, :block], verify_pos, cache, index, context + block, layers, capturable=True)

    fns = dict(ar=ar, draft=draft, verify=verify, ar_graph=replayable(ar_graph, device),
               verify_graph=replayable(verify_graph, device))
    return {name: timed_median(fn, device, repeats) for name, fn in fns.items()}


def replayable(fn, device):
    """fn recorded as a CUDA graph: the call replays its kernels on the same input tensors, without
    Python or launch overhead. On a CPU fn itself (the dry run then goes through the capturable path)."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def hf_token_costs(shape, device, context, batches, new_tokens) -> dict:
    """transformers' generate() for the same shape (random weights, bf16): seconds per new token after
    the prefill, (time for new_tokens - time for 1) / (new_tokens - 1)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
                         num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                         head_dim=shape["head_dim"], rms_norm_eps=shape["rms_norm_eps"], rope_theta=shape["rope_theta"],
                         max_position_embeddings=shape["max_position_embeddings"], tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    out = {}
    for batch in batches:
        ids = torch.randint(config.vocab_size, (batch, context), device=device)

        def gen(n):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

        one, many = timed_median(lambda: gen(1), device, 3), timed_median(lambda: gen(new_tokens), device, 3)
        out[batch] = (many - one) / (new_tokens - 1)
        print(f"hf generate batch {batch}: {out[batch] * 1e3:.2f} ms/token", flush=True)
    return out


if __name__ == "__main__":
    record = main()
    sys.exit(0 if all(p["ok"] for p in record["phases"].values()) else 1)
