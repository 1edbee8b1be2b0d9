"""Drafter training: the DFlash recipe on data from `engine.datagen`.

Many blocks of one sequence are trained in one pass: each block is [anchor token, MASK x (B-1)]
at positions a..a+B-1; it sees the target's features of positions < a and its own block, never
another block. Linear layers run over all blocks and contexts of a batch at once; attention runs
per sequence with that block-sparse mask. Loss: cross-entropy on the masked positions, position k
weighted exp(-(k-1)/gamma), optionally mixed with the target's top-k distribution (distillation)
and optionally restricted to the most frequent tokens (a cheaper head during training).
Embedding and LM head are the target's, frozen.
"""

import copy
import dataclasses
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.drafter import Drafter, DrafterConfig, load_drafter, save_drafter
from engine.model import apply_rotary

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


# ---- data ------------------------------------------------------------------------------------


class DataError(ValueError):
    pass


@dataclass
class Sequence:
    tokens: torch.Tensor  # [n] long
    prompt_len: int
    features: torch.Tensor  # [n, n_layers * hidden] bf16 (row n-1 is unused)
    topk_ids: torch.Tensor | None = None  # [n, k] int32: row i = the target's top-k guesses for token i
    topk_logp: torch.Tensor | None = None  # [n, k] half
    # [n] long: row i = the target's greedy choice for token i. Given for a sampled reply: a block's
    # labels are then the greedy chain from its anchor, as far as the reply follows that chain.
    greedy: torch.Tensor | None = None


class DrafterData:
    """All sequences of one or more datagen folders (comma-separated), in memory."""

    def __init__(self, path, feature_layers: list[int] | None = None):
        self.sequences: list[Sequence] = []
        folders = [Path(p) for p in str(path).split(",") if p]
        if not folders:
            raise DataError("no datagen folder given")
        for i, folder in enumerate(folders):
            meta = self._read_folder(folder, feature_layers)
            if i == 0:
                self.meta, feature_layers = meta, self.feature_layers
            elif meta.get("target") != self.meta.get("target"):
                raise DataError(f"{folder} was made with target {meta.get('target')}, {folders[0]} with {self.meta.get('target')}")
        self.num_tokens = sum(len(s.tokens) for s in self.sequences)
        self.num_response_tokens = sum(len(s.tokens) - s.prompt_len for s in self.sequences)

    def _read_folder(self, path: Path, feature_layers) -> dict:
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"{path}: not a datagen folder (no meta.json); make one with `dflash-serve datagen`")
        try:
            meta = json.loads(meta_path.read_text())
            layers = meta["feature_layers"]
        except (json.JSONDecodeError, KeyError) as e:
            raise DataError(f"{meta_path}: malformed ({e})") from None
        shards = sorted(path.glob("shard-*.pt"))
        if not shards:
            raise DataError(f"{path}: no shards (shard-*.pt); the datagen run made none yet")
        feature_layers = feature_layers or layers
        missing = set(feature_layers) - set(layers)
        if missing:
            raise DataError(f"{path} has features of target layers {layers}, not {sorted(missing)}")
        self.feature_layers = list(feature_layers)
        for shard_path in shards:
            try:
                shard = torch.load(shard_path, weights_only=True)
                self._add(shard, layers)
            except Exception as e:
                raise DataError(f"{shard_path}: malformed shard ({type(e).__name__}: {e})") from None
        return meta

    def _add(self, shard, layers):
        hidden = shard["features"].shape[1] // len(layers)
        cols = torch.cat([torch.arange(layers.index(i) * hidden, (layers.index(i) + 1) * hidden) for i in self.feature_layers])
        features = shard["features"] if len(cols) == shard["features"].shape[1] else shard["features"][:, cols]
        offsets = shard["offsets"].tolist()
        for j, p in enumerate(shard["prompt_lens"].tolist()):
            lo, hi = offsets[j], offsets[j + 1]
            if hi - p < 2:
                continue
            self.sequences.append(Sequence(
                shard["tokens"][lo:hi].long(), p, features[lo:hi],
                shard["topk_ids"][lo:hi], shard["topk_logp"][lo:hi],
            ))

    def token_frequencies(self, vocab_size) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for s in self.sequences:
            counts += torch.bincount(s.tokens[s.prompt_len:], minlength=vocab_size)
        return counts

    def feature_scale(self, max_rows=200_000) -> torch.Tensor:
        """Per-channel RMS of the features (at most `max_rows` rows), to normalise fc's input."""
        rows, total = [], 0
        for s in self.sequences:
            rows.append(s.features[:-1].float())
            total += len(rows[-1])
            if total >= max_rows:
                break
        x = torch.cat(rows)
        return x.pow(2).mean(0).sqrt().clamp_min(1e-3)


