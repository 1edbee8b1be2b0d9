"""Drafter training with the target's features computed online: what a GPU makes cheap.

From a prompt list and a bench prompt file of RAG and agent requests, the target writes its replies in
large batches; each training step then runs the target over a batch of (prompt + reply) sequences for
their features and greedy choices, and trains the drafter on random anchor blocks of them (the recipe
of engine/train.py). Nothing is stored between the two but token ids, so the run is bounded by time,
not by disk. Everything is timed against one wall-clock budget.
"""

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from engine.datagen import (AGENT_PROMPTS, HELD_OUT_PROMPTS, RAG_PROMPTS, TRAFFIC_PROMPTS, TRAIN_PROMPTS, PromptItem,
                            chat_ids_many, generate_responses, read_prompt_list)
from engine.drafter import Drafter, DrafterConfig, default_target_layer_ids, save_drafter
from engine.prompts import read_prompts
from engine.train import Sequence, evaluate, make_batch, position_weights, sample_anchors, train_forward

CODE_SOURCES = ("code", "code-methods")
HELD_OUT_BENCH = {"agent": AGENT_PROMPTS, "rag": RAG_PROMPTS}  # scored beside the held-out list's chat and code
HELD_OUT_KINDS = ("chat", "code", *HELD_OUT_BENCH)


@dataclass
class OnlineConfig:
    out: str
    target: str | None = None  # None: the default model
    prompts: str = str(TRAIN_PROMPTS)
    held_out_prompts: str = str(HELD_OUT_PROMPTS)
    # RAG and agent requests in the bench prompt format (chat messages: their token ids are the chat template's,
    # system prompt included), trained on beside the prompt list as source "traffic", shuffled in with it
    # (None or "": none). Held-out agent and RAG tau are scored either way (the bench's prompt files)
    traffic_prompts: str | None = str(TRAFFIC_PROMPTS)
    init: str = "random"  # random | a drafter folder (go on training it)
    num_layers: int = 2
    intermediate_size: int = 1024  # 0: the target's
    block_size: int = 16
    mask_token_id: int | None = None  # None: the default model's (16)
    num_feature_layers: int = 5
    budget_s: float = 390.0  # wall clock for the whole run: replies, training, evaluations, saving
    generate_share: float = 0.3  # of the budget spent writing replies (greedy first, then sampled)
    max_prompt_tokens: int = 768  # longer prompts are left out (the traffic requests are up to ~750 tokens)
    max_new_tokens: int = 256
    generate_batch: int = 2048
    sample_temperature: float = 0.6  # replies after each prompt's greedy one
    seqs_per_step: int = 64
    anchors: int = 128
    feature_tokens: int = 32768  # padded positions per target pass that computes features
    lr: float = 6e-4
    warmup_steps: int = 100  # in steps, not time: how fast steps are must not change how gently training starts
    weight_decay: float = 0.01
    clip: float = 1.0
    loss_rows: int = 16384  # block positions per chunk of the loss (bounds the logits' memory)
    # the head scores the N tokens the training replies use most (0: the whole vocabulary): the loss costs
    # N/V of the whole head's, and the engine drafts from those N (draft_vocab.json beside the drafter)
    draft_vocab: int = 8192
    prompt_limit: int | None = None  # use the first N prompts of the (shuffled) list only (the traffic requests come on top)
    traffic_limit: int | None = None  # use N of the traffic requests (drawn at random) only (None: all)
    # of each step's sequences, drawn from the traffic replies (the rest from the others): uniform draws would give
    # them 1.3% of the steps (600 of ~46,000 prompts); on the CPU a third of the data gave agent/RAG +0.5 tau, and
    # ~22 passes over them over-trained the drafter (docs/training.md), so a share, not a third
    traffic_share: float = 0.15
    held_out_limit: int | None = None  # score on the first N held-out prompts and N of each bench file only (None: all)
    eval_every_s: float = 60.0
    reserve_s: float = 20.0  # kept from training for the final evaluation and saving
    device: str = "cuda"
    bf16: bool = True
    seed: int = 0


@dataclass
class Reply:
    tokens: list[int]  # prompt + reply
    prompt_len: int
    source: str


