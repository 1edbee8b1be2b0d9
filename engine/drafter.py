"""The DFlash drafter: a few non-causal Qwen3-style layers that fill a block of masked positions
in one forward pass, conditioned on the target's hidden states through K/V injection.

It owns its layers, its config and the z-lab checkpoint format (config.json + model.safetensors).
It borrows the target's embedding table and LM head at call time and stores neither.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from engine.model import (
    CachedModel, Linear, ModelConfig, RMSNorm, Rotary, apply_rotary, can_pack, masked_attention, read_hf_config,
)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's choice: round(1 + i * (L - 4) / (n - 1)); one draft layer reads L // 2."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960

    def __post_init__(self):
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_layers)

    @classmethod
    def for_target(cls, target: ModelConfig, num_layers=1, mask_token_id=0, block_size=16, **kw):
        """A drafter shaped like `target` (same hidden size, heads and RoPE)."""
        return cls(
            hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_layers=num_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim, vocab_size=target.vocab_size,
            num_target_layers=target.num_layers, mask_token_id=mask_token_id, block_size=block_size,
            rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling, max_position_embeddings=target.max_position_embeddings, **kw,
        )

    @classmethod
    def from_hf(cls, hf: dict) -> "DrafterConfig":
        base = ModelConfig.from_hf(dict(hf, model_type="qwen3"))
        dflash = hf.get("dflash_config", {})
        return cls(
            hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
            num_layers=base.num_layers, num_heads=base.num_heads, num_kv_heads=base.num_kv_heads,
            head_dim=base.head_dim, vocab_size=base.vocab_size,
            num_target_layers=hf["num_target_layers"],
            mask_token_id=dflash.get("mask_token_id", hf.get("mask_token_id")),
            block_size=int(dflash.get("block_size", hf.get("block_size", 16))),
            target_layer_ids=list(dflash.get("target_layer_ids", hf.get("target_layer_ids", []))),
            rms_norm_eps=base.rms_norm_eps, rope_theta=base.rope_theta, rope_scaling=base.rope_scaling,
            max_position_embeddings=base.max_position_embeddings,
        )

    def to_hf(self) -> dict:
        """A Qwen3 config plus DFlash's fields: what z-lab's DFlashDraftModel reads."""
        rope = dict(self.rope_scaling or {"rope_type": "default"}, rope_theta=self.rope_theta)
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "block_size": self.block_size,
                "target_layer_ids": self.target_layer_ids,
            },
        }

    def rope_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
        )


class DraftAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def keys_values(self, kv_in, rope):
        """Keys (normed, rotated) and values [batch, kv heads, n, head dim] of kv_in [batch, n, hidden]."""
        batch, cos, sin = kv_in.shape[0], *rope
        k = self.k_norm(self.k_proj(kv_in).view(batch, -1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(kv_in).view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k.transpose(1, 2), cos, sin), v

    def forward(self, x, ctx, rope, cache, layer, slots, write_pos, kv_len, mask):
        """x [batch, b, hidden] block; ctx [batch, c, hidden] projected target features."""
        batch, b, _ = x.shape
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).view(batch, b, self.num_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), cos[:, :, -b:], sin[:, :, -b:])
        k, v = self.keys_values(torch.cat([ctx, x], dim=1), rope)  # context keys come from the SAME k/v projections
        slot_ids, read_index = slots
        cache.write(layer, slot_ids, write_pos, k, v)
        keys, values = cache.read(layer, read_index, kv_len)
        out = masked_attention(q, keys, values, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, b, -1))


class DraftMLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DraftMLP(c)

    def forward(self, x, ctx, *attn_args):
        x = x + self.self_attn(self.input_layernorm(x), ctx, *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(CachedModel):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))
        self.fc = Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.rope_config())
        self.draft_vocab: torch.Tensor | None = None  # reduced draft head: the only ids it proposes

    def forward(self, ctx_features, block_embeds, positions, cache, slots, kv_len, block_end):
        """One denoising pass over a block; writes context (and stale block) keys to the cache.

        ctx_features [batch, c, n_target_layers * hidden]: target features not yet seen (c may be 0)
        block_embeds [batch, b, hidden]: target embeddings of [last token, MASK, ...]
        positions    [batch, c + b] long: context then block positions, -1 = padding
        block_end    [batch] long: one past each row's last block position
        returns the block's final hidden states [batch, b, hidden]
        """
        x = block_embeds.to(self.dtype)
        ctx, rope, write_pos = self._context(ctx_features, positions, cache)
        slots = cache.batch_index(slots)
        key_pos = torch.arange(kv_len, device=x.device)
        mask = (key_pos < block_end[:, None])[:, None, None]  # [batch, 1, 1, kv_len]: non-causal
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope, cache, i, slots, write_pos, kv_len, mask)
        return self.norm(x)

    def take_context(self, ctx_features, positions, cache, slots):
        """Write target features' keys and values to the cache without drafting: what forward() does with
        its context, apart from a block pass. ctx_features [batch, c, n_target_layers * hidden];
        positions [batch, c] long, -1 = padding."""
        ctx, rope, write_pos = self._context(ctx_features, positions, cache)
        slot_ids, _ = cache.batch_index(slots)
        for i, layer in enumerate(self.layers):
            cache.write(i, slot_ids, write_pos, *layer.self_attn.keys_values(ctx, rope))


    def _context(self, ctx_features, positions, cache):
        """The projected target features, the rotary tables of `positions`, and where each position's
        keys go in the cache (padding, -1, to the spare position max_len)."""
        ctx = self.hidden_norm(self.fc(ctx_features.to(self.dtype)))
        rope = self.rotary(positions.clamp_min(0), self.dtype)
        return ctx, rope, torch.where(positions >= 0, positions, cache.max_len)


def check_drafter_fits(drafter_config: DrafterConfig, target_config: ModelConfig):
    c, t = drafter_config, target_config
    if c.hidden_size != t.hidden_size:
        raise ValueError(f"drafter hidden size {c.hidden_size} does not match the target's {t.hidden_size}")
    if c.vocab_size != t.vocab_size:
        raise ValueError(f"drafter vocabulary {c.vocab_size} does not match the target's {t.vocab_size}")
    if c.num_target_layers != t.num_layers or max(c.target_layer_ids) >= t.num_layers:
        raise ValueError(
            f"drafter reads target layers {c.target_layer_ids} of {c.num_target_layers}, "
            f"but the target has {t.num_layers} layers"
        )
    if not 0 <= c.mask_token_id < t.vocab_size:
        raise ValueError(f"drafter mask token {c.mask_token_id} is outside the target vocabulary")


class DraftHead:
    """The target's LM head as the drafter reads it: over the drafter's draft vocabulary when it has
    one (a reduced head: only those rows of the LM head, packed like the target's linear layers),
    else the whole head. Scores are float32 over the head's own vocabulary; `ids` maps their last
    axis to token ids."""

    def __init__(self, lm_head, draft_vocab=None):
        self.draft_vocab = None if draft_vocab is None else draft_vocab.to(lm_head.weight.device)
        if self.draft_vocab is None:
            self.linear = lm_head
        else:
            weight = lm_head.weight.detach()[self.draft_vocab]
            self.linear = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            self.linear.weight = nn.Parameter(weight, requires_grad=False)
            if can_pack(weight.dtype, weight.device):
                self.linear.pack()

    @property
    def size(self) -> int:
        return self.linear.weight.shape[0]

    def scores(self, hidden):
        """hidden [..., hidden] -> float32 scores [..., size]. The positions are flattened first: a
        non-contiguous [batch, b, hidden] slice would make the matmul a bmm that copies the head once
        per row when autograd is off."""
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.linear.weight.dtype)
        return self.linear(flat).float().view(*hidden.shape[:-1], -1)

    def ids(self, index):
        """Token ids of score indices (any shape)."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def to_vocab(self, values, vocab_size: int, fill: float = 0.0):
        """[..., size] -> [..., vocab_size]: values at the draft vocabulary's ids, `fill` elsewhere."""
        if self.draft_vocab is None:
            return values
        out = values.new_full((*values.shape[:-1], vocab_size), fill)
        return out.index_copy_(-1, self.draft_vocab, values)


DRAFT_VOCAB_FILE = "draft_vocab.json"


def load_drafter(path, dtype=torch.float32, device="cpu") -> Drafter:
    """Load a z-lab format drafter folder (config.json + model.safetensors), and its reduced draft
    vocabulary (draft_vocab.json, our addition that z-lab's loader ignores) when there is one."""
    config = DrafterConfig.from_hf(read_hf_config(path))
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in drafter path {path!s}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    drafter = Drafter(config)
    drafter.load_state_dict(state)
    vocab_file = Path(path) / DRAFT_VOCAB_FILE
    if vocab_file.exists():
        ids = json.loads(vocab_file.read_text())
        if not ids or not all(isinstance(i, int) and 0 <= i < config.vocab_size for i in ids):
            raise ValueError(f"{vocab_file}: expected a non-empty list of token ids below {config.vocab_size}")
        drafter.draft_vocab = torch.tensor(ids, device=device)
    return drafter.to(device=device, dtype=dtype).eval()


def save_drafter(drafter: Drafter, path, dtype=torch.bfloat16, draft_vocab=None):
    """Save in z-lab format; z-lab's DFlashDraftModel.from_pretrained loads the result.
    draft_vocab: token ids the drafter may propose (a reduced head at inference), or None."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(drafter.config.to_hf(), dtype=str(dtype).removeprefix("torch."))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if draft_vocab is not None:
        (path / DRAFT_VOCAB_FILE).write_text(json.dumps(sorted(int(i) for i in draft_vocab)) + "\n")