@dataclass
class Batch:
    """Blocks of several sequences, packed. Per sequence s: its context rows ctx[c_lo:c_hi] and
    its blocks blk[b_lo:b_hi] (each block_size rows)."""

    ctx_features: torch.Tensor  # [C, F]
    ctx_pos: torch.Tensor  # [C]
    block_ids: torch.Tensor  # [N, B] long: anchor token then MASK
    block_pos: torch.Tensor  # [N, B]
    labels: torch.Tensor  # [N, B-1] long, -100 = no label (past the sequence end)
    soft_ids: torch.Tensor | None  # [N, B-1, k] target's top-k guesses (None: the data has none)
    soft_logp: torch.Tensor | None  # [N, B-1, k]
    spans: list[tuple[int, int, int, int]]  # per sequence: c_lo, c_hi, b_lo, b_hi (in blocks)

    def to(self, device) -> "Batch":
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


def make_batch(sequences: list[Sequence], anchors: list[torch.Tensor], block_size: int, mask_id: int) -> Batch:
    ctx_f, ctx_p, ids, pos, labels, s_ids, s_logp, spans = [], [], [], [], [], [], [], []
    c0 = b0 = 0
    offsets = torch.arange(block_size)
    for s, a in zip(sequences, anchors):
        n = len(s.tokens)
        c = int(a.max())
        ctx_f.append(s.features[:c])
        ctx_p.append(torch.arange(c))
        block = torch.full((len(a), block_size), mask_id, dtype=torch.long)
        block[:, 0] = s.tokens[a]
        ids.append(block)
        p = a[:, None] + offsets
        pos.append(p)
        target = p[:, 1:]
        valid = target < n
        idx = target.clamp_max(n - 1)
        if s.greedy is None:
            labels.append(torch.where(valid, s.tokens[idx], -100))
        else:  # position k's label holds while the reply's tokens before it follow the greedy chain
            on_chain = (s.tokens[idx] == s.greedy[idx]).long()
            chained = torch.cat([torch.ones_like(on_chain[:, :1]), on_chain[:, :-1].cumprod(1)], 1).bool()
            labels.append(torch.where(valid & chained, s.greedy[idx], -100))
        if s.topk_ids is not None:
            s_ids.append(s.topk_ids[idx].long())
            s_logp.append(torch.where(valid[..., None], s.topk_logp[idx].float(), -torch.inf))
        spans.append((c0, c0 + c, b0, b0 + len(a)))
        c0, b0 = c0 + c, b0 + len(a)
    soft = (torch.cat(s_ids), torch.cat(s_logp)) if len(s_ids) == len(sequences) else (None, None)
    return Batch(torch.cat(ctx_f), torch.cat(ctx_p), torch.cat(ids), torch.cat(pos), torch.cat(labels), *soft, spans)


def sample_anchors(s: Sequence, num: int, generator: torch.Generator) -> torch.Tensor:
    """Random anchor positions in the response: a in [prompt_len, n-2] (each has a next token)."""
    lo, hi = s.prompt_len, len(s.tokens) - 1
    perm = torch.randperm(hi - lo, generator=generator)[:num]
    return perm.sort().values + lo


def eval_anchors(s: Sequence, block_size: int, stride: int) -> torch.Tensor:
    """Deterministic anchors whose whole block has labels, every `stride` positions."""
    return torch.arange(s.prompt_len, max(s.prompt_len, len(s.tokens) - block_size + 1), stride)


# ---- model -------------------------------------------------------------------------------------