class TimeBudget:
    def __init__(self, seconds):
        self.start, self.seconds = time.monotonic(), seconds

    @property
    def elapsed(self):
        return time.monotonic() - self.start

    def at(self, share):
        """time.monotonic() when `share` of the budget has passed."""
        return self.start + share * self.seconds


def text_prompts(tokenizer, items: list[PromptItem]) -> list[tuple[list[int], str]]:
    """(token ids, source) of prompt-list items: each text a user message in the chat template."""
    return list(zip(chat_ids_many(tokenizer, [p.text for p in items]), [p.source for p in items]))


def file_prompts(tokenizer, path, source, limit=None, seed=None) -> list[tuple[list[int], str]]:
    """(token ids, source) of a bench prompt file's requests as `Prompt.token_ids` gives them: the first
    `limit`, or with a seed `limit` drawn at random."""
    prompts = read_prompts(path)
    if seed is not None:
        random.Random(seed).shuffle(prompts)
    return [(p.token_ids(tokenizer), source) for p in prompts[:limit]]


def prompt_counts(prompts, max_tokens) -> dict:
    """{source: {"kept": n, "dropped": n}}: (token ids, source) pairs within `max_tokens`, and over it."""
    counts = {}
    for ids, source in prompts:
        entry = counts.setdefault(source, {"kept": 0, "dropped": 0})
        entry["kept" if len(ids) <= max_tokens else "dropped"] += 1
    return counts


def write_replies(target, prompts, cfg: OnlineConfig, stops, deadline=None) -> list[Reply]:
    """Greedy replies to the prompts ((token ids, source) pairs; those over cfg.max_prompt_tokens are left
    out), then sampled ones in further rounds until `deadline` (time.monotonic()); with no deadline, the
    greedy round alone."""
    keep = [(ids, source) for ids, source in prompts if len(ids) <= cfg.max_prompt_tokens]
    replies, round_ = [], 0
    while keep and (round_ == 0 or (deadline is not None and time.monotonic() < deadline and round_ < 8)):
        temperature = 0.0 if round_ == 0 else cfg.sample_temperature
        out = generate_responses(target, [ids for ids, _ in keep], max_new_tokens=cfg.max_new_tokens,
                                 batch_size=cfg.generate_batch, temperature=temperature, stop_token_ids=stops,
                                 seed=cfg.seed + round_, deadline=deadline, quiet=False)
        replies += [Reply(ids + r, len(ids), source) for (ids, source), r in zip(keep, out) if len(r) >= 2]
        round_ += 1
    return replies


@torch.no_grad()
def target_pass(target, replies: list[Reply], feature_layers, cache, budget_tokens, greedy=True) -> list[Sequence]:
    """Sequences with the target's features and, with `greedy`, its greedy choices (held-out ones need
    none), from prefills of at most `budget_tokens` padded positions (the target's KV cache is scratch
    here). The greedy choices come from the last layer's output of the real positions only: the full
    logits of a pass are tens of GB in float32."""
    out, lo = [], 0
    device, last = target.device, target.config.num_layers - 1
    layers = list(feature_layers) + ([] if last in feature_layers or not greedy else [last])
    hidden = target.config.hidden_size
    while lo < len(replies):
        hi, width = lo + 1, len(replies[lo].tokens)
        while hi < len(replies) and hi - lo < cache.num_slots and (hi + 1 - lo) * max(width, len(replies[hi].tokens)) <= budget_tokens:
            width, hi = max(width, len(replies[hi].tokens)), hi + 1
        rows = replies[lo:hi]
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.tokens)] = torch.tensor(r.tokens)
            positions[i, : len(r.tokens)] = torch.arange(len(r.tokens))
        first = torch.zeros(len(rows), 1, dtype=torch.long, device=device)  # logits of one position only
        _, outputs = target(ids.to(device), positions.to(device), cache, list(range(len(rows))), width, layers, first)
        features = outputs[..., : len(feature_layers) * hidden]
        if greedy:
            final = outputs[..., layers.index(last) * hidden: (layers.index(last) + 1) * hidden]
            real = positions >= 0
            picked = [target.lm_head(target.norm(x)).argmax(-1) for x in final[real.to(device)].split(budget_tokens)]
            choices = torch.zeros(len(rows), width, dtype=torch.long)
            choices[real] = torch.cat(picked).cpu()
            choices = torch.cat([ids[:, :1], choices[:, :-1]], 1)  # row i: the choice for token i
        for i, r in enumerate(rows):
            n = len(r.tokens)
            out.append(Sequence(ids[i, :n], r.prompt_len, features[i, :n], greedy=choices[i, :n] if greedy else None))
        lo = hi
    return out