def train_forward(drafter: Drafter, embed: torch.Tensor, batch: Batch, feature_scale: torch.Tensor | None):
    """The drafter over a packed batch: returns final hidden states of the blocks [N, B, hidden].

    Same computation as `Drafter.forward` with its cache, for many blocks at once."""
    c = drafter.config
    features = batch.ctx_features.float()
    if feature_scale is not None:
        features = features / feature_scale
    ctx = drafter.hidden_norm(drafter.fc(features))  # [C, H]
    n, b = batch.block_ids.shape
    x = F.embedding(batch.block_ids, embed).reshape(n * b, -1).to(ctx.dtype)
    cos_c, sin_c = drafter.rotary(batch.ctx_pos[None], ctx.dtype)
    cos_b, sin_b = drafter.rotary(batch.block_pos.reshape(1, -1), ctx.dtype)
    masks = [context_mask(batch, i, b) for i in range(len(batch.spans))]
    for layer in drafter.layers:
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = att.q_norm(att.q_proj(h).view(-1, c.num_heads, c.head_dim)).transpose(0, 1)[None]
        q = apply_rotary(q, cos_b, sin_b)
        kv = torch.cat([ctx, h])
        k = att.k_norm(att.k_proj(kv).view(-1, c.num_kv_heads, c.head_dim)).transpose(0, 1)[None]
        v = att.v_proj(kv).view(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)[None]
        k = torch.cat([apply_rotary(k[:, :, : len(ctx)], cos_c, sin_c), apply_rotary(k[:, :, len(ctx):], cos_b, sin_b)], 2)
        outs = []
        for (c_lo, c_hi, b_lo, b_hi), mask in zip(batch.spans, masks):
            rows, own = slice(b_lo * b, b_hi * b), slice(len(ctx) + b_lo * b, len(ctx) + b_hi * b)
            outs.append(block_attention(q[:, :, rows], k[:, :, c_lo:c_hi], v[:, :, c_lo:c_hi], k[:, :, own], v[:, :, own], mask, b))
        out = torch.cat(outs, 2)[0].transpose(0, 1).reshape(n * b, -1)
        x = x + att.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(n, b, -1)


def context_mask(batch: Batch, i: int, b: int) -> torch.Tensor:
    """[rows, ctx] bool for sequence i: which context positions each block row sees (those before its anchor)."""
    c_lo, c_hi, b_lo, b_hi = batch.spans[i]
    anchor = batch.block_pos[b_lo:b_hi, 0].repeat_interleave(b)  # [rows]
    return batch.ctx_pos[c_lo:c_hi][None] < anchor[:, None]


def block_attention(q, k_ctx, v_ctx, k_own, v_own, ctx_mask, b):
    """Attention of one sequence's blocks: each row sees the context its mask allows and its own block's b
    rows (all of them), never another block. q [1, heads, rows, dim]; k_ctx, v_ctx [1, kv_heads, ctx, dim];
    k_own, v_own [1, kv_heads, rows, dim]; ctx_mask [rows, ctx] bool; rows = blocks * b.

    The same as masked attention over [context, every block] with a block-diagonal mask, without the
    work on the other blocks' keys, which are most of them (128 blocks of 16 against a few hundred context
    positions): the scores are two matmuls, one softmax over [context, own block]."""
    _, heads, rows, dim = q.shape
    kv_heads, blocks = k_ctx.shape[1], rows // b
    qg = q.view(1, kv_heads, heads // kv_heads, rows, dim)  # query heads grouped by the KV head they read
    ctx_scores = (qg @ k_ctx[:, :, None].transpose(-1, -2)).masked_fill(~ctx_mask, float("-inf"))
    own_scores = qg.view(*qg.shape[:3], blocks, b, dim) @ k_own.view(1, kv_heads, 1, blocks, b, dim).transpose(-1, -2)
    scores = torch.cat([ctx_scores, own_scores.flatten(3, 4)], -1).float() * dim**-0.5
    p = scores.softmax(-1).to(v_ctx.dtype)
    p_ctx, p_own = p.split([k_ctx.shape[2], b], -1)
    own = p_own.reshape(*qg.shape[:3], blocks, b, b) @ v_own.view(1, kv_heads, 1, blocks, b, dim)
    return (p_ctx @ v_ctx[:, :, None] + own.flatten(3, 4)).view(1, heads, rows, dim)


# ---- loss and metrics ------------------------------------------------------------------------------


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    gamma = gamma or GAMMA.get(block_size, 7.0)
    return torch.exp(-torch.arange(block_size - 1) / gamma)


def loss_and_accuracy(hidden, head: torch.Tensor, vocab_map: torch.Tensor | None, batch: Batch, weights, distill: float):
    """Decayed cross-entropy over the masked positions (+ distillation from the target's top-k).

    head [V', hidden]: the LM head's rows (all, or the training vocabulary subset);
    vocab_map [vocab] long: token id -> row of `head`, -1 if not in the subset (None: identity)."""
    logits = (hidden[:, 1:] @ head.T).float()  # [N, B-1, V']
    logp = logits.log_softmax(-1)
    labels = batch.labels if vocab_map is None else torch.where(batch.labels >= 0, vocab_map[batch.labels.clamp_min(0)], -1)
    has = labels >= 0
    nll = -logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    loss_pos = torch.where(has, nll, 0.0)
    if distill > 0:
        soft = batch.soft_ids if vocab_map is None else vocab_map[batch.soft_ids]
        target_p = torch.where(soft >= 0, batch.soft_logp, -torch.inf).softmax(-1).nan_to_num(0.0)
        soft_nll = -(target_p * logp.gather(-1, soft.clamp_min(0))).sum(-1)
        loss_pos = (1 - distill) * loss_pos + distill * torch.where(has, soft_nll, 0.0)
    w = weights[None] * has
    loss = (loss_pos * w).sum() / w.sum().clamp_min(1.0)
    correct = (logits.argmax(-1) == labels) & has
    accuracy = correct.sum(0).float() / has.sum(0).clamp_min(1)
    return loss, accuracy.detach()


@torch.no_grad()
def matched_drafts(drafter, embed, head, s: Sequence, anchors: torch.Tensor, cfg, feature_scale=None, vocab_ids=None):
    """Greedy drafts of the blocks at `anchors` against the target's tokens: [blocks, B-1] 1 while
    every draft so far matched, with the full head and (if `vocab_ids`) with a reduced one (else None)."""
    batch = make_batch([s], [anchors], cfg.block_size, drafter.config.mask_token_id).to(head.device)
    with autocast(cfg):
        hidden = train_forward(drafter, embed, batch, feature_scale)
    hidden = hidden[:, 1:].to(head.dtype)
    ok = ((hidden @ head.T).argmax(-1) == batch.labels).long().cumprod(-1)
    if vocab_ids is None:
        return ok, None
    drafts = vocab_ids[(hidden @ head[vocab_ids].T).argmax(-1)]
    return ok, (drafts == batch.labels).long().cumprod(-1)


@torch.no_grad()
def evaluate(drafter, embed, head, data: DrafterData, cfg, feature_scale, vocab_ids=None, stride=16, max_blocks=2048):
    """Held-out greedy acceptance: per block, the run of leading drafts equal to the target's
    tokens. Returns tau (= 1 + mean accepted), its interval and per-position acceptance with the FULL
    head, and the same with a `_reduced_head` suffix when the drafter may only propose `vocab_ids`, if given."""
    drafter.eval()
    b = cfg.block_size
    device = head.device
    accepted, accepted_reduced, reached, reached_reduced = [], [], torch.zeros(b - 1, device=device), 0
    blocks = 0
    for s in data.sequences:
        a = eval_anchors(s, b, stride)
        if len(a) == 0:
            continue
        ok, ok_reduced = matched_drafts(drafter, embed, head, s, a, cfg, feature_scale, vocab_ids)
        accepted.append(ok.sum(-1))
        reached += ok.sum(0)
        if vocab_ids is not None:
            accepted_reduced.append(ok_reduced.sum(-1))
            reached_reduced = reached_reduced + ok_reduced.sum(0)
        blocks += len(a)
        if blocks >= max_blocks:
            break
    drafter.train()
    result = {"tau": 1 + torch.cat(accepted).float().mean().item(), "acceptance_per_pos": (reached / blocks).cpu().tolist(),
              "tau_ci": reply_bootstrap([a.cpu() for a in accepted])}
    if vocab_ids is not None:
        result["tau_reduced_head"] = 1 + torch.cat(accepted_reduced).float().mean().item()
        result["acceptance_per_pos_reduced_head"] = (reached_reduced / blocks).cpu().tolist()
        result["tau_ci_reduced_head"] = reply_bootstrap([a.cpu() for a in accepted_reduced])
    return result


def reply_bootstrap(accepted: list[torch.Tensor], rounds=1000, seed=0) -> list[float]:
    """95% interval of tau over replies resampled with replacement (accepted: one tensor of
    per-block accepted counts per reply). One looping reply, fully accepted block after block, can
    move a 128-reply tau by 0.1; the interval says how far apart two drafters must be."""
    sums = torch.tensor([float(a.sum()) for a in accepted])
    counts = torch.tensor([float(len(a)) for a in accepted])
    idx = torch.randint(len(accepted), (rounds, len(accepted)), generator=torch.Generator().manual_seed(seed))
    taus = 1 + sums[idx].sum(1) / counts[idx].sum(1)
    return torch.quantile(taus, torch.tensor([0.025, 0.975])).tolist()


def autocast(cfg):
    return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=cfg.bf16)