def chunked_loss(hidden, head, labels, weights, rows_per_chunk):
    """Decayed cross-entropy over labelled block positions, the logits made a chunk at a time and
    made again in the backward pass (never all at once: 123K positions x 49K vocab is 24 GB in float32).
    hidden [N, B-1, H]; head [V, H]; labels [N, B-1] (-100: none); weights [B-1].
    Returns (loss, correct [B-1], counted [B-1])."""
    w = weights[None].expand_as(labels)
    has = labels >= 0
    h, y, wt = hidden[has], labels[has], w[has]
    pos = torch.arange(labels.shape[1], device=labels.device)[None].expand_as(labels)[has]

    def part(h, y, wt):
        logits = (h.to(head.dtype) @ head.T).float()
        nll = logits.logsumexp(-1) - logits.gather(-1, y[:, None])[:, 0]
        return (nll * wt).sum(), (logits.argmax(-1) == y)

    total, correct = hidden.new_zeros((), dtype=torch.float32), []
    for lo in range(0, len(y), rows_per_chunk):
        sl = slice(lo, lo + rows_per_chunk)
        loss, ok = checkpoint(part, h[sl], y[sl], wt[sl], use_reentrant=False)
        total, correct = total + loss, correct + [ok]
    ok = torch.cat(correct) if correct else torch.zeros(0, dtype=torch.bool, device=labels.device)
    counted = torch.bincount(pos, minlength=labels.shape[1])
    hits = torch.bincount(pos[ok], minlength=labels.shape[1])
    return total / wt.sum().clamp_min(1.0), hits, counted


BF16_STRIKES = 3  # non-finite steps in a row under bf16 autocast before the run turns it off


@torch.no_grad()
def first_non_finite(drafter, embed, batch, bf16: bool) -> str:
    """Where a step's forward first stops being finite, for the log of a step whose gradient was not:
    the target's features, a drafter parameter, or the first drafter module (in call order) whose
    output is not finite, saying whether its input was (if it was, the module is the culprit; if not,
    the functions between modules: attention, rotary)."""
    if not batch.ctx_features.isfinite().all():
        return "the target's features"
    bad = [name for name, p in drafter.named_parameters() if not p.isfinite().all()]
    if bad:
        return f"parameter {bad[0]} (and {len(bad) - 1} more)"
    found = []

    def hook(name):
        def check(module, args, output):
            if not found and isinstance(output, torch.Tensor) and not output.isfinite().all():
                inputs_finite = all(a.isfinite().all() for a in args if isinstance(a, torch.Tensor))
                found.append(f"module {name} (its input {'finite' if inputs_finite else 'not finite'})")
        return check

    handles = [m.register_forward_hook(hook(name)) for name, m in drafter.named_modules() if name]
    try:
        with torch.autocast(batch.ctx_features.device.type, dtype=torch.bfloat16, enabled=bf16):
            hidden = train_forward(drafter, embed, batch, None)
    finally:
        for h in handles:
            h.remove()
    if found:
        return found[0]
    return "none in the forward (hidden states finite)" if hidden.isfinite().all() else "the forward's last step"


class StepTimer:
    """Milliseconds of a step's parts (synchronising the device at each mark), when `on`."""

    def __init__(self, device, on):
        self.device, self.on, self.ms = device, on, {}
        self.last = self._now() if on else 0.0

    def _now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def mark(self, name):
        if self.on:
            now = self._now()
            self.ms[name] = round((now - self.last) * 1e3, 1)
            self.last = now


class Held:
    """Held-out sequences in the shape `engine.train.evaluate` reads."""

    def __init__(self, sequences):
        self.sequences = sequences


def draw(pools: tuple[list, list], n: int, share: float, generator) -> list:
    """n replies at random: round(share * n) from the first pool (the traffic replies), the rest from the
    second; all from the one pool when the other is empty."""
    first, second = pools
    k = n if not second else 0 if not first else round(share * n)
    pick = lambda pool, m: [pool[i] for i in torch.randint(len(pool), (m,), generator=generator).tolist()] if m else []
    return pick(first, k) + pick(second, n - k)