# ---- initialisation ---------------------------------------------------------------------------------


def init_from_target(drafter: Drafter, target, layer_ids: list[int]):
    """Copy target layers' attention/MLP/norm weights into the draft layers (q/k norms stay ones)."""
    for draft_layer, i in zip(drafter.layers, layer_ids):
        t = target.layers[i]
        h = drafter.config.num_heads * drafter.config.head_dim
        kv = drafter.config.num_kv_heads * drafter.config.head_dim
        q, k, v = t.self_attn.qkv.weight.split([h, kv, kv])
        a = draft_layer.self_attn
        a.q_proj.weight.data.copy_(q)
        a.k_proj.weight.data.copy_(k)
        a.v_proj.weight.data.copy_(v)
        a.o_proj.weight.data.copy_(t.self_attn.o_proj.weight)
        gate, up = t.mlp.gate_up.weight.chunk(2)
        draft_layer.mlp.gate_proj.weight.data.copy_(gate)
        draft_layer.mlp.up_proj.weight.data.copy_(up)
        draft_layer.mlp.down_proj.weight.data.copy_(t.mlp.down_proj.weight)
        draft_layer.input_layernorm.weight.data.copy_(t.input_layernorm.weight)
        draft_layer.post_attention_layernorm.weight.data.copy_(t.post_attention_layernorm.weight)
    drafter.norm.weight.data.copy_(target.norm.weight)


# ---- the training run ---------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    data: str
    out: str
    held_out: str | None = None
    target: str | None = None  # None: the default model
    num_layers: int = 1
    block_size: int = 16
    mask_token_id: int | None = None  # None: the default model's (16)
    feature_layers: list[int] | None = None  # None: every layer the data has
    init: str = "random"  # random | target | a drafter folder (go on training it)
    feature_norm: bool = False
    vocab_subset: int = 0  # train the head over the N most frequent tokens only (0: all)
    distill: float = 0.0  # weight of the target's top-k distribution in the loss
    anchors: int = 32  # blocks per sequence per step
    seqs_per_step: int = 4
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    clip: float = 1.0
    steps: int = 1000
    cpu_minutes: float = 0.0  # > 0: stop after this much process CPU time; the schedule follows it
    eval_every: int = 200
    save_every: int = 100
    seed: int = 0
    bf16: bool | None = None  # None: bf16 autocast where bf16 matmuls are native (engine.loading.pick_dtype)
    device: str = "cpu"  # cpu or cuda[:N]; the data stays in host memory, each step's batch is moved

    def check(self):
        from engine.loading import check_device, pick_dtype

        check_device(self.device)
        if self.bf16 is None:
            self.bf16 = pick_dtype("auto", self.device) == torch.bfloat16
        for name in ("num_layers", "block_size", "anchors", "seqs_per_step", "steps", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError("--block-size must be >= 2")
        if self.init not in ("random", "target") and not (Path(self.init) / "config.json").exists():
            raise ValueError(f"--init must be random, target or a drafter folder (with config.json), got {self.init!r}")
        if self.feature_norm and self.init not in ("random", "target"):
            raise ValueError("--feature-norm with --init DRAFTER: a saved drafter's fc already reads raw features")
        if not 0 <= self.distill <= 1:
            raise ValueError(f"--distill must be in [0, 1], got {self.distill}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")


class TrainModule(torch.nn.Module):
    """The drafter plus what its training forward needs, as one module (so DDP can wrap it)."""

    def __init__(self, drafter: Drafter, embed, feature_scale):
        super().__init__()
        self.drafter = drafter
        # plain attributes, not buffers: frozen, and DDP must not broadcast them every step
        self.embed, self.feature_scale = embed, feature_scale

    def forward(self, batch: Batch):
        scale = self.feature_scale if self.feature_scale.numel() else None
        return train_forward(self.drafter, self.embed, batch, scale)


def folded_drafter(drafter: Drafter, feature_scale) -> Drafter:
    """A copy whose fc reads raw features: fc(x / s) == (W / s) x keeps the z-lab format."""
    import copy

    out = copy.deepcopy(drafter).cpu()
    if feature_scale is not None and feature_scale.numel():
        out.fc.weight.data /= feature_scale[None].to("cpu", out.fc.weight.dtype)
    return out


def init_from_drafter(drafter: Drafter, cfg: TrainConfig) -> torch.Tensor | None:
    """Start from a saved drafter's weights (to go on training it on more data); returns its draft
    vocabulary, which the head then trains over (None: the whole vocabulary)."""
    saved = load_drafter(cfg.init)
    fields = ("num_layers", "block_size", "mask_token_id", "target_layer_ids", "hidden_size")
    theirs, ours = ({f: getattr(c, f) for f in fields} for c in (saved.config, drafter.config))
    if theirs != ours:
        raise ValueError(f"--init {cfg.init}: that drafter ({theirs}) does not match this run's ({ours}); "
                         "set --num-layers, --block-size, --mask-token-id and --feature-layers to match")
    vocab = saved.draft_vocab
    if cfg.vocab_subset and (vocab is None or len(vocab) != cfg.vocab_subset):
        raise ValueError(f"--vocab-subset {cfg.vocab_subset}: the drafter in --init {cfg.init} has "
                         f"{'no draft vocabulary' if vocab is None else f'a draft vocabulary of {len(vocab)}'}")
    drafter.load_state_dict(saved.state_dict())
    return vocab


def schedule(cfg: TrainConfig, progress: float) -> float:
    """Linear warm-up then cosine decay to 10% of the peak, over progress in [0, 1]."""
    if progress < cfg.warmup:
        return max(progress / cfg.warmup, 0.01)
    t = min(1.0, (progress - cfg.warmup) / (1 - cfg.warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def setup(cfg: TrainConfig):
    """Data, target head, drafter and its training module for a config."""
    from engine.default_model import MASK_TOKEN_ID, resolve_model_path
    from engine.drafter import check_drafter_fits
    from engine.model import load_target

    data = DrafterData(cfg.data, cfg.feature_layers)
    if cfg.held_out == "default":
        cfg.held_out = str(default_held_out(cfg.target or data.meta.get("target"), cfg.bf16, cfg.device))
    held_out = DrafterData(cfg.held_out, data.feature_layers) if cfg.held_out else None
    unrecorded = "an unrecorded dtype"
    if held_out and (held_dtype := held_out.meta.get("dtype", unrecorded)) != (data_dtype := data.meta.get("dtype", unrecorded)):
        print(f"train: warning: the held-out data was made in {held_dtype} and the training data in {data_dtype}; the "
              "target's features differ between dtypes, so held-out tau is not what serving in the training dtype gets",
              file=sys.stderr)
    target_path = resolve_model_path(cfg.target or data.meta.get("target"))
    target = load_target(target_path, torch.float32)
    torch.manual_seed(cfg.seed)
    dc = DrafterConfig.for_target(
        target.config, cfg.num_layers, MASK_TOKEN_ID if cfg.mask_token_id is None else cfg.mask_token_id,
        cfg.block_size, target_layer_ids=list(data.feature_layers),
    )
    drafter = Drafter(dc)
    check_drafter_fits(dc, target.config)
    keep = None  # the draft vocabulary the head is trained over
    if cfg.init == "target":
        last = target.config.num_layers
        init_from_target(drafter, target, list(range(last - cfg.num_layers, last)))
    elif cfg.init != "random":
        keep = init_from_drafter(drafter, cfg)
    device = torch.device(cfg.device)
    drafter.to(device)
    scale = (data.feature_scale() if cfg.feature_norm else torch.zeros(0)).to(device)
    embed = target.embed_tokens.weight.detach().to(device, torch.bfloat16 if cfg.bf16 else torch.float32)
    head = target.lm_head.weight.detach().to(device, embed.dtype)
    vocab_map = None
    train_head = head
    if cfg.vocab_subset and keep is None:
        keep = data.token_frequencies(dc.vocab_size).argsort(descending=True)[: cfg.vocab_subset]
    if keep is not None:
        keep = keep.to(device)
        vocab_map = torch.full((dc.vocab_size,), -1, dtype=torch.long, device=device)
        vocab_map[keep] = torch.arange(len(keep), device=device)
        train_head = head[keep.to(device)]
    return data, held_out, TrainModule(drafter, embed, scale), head, train_head, vocab_map


def train(cfg: TrainConfig, rank=0, world_size=1, wrap=None, report=None, quiet=False, on_end=None):
    """Train a drafter; resumable from cfg.out/checkpoint.pt. `wrap` (e.g. Ray Train's
    prepare_model) wraps the module for data-parallel training; `report(metrics, path)` is
    called after each save; `on_end(drafter)` at the end on every rank. Returns the final metrics."""
    cfg.check()
    out = Path(cfg.out)
    ckpt_path = out / "checkpoint.pt"
    data, held_out, module, head, train_head, vocab_map = setup(cfg)
    drafter = module.drafter
    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    state = {"step": 0, "cpu_seconds": 0.0, "wall_seconds": 0.0, "blocks": 0}
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        drafter.load_state_dict(ckpt["drafter"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state = ckpt["state"]
        if rank == 0 and (out / "log.jsonl").exists():  # drop what was logged after the last save
            lines = (out / "log.jsonl").read_text().splitlines(keepends=True)
            (out / "log.jsonl").write_text("".join(l for l in lines if json.loads(l)["step"] <= state["step"]))
        generator.set_state(ckpt["generator"][rank] if rank < len(ckpt["generator"]) else ckpt["generator"][0])
    model = wrap(module) if wrap else module
    weights = position_weights(cfg.block_size).to(cfg.device)
    vocab_ids = None if vocab_map is None else (vocab_map >= 0).nonzero()[:, 0]
    log_path = out / "log.jsonl"
    scale = module.feature_scale if module.feature_scale.numel() else None

    def save():
        if rank != 0:
            return
        tmp = out / "checkpoint.pt.tmp"
        torch.save({"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                    "generator": [generator.get_state()], "config": asdict(cfg)}, tmp)
        tmp.rename(ckpt_path)
        save_drafter(folded_drafter(drafter, scale), out / "drafter", draft_vocab=vocab_ids)

    def log(entry):
        if rank == 0:
            with log_path.open("a") as f:
                f.write(json.dumps(entry) + "\n")

    def progress():
        if cfg.cpu_minutes > 0:
            return state["cpu_seconds"] / (cfg.cpu_minutes * 60)
        return state["step"] / cfg.steps

    def run_eval():
        if held_out is None or rank != 0:
            return {}
        entry = {"eval": True, "step": state["step"], "cpu_seconds": state["cpu_seconds"],
                 "wall_seconds": state["wall_seconds"], **evaluate(drafter, module.embed, head, held_out, cfg, scale, vocab_ids)}
        log(entry)
        return entry

    if state["step"] == 0:
        run_eval()
    bar = tqdm(total=cfg.steps if cfg.cpu_minutes <= 0 else None, initial=state["step"], desc="train",
               unit="step", disable=quiet or rank != 0)
    last = {}
    while progress() < 1:
        t_cpu, t_wall = time.process_time(), time.perf_counter()
        for g in optimizer.param_groups:
            g["lr"] = cfg.lr * schedule(cfg, progress())
        picks = torch.randint(len(data.sequences), (cfg.seqs_per_step,), generator=generator).tolist()
        seqs = [data.sequences[i] for i in picks]
        anchors = [sample_anchors(s, cfg.anchors, generator) for s in seqs]
        batch = make_batch(seqs, anchors, cfg.block_size, drafter.config.mask_token_id).to(cfg.device)
        with autocast(cfg):
            hidden = model(batch)
            loss, accuracy = loss_and_accuracy(hidden, train_head, vocab_map, batch, weights, cfg.distill)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        optimizer.step()
        state["step"] += 1
        state["blocks"] += len(batch.block_ids) * world_size
        state["cpu_seconds"] += time.process_time() - t_cpu
        state["wall_seconds"] += time.perf_counter() - t_wall
        last = {"step": state["step"], "loss": loss.item(), "grad_norm": grad_norm.item(),
                "lr": optimizer.param_groups[0]["lr"], "accuracy_per_pos": [round(a, 4) for a in accuracy.tolist()],
                "cpu_seconds": state["cpu_seconds"], "wall_seconds": state["wall_seconds"], "blocks": state["blocks"]}
        log(last)
        bar.update(1)
        bar.set_postfix(loss=f"{last['loss']:.3f}", acc=" ".join(f"{a:.2f}" for a in accuracy[:4].tolist()))
        if state["step"] % cfg.eval_every == 0:
            ev = run_eval()
            if ev:
                lo, hi = ev["tau_ci"]
                bar.write(f"step {state['step']}: held-out tau {ev['tau']:.3f} (95% over replies {lo:.3f}-{hi:.3f})")
        if state["step"] % cfg.save_every == 0:
            save()
            if report:
                report(last, out)
    bar.close()
    final = run_eval()
    save()
    if report:
        report(dict(last, **final), out)
    if rank == 0:
        plot_curves(log_path, out / "curves.png")
    if on_end:
        on_end(drafter)
    return dict(last, **final)


def default_held_out(target, bf16: bool, device="cpu") -> Path:
    """The committed held-out prompts' data for `target` in the dtype the drafter is trained (and served) in."""
    from engine.datagen import held_out_data
    from engine.loading import load

    return held_out_data(load(target, draft="none", dtype="bfloat16" if bf16 else "float32", device=device))


def evaluate_drafter(draft, target=None, dtype="auto", held_out="default", device="cpu") -> dict:
    """Held-out greedy tau (block = the drafter's) of a drafter folder, per kind of prompt (chat, code),
    computed as training evaluates: {"chat": {...}, "code": {...}} with tau, tau_ci, acceptance_per_pos.
    Held-out data made from a prompt file (`datagen --prompts data/prompts/agent.jsonl`) names its
    non-code replies after the file ("agent"), not "chat"."""
    from engine.datagen import CODE_PROMPT
    from engine.loading import load

    loaded = load(target, draft, dtype, device)
    bf16 = loaded.dtype == torch.bfloat16
    path = held_out if held_out != "default" else default_held_out(target, bf16, device)
    data = DrafterData(path, loaded.drafter.config.target_layer_ids)
    drafter = load_drafter(draft if draft != "default" else loaded.drafter_name, device=device)  # float32 under autocast, as training
    cfg = TrainConfig(data=str(path), out="-", block_size=drafter.config.block_size, bf16=bf16, device=device)
    embed = loaded.target.embed_tokens.weight.detach()
    head = loaded.target.lm_head.weight.detach()
    result = {"held_out": str(path), "dtype": str(loaded.dtype).removeprefix("torch.")}
    other = Path(data.meta["prompts"]).name.split(".")[0] if data.meta.get("prompts") else "chat"
    for kind in (other, "code"):
        part = copy.copy(data)
        part.sequences = [s for s in data.sequences
                          if (CODE_PROMPT in loaded.tokenizer.decode(s.tokens[: s.prompt_len])) == (kind == "code")]
        if part.sequences:
            r = evaluate(drafter, embed, head, part, cfg, None, max_blocks=10**9)
            result[kind] = {"replies": len(part.sequences), **r}
    return result


def read_log(path):
    entries = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [e for e in entries if not e.get("eval")], [e for e in entries if e.get("eval")]


def plot_curves(log_path, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = read_log(log_path)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if steps:
        x = [e["step"] for e in steps]
        k = max(1, len(steps) // 100)
        smooth = lambda ys: [sum(ys[max(0, i - k): i + 1]) / len(ys[max(0, i - k): i + 1]) for i in range(len(ys))]
        axes[0].plot(x, smooth([e["loss"] for e in steps]))
        axes[0].set(xlabel="step", ylabel="training loss (smoothed)", title="loss")
        for pos in (0, 1, 2, 4, 8):
            if pos < len(steps[0]["accuracy_per_pos"]):
                axes[1].plot(x, smooth([e["accuracy_per_pos"][pos] for e in steps]), label=f"position {pos + 1}")
        axes[1].set(xlabel="step", ylabel="training accuracy (smoothed)", title="per-position accuracy")
        axes[1].legend()
    if evals:
        axes[2].plot([e["cpu_seconds"] / 3600 for e in evals], [e["tau"] for e in evals], marker="o")
    axes[2].set(xlabel="CPU-hours", ylabel="held-out tau (greedy, full block)", title="acceptance length")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