def make_drafter(cfg: OnlineConfig, target_config) -> Drafter:
    from engine.default_model import MASK_TOKEN_ID
    from engine.drafter import load_drafter

    if cfg.init != "random":
        drafter = load_drafter(cfg.init)
        if drafter.config.block_size != cfg.block_size:
            raise ValueError(f"--init {cfg.init}: block size {drafter.config.block_size}, this run's is {cfg.block_size}")
        return drafter.float()
    layers = default_target_layer_ids(target_config.num_layers, cfg.num_feature_layers)
    mask = MASK_TOKEN_ID if cfg.mask_token_id is None else cfg.mask_token_id
    dc = DrafterConfig.for_target(target_config, cfg.num_layers, mask, cfg.block_size, target_layer_ids=layers)
    if cfg.intermediate_size:
        dc.intermediate_size = cfg.intermediate_size
    torch.manual_seed(cfg.seed)
    return Drafter(dc)


def draft_vocabulary(drafter, counts: torch.Tensor, size: int) -> torch.Tensor | None:
    """The token ids the drafter's head is trained over and drafts from: an --init drafter's own draft
    vocabulary if it has one, else the `size` most frequent reply tokens (`counts` per token id), else
    (size 0) none: the whole vocabulary."""
    if getattr(drafter, "draft_vocab", None) is not None:
        return drafter.draft_vocab.cpu()
    if not size:
        return None
    return counts.argsort(descending=True)[:size].sort().values


def lr_scale(cfg: OnlineConfig, step: int, progress: float) -> float:
    """Linear warm-up over the first warmup_steps, then cosine decay to 10% of the peak over the time
    left (progress in [0, 1] is the share of the training time spent)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_online(cfg: OnlineConfig, quiet=False) -> dict:
    """The whole run within cfg.budget_s; writes OUT/drafter (z-lab format, bf16), OUT/log.jsonl,
    OUT/curves.png and OUT/summary.json; returns the summary."""
    from engine.default_model import resolve_model_path
    from engine.loading import load_tokenizer, stop_token_ids
    from engine.model import load_target

    budget = TimeBudget(cfg.budget_s)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "log.jsonl"
    log_path.write_text("")
    device = torch.device(cfg.device)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32

    def log(entry):
        with log_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    target_path = resolve_model_path(cfg.target)
    target = load_target(target_path, dtype, device)
    tokenizer = load_tokenizer(target_path)
    stops = stop_token_ids(target_path)
    drafter = make_drafter(cfg, target.config).to(device)
    layers = drafter.config.target_layer_ids

    # held-out replies first (greedy, as decoding will be scored), then the training replies; a prompt's source
    # is its held-out kind here
    held_prompts = [(ids, "code" if source in CODE_SOURCES else "chat") for ids, source in
                    text_prompts(tokenizer, read_prompt_list(cfg.held_out_prompts)[: cfg.held_out_limit])]
    for kind, path in HELD_OUT_BENCH.items():
        held_prompts += file_prompts(tokenizer, path, kind, cfg.held_out_limit)
    held_replies = write_replies(target, held_prompts, cfg, stops)
    items = read_prompt_list(cfg.prompts)
    random.Random(cfg.seed).shuffle(items)
    prompts = text_prompts(tokenizer, items[: cfg.prompt_limit])
    if cfg.traffic_prompts:
        prompts += file_prompts(tokenizer, cfg.traffic_prompts, "traffic", cfg.traffic_limit, seed=cfg.seed)
        random.Random(cfg.seed + 1).shuffle(prompts)
    t0 = budget.elapsed
    replies = write_replies(target, prompts, cfg, stops, deadline=budget.at(cfg.generate_share))
    gen_seconds = budget.elapsed - t0
    num_reply_tokens = sum(len(r.tokens) - r.prompt_len for r in replies)
    by_source = {"prompts": prompt_counts(prompts, cfg.max_prompt_tokens),
                 "replies": dict(Counter(r.source for r in replies))}  # sampled rounds count again
    log({"phase": "replies", "replies": len(replies), "prompts": len(prompts), "reply_tokens": num_reply_tokens,
         "seconds": gen_seconds, "by_source": by_source,
         "held_out_prompts": prompt_counts(held_prompts, cfg.max_prompt_tokens),
         "held_out_replies": dict(Counter(r.source for r in held_replies))})
    if not quiet:
        print(f"replies: {len(replies)} ({num_reply_tokens} tokens) in {gen_seconds:.0f} s", flush=True)
    if not replies:
        raise RuntimeError(f"no replies were written in {gen_seconds:.0f} s: give the run a larger budget or generate_share")
    counts = torch.bincount(torch.tensor([t for r in replies for t in r.tokens[r.prompt_len:]], dtype=torch.long),
                            minlength=target.config.vocab_size)
    (out / "frequent_tokens.json").write_text(json.dumps(counts.argsort(descending=True)[:16384].tolist()) + "\n")
    vocab_ids = draft_vocabulary(drafter, counts, cfg.draft_vocab)
    vocab_map = None
    if vocab_ids is not None:
        vocab_ids = vocab_ids.to(device)
        vocab_map = torch.full((target.config.vocab_size,), -100, dtype=torch.long, device=device)
        vocab_map[vocab_ids] = torch.arange(len(vocab_ids), device=device)
        log({"draft_vocab": len(vocab_ids), "reply_tokens_covered": counts[vocab_ids.cpu()].sum().item() / counts.sum().item()})

    cache = target.new_cache(max(cfg.seqs_per_step, 32), cfg.max_prompt_tokens + cfg.max_new_tokens + 1)
    held = {}
    for kind in HELD_OUT_KINDS:  # replies shorter than a block have nothing to score
        scored = [r for r in held_replies if r.source == kind and len(r.tokens) - r.prompt_len >= cfg.block_size]
        # scored against the reply's own tokens, as evaluation on stored data is: no greedy choices
        held[kind] = Held(target_pass(target, scored, layers, cache, cfg.feature_tokens, greedy=False))
    embed = target.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()
    train_head = head if vocab_ids is None else head[vocab_ids]
    weights = position_weights(cfg.block_size).to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(cfg.seed)
    evals = []

    def run_eval(step):
        entry = {"eval": True, "step": step, "seconds": budget.elapsed}
        for kind, data in held.items():
            if data.sequences:  # as the engine drafts: from the draft vocabulary when there is one
                result = evaluate(drafter, embed, head, data, cfg, None, vocab_ids)
                suffix = "" if vocab_ids is None else "_reduced_head"
                entry[kind] = {key: result[key + suffix] for key in ("tau", "tau_ci", "acceptance_per_pos")}
                if vocab_ids is not None:
                    entry[kind]["tau_full_head"] = result["tau"]
        evals.append(entry)
        log(entry)
        save_drafter(drafter, out / "drafter", draft_vocab=vocab_ids)  # the latest drafter is on disk whatever happens next
        if not quiet:
            print(f"step {step}: held-out tau " + ", ".join(f"{k} {entry[k]['tau']:.3f}" for k in held if k in entry), flush=True)

    pools = ([r for r in replies if r.source == "traffic"], [r for r in replies if r.source != "traffic"])
    run_eval(0)
    train_start, train_seconds = budget.elapsed, cfg.budget_s - budget.elapsed - cfg.reserve_s
    next_eval, step, blocks = time.monotonic() + cfg.eval_every_s, 0, 0
    bar = tqdm(desc="train", unit="step", disable=quiet)
    skipped = in_a_row = 0
    bf16_off_at = None
    while (progress := (budget.elapsed - train_start) / train_seconds if train_seconds > 0 else 1.0) < 1:
        for g in optimizer.param_groups:
            g["lr"] = cfg.lr * lr_scale(cfg, step, progress)
        timer = StepTimer(device, on=step < 5 or step % 50 == 0)
        picks = draw(pools, cfg.seqs_per_step, cfg.traffic_share, generator)
        seqs = target_pass(target, picks, layers, cache, cfg.feature_tokens)
        timer.mark("target")
        if step == 0:  # the scale of what the drafter reads, in the log for when training diverges
            log({"features_max_abs": max(s.features.abs().max().item() for s in seqs),
                 "features_finite": all(bool(s.features.isfinite().all()) for s in seqs)})
        anchors = [sample_anchors(s, cfg.anchors, generator) for s in seqs]
        batch = make_batch(seqs, anchors, cfg.block_size, drafter.config.mask_token_id).to(device)
        timer.mark("batch")
        optimizer.zero_grad(set_to_none=True)
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                hidden = train_forward(drafter, embed, batch, None)
            timer.mark("forward")
            labels = batch.labels if vocab_map is None else vocab_map[batch.labels.clamp_min(0)].masked_fill(batch.labels < 0, -100)
            loss, hits, counted = chunked_loss(hidden[:, 1:], train_head, labels, weights, cfg.loss_rows)
            timer.mark("loss")
            loss.backward()
            timer.mark("backward")
        except torch.OutOfMemoryError:  # a batch too large for this device: go on with half as many sequences
            del seqs, batch
            hidden = loss = None
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            cfg.seqs_per_step = max(1, cfg.seqs_per_step // 2)
            log({"step": step, "out_of_memory": True, "seqs_per_step": cfg.seqs_per_step})
            continue
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        if not torch.isfinite(grad_norm):  # one bad batch must not end the run: its update is dropped
            skipped, in_a_row = skipped + 1, in_a_row + 1
            entry = {"step": step, "seconds": budget.elapsed, "dropped": "non-finite gradient", "loss": loss.item(),
                     "skipped_total": skipped}
            if in_a_row == 1:
                entry["first_non_finite"] = first_non_finite(drafter, embed, batch, cfg.bf16)
            if cfg.bf16 and in_a_row >= BF16_STRIKES:  # not one bad batch: bf16 itself; the run goes on in float32
                cfg.bf16, bf16_off_at, in_a_row = False, step, 0
                torch.set_float32_matmul_precision("high")  # TF32 on a GPU's tensor cores; nothing on a CPU
                entry["bf16"] = f"off after {BF16_STRIKES} non-finite steps in a row: float32 from here"
                if not quiet:
                    bar.write(entry["bf16"])
            log(entry)
            if skipped > 20 and skipped > step:
                raise RuntimeError(f"{skipped} steps had non-finite gradients (of {step + skipped}); see {log_path}")
            continue
        optimizer.step()
        in_a_row = 0
        timer.mark("optimizer")
        step, blocks = step + 1, blocks + len(batch.block_ids)
        if timer.on:
            if not quiet and step <= 5:
                bar.write(f"step {step}: ms {timer.ms}, loss {loss.item():.3f}")
            log({"step": step, "timing_ms": timer.ms, "memory_gb": torch.cuda.max_memory_allocated(device) / 2**30
                 if device.type == "cuda" else None, "blocks_in_step": len(batch.block_ids)})
        if step % 10 == 0 or step <= 20:
            accuracy = (hits.float() / counted.clamp_min(1)).tolist()
            log({"step": step, "seconds": budget.elapsed, "loss": loss.item(), "grad_norm": grad_norm.item(),
                 "lr": optimizer.param_groups[0]["lr"], "blocks": blocks, "skipped": skipped,
                 "accuracy_per_pos": [round(a, 4) for a in accuracy]})
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=" ".join(f"{a:.2f}" for a in accuracy[:4]))
        bar.update(1)
        if time.monotonic() >= next_eval:
            run_eval(step)
            next_eval += cfg.eval_every_s
    bar.close()
    run_eval(step)
    summary = {"config": asdict(cfg), "target": str(target_path), "device": torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu", "replies": len(replies), "reply_tokens": num_reply_tokens,
               "by_source": by_source, "generate_seconds": gen_seconds, "train_seconds": budget.elapsed - train_start,
               "steps": step, "skipped_steps": skipped, "bf16_off_at_step": bf16_off_at,
               "blocks": blocks, "final": evals[-1], "seconds": budget.elapsed}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_online(log_path, out / "curves.png")
    return summary


def plot_online(log_path, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    steps = [e for e in entries if "loss" in e and "dropped" not in e]
    evals = [e for e in entries if e.get("eval")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot([e["seconds"] for e in steps], [e["loss"] for e in steps])
    axes[0].set(xlabel="seconds into the run", ylabel="training loss", title="loss")
    for kind in HELD_OUT_KINDS:
        pts = [(e["seconds"], e[kind]["tau"]) for e in evals if kind in e]
        if pts:
            axes[1].plot(*zip(*pts), marker="o", label=f"held-out {kind}")
    axes[1].set(xlabel="seconds into the run", ylabel="tau (greedy, block 16)", title="acceptance length")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
