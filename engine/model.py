"""A lean forward for the Llama family (Llama, SmolLM, Mistral, Qwen2, Qwen3) over a slotted KV cache.

One call runs a batch of requests at different positions (per-row positions, padding = -1) and
returns logits plus the hidden states of requested layers (DFlash's context features). It loads
Hugging Face safetensors checkpoints by their standard names; it knows nothing about drafting.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine.kv_cache import KVCache, SlotTable

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        attention_bias = bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias"):
            raise ValueError("MLP biases (mlp_bias) are not supported by the lean forward")
        # Exact only within a sliding window: cap the context there instead of approximating.
        window = hf.get("sliding_window") if hf.get("use_sliding_window", model_type == "mistral") else None
        max_positions = min(hf.get("max_position_embeddings", 2048), window or 1 << 62)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "mistral") and attention_bias,
            qk_norm=model_type == "qwen3",
            model_type=model_type,
        )


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with Llama-3 and linear scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(medium, scaled, inv_freq)
    elif scaling:
        raise ValueError(f"rope scaling {scaling.get('rope_type')!r} is not supported")
    return inv_freq.float()


class Rotary(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions, dtype):
        """positions [batch, q] -> cos, sin [batch, 1, q, head_dim] in `dtype`, for apply_rotary
        (sin's first half negated: the rotation is then one roll, not slices and a cat)."""
        freqs = positions[..., None].float() * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], dim=-1)[:, None].to(dtype), torch.cat([-sin, sin], dim=-1)[:, None].to(dtype)


def attention(q, keys, values, mask):
    """Grouped-query attention. q [batch, heads, q, dim]; keys/values [batch, kv_heads, kv_len, dim];
    mask [batch, 1, q, kv_len] bool, or None: causal with q == kv_len (query i sees keys 0..i).

    A causal prefill skips the masked half of the work (the fused kernel knows which tiles to skip,
    not so with a mask). One-query steps in bf16 on a CPU use plain float32 matmuls: torch's fused CPU
    kernel is several times slower there, and such tiny matmuls run faster in float32 than in bf16,
    conversions included (the timings are in docs/design.md).
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    if q.shape[2] > 1 or q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return masked_attention(q, keys, values, mask)
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    scores = (q.view(batch, kv_heads, heads // kv_heads, dim).float() @ keys.transpose(-1, -2).float()) * dim**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))  # [batch, kv_heads, group, kv_len]
    return (scores.softmax(-1) @ values.float()).to(q.dtype).view(batch, heads, 1, dim)


def masked_attention(q, keys, values, mask):
    """Attention with a boolean mask [batch or 1, 1, q, kv_len] (or [q, kv_len]), grouped-query or not.

    On a GPU, grouped queries run as plain attention (grouped_attention): with a mask, SDPA's grouped
    path is the math one, which repeats the keys and values for every query head."""
    if q.device.type == "cuda" and q.shape[1] != keys.shape[1]:
        return grouped_attention(q, keys, values, mask)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def grouped_attention(q, keys, values, mask):
    """Grouped-query attention as plain attention: the query heads that share a KV head become more query
    rows of that head (head h reads KV head h // group), so a fused kernel runs it without copying keys.
    q [batch, heads, q, dim]; keys/values [batch, kv_heads, kv_len, dim]; mask [..., q, kv_len] bool."""
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    mask = mask.reshape(-1, 1, q_len, kv_len).expand(batch, 1, q_len, kv_len).repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, group * q_len, dim), keys, values, attn_mask=mask)
    return out.view(batch, heads, q_len, dim)


def apply_rotary(x, cos, sin):
    """Rotary embedding with Rotary's cos and signed sin: x * cos + [-x2, x1] * sin, rounded the same."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalised in float32, rounded to x's dtype, then scaled (as transformers' Llama does)
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


def can_pack(dtype, device) -> bool:
    """Whether Linear.pack applies: float32 on a CPU, or bf16 on a CPU whose oneDNN runs bf16."""
    if torch.device(device).type != "cpu":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Linear):
    """nn.Linear that can also keep its weight in oneDNN's blocked layout (`pack`, bf16 on a CPU).

    F.linear in bf16 on a CPU re-lays the weight out on every call; the packed weight skips that, about
    half the time for a layer streamed from memory (docs/design.md). One row is sent as two (the same row
    twice): oneDNN's packed kernel for a single row is pathologically slow. Grad mode uses the plain
    weight (the packed op has no backward).
    Pack once the weights are final: the packed copy does not follow later changes to `weight`.
    """

    packed = None
    pack_rows = 16  # the row count oneDNN lays the packed weight out for

    def pack(self):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.pack_rows)

    def forward(self, x):
        if self.packed is None or torch.is_grad_enabled():
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        one_as_two = n == 1 and rows.dtype == torch.bfloat16
        out = torch.ops.mkldnn._linear_pointwise(rows.expand(2, -1) if one_as_two else rows, self.packed, self.bias, "none", [], "")
        return out[:n].view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> nn.Module:
    """Pack every Linear of a loaded model when can_pack applies to its weights; returns the model."""
    for m in model.modules():
        if isinstance(m, Linear) and can_pack(m.weight.dtype, m.weight.device):
            m.pack()
    return model


# A batch is run ragged (its linear layers on real rows only) when padding is at least this share of it.
RAGGED_MIN_PADDING = 0.125


class Ragged:
    """Where a padded batch's real rows are, for running its linear layers on those rows only.

    Attention needs the padded [batch, q] layout (per-row positions and slots); the projections,
    MLP and LM head do not, and on a CPU they cost in proportion to the rows they get. Rows of a
    verify step whose blocks differ in size (or a prefill of prompts of different lengths) then
    cost what their real tokens cost, not the longest row's times the batch.
    """

    def __init__(self, batch: int, q_len: int, index: torch.Tensor):
        self.batch, self.q_len, self.index = batch, q_len, index  # index [n] into the flattened [batch * q]

    @classmethod
    def of(cls, positions) -> "Ragged | None":
        """The layout of a batch with padding (positions -1), or None when padding is too little to pay."""
        real = (positions >= 0).flatten()
        num_real = int(real.sum())
        if num_real > (1 - RAGGED_MIN_PADDING) * real.numel():
            return None
        return cls(*positions.shape, real.nonzero().squeeze(1))

    def pack(self, x):
        """[batch, q, ...] -> [n, ...] (the real rows)."""
        return x.reshape(self.batch * self.q_len, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x):
        """[n, ...] -> [batch, q, ...], zeros at padding."""
        out = x.new_zeros(self.batch * self.q_len, *x.shape[1:])
        return out.index_copy_(0, self.index, x).view(self.batch, self.q_len, *x.shape[1:])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.qk_v_sizes = (q_size + kv_size, kv_size)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x, cos, sin, cache, layer, slots, write_pos, kv_len, mask, ragged=None):
        """x [batch, q, hidden], or [n, hidden] real rows with `ragged` their layout."""
        qkv = self.qkv(x)
        if ragged is not None:
            qkv = ragged.unpack(qkv)
        batch, q_len, _ = qkv.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qk, v = qkv.split(self.qk_v_sizes, dim=-1)
        qk = qk.view(batch, q_len, heads + kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, :heads]), self.k_norm(qk[:, :, heads:])], dim=2)
        # queries and keys rotated in one go: at one token per step the model is bound by op overheads
        q, k = apply_rotary(qk.transpose(1, 2), cos, sin).split([heads, kv_heads], dim=1)
        v = v.view(batch, q_len, kv_heads, self.head_dim).transpose(1, 2)
        slot_ids, read_index = slots
        cache.write(layer, slot_ids, write_pos, k, v)
        keys, values = cache.read(layer, read_index, kv_len)
        out = attention(q, keys, values, mask).transpose(1, 2).reshape(batch, q_len, -1)
        return self.o_proj(out if ragged is None else ragged.pack(out))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, *attn_args):
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class CachedModel(nn.Module):
    """What the engine asks of a model: its weights' dtype and device, and a KV cache shaped for it
    (`config` has num_layers, num_kv_heads and head_dim)."""

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    @property
    def device(self):
        return next(self.parameters()).device

    def new_cache(self, num_slots, max_len) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)


class TargetModel(CachedModel):
    """The target LLM, or one pipeline shard of it: layers [layer_start, layer_end), with the token
    embedding only on the first shard (layer_start 0) and the final norm and LM head only on the last.
    Its KV cache holds its own layers only."""

    def __init__(self, config: ModelConfig, layer_start: int = 0, layer_end: int | None = None):
        super().__init__()
        self.config = config
        self.layer_start, self.layer_end = layer_start, config.num_layers if layer_end is None else layer_end
        if not 0 <= self.layer_start < self.layer_end <= config.num_layers:
            raise ValueError(f"layers [{layer_start}, {layer_end}) are not a range of the model's {config.num_layers}")
        first, last = self.layer_start == 0, self.layer_end == config.num_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if first else None
        self.layers = nn.ModuleList(Block(config) for _ in range(self.layer_start, self.layer_end))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False) if last else None
        if config.tie_word_embeddings and first and last:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config)

    def new_cache(self, num_slots, max_len) -> KVCache:
        c = self.config
        return KVCache(len(self.layers), num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def forward(self, input_ids, positions, cache, slots, kv_len, feature_layers=(), logits_index=None, tree=None,
                capturable=False):
        """Run new tokens of a batch of requests through the (whole) model, writing their keys/values.

        input_ids    [batch, q] long
        positions    [batch, q] long, -1 marks padding (written to the cache's trash column)
        slots        [batch] ints: each row's cache slot
        kv_len       int: 1 + the largest position in the batch (known on the host)
        feature_layers: target layer ids whose outputs are returned, concatenated on features
        logits_index [batch, k] long or None: which of the q positions need logits
        tree         an engine.tree.TokenTree when some rows' blocks are token trees: each position is
                     written at its own cache column but rotated by its depth and sees only its ancestors
        capturable   no host synchronisation and no copy from the host (a CUDA graph can record the call):
                     `slots` is cache.batch_index's pair, padded rows stay in the linear layers and
                     attention is always masked
        returns logits [batch, k or q, vocab] (float32), features [batch, q, n * hidden] or None
        """
        logits, features = self.forward_shard(input_ids, positions, cache, slots, kv_len, feature_layers, logits_index,
                                              tree, capturable)
        return logits, ordered_features(features, feature_layers)

    def forward_shard(self, inputs, positions, cache, slots, kv_len, feature_layers=(), logits_index=None, tree=None,
                      capturable=False):
        """This model's part of forward when it is a pipeline shard (arguments as in forward).

        inputs       token ids [batch, q] on the first shard, else the previous shard's hidden states [batch, q, hidden]
        returns the hidden states after its layers [batch, q, hidden] (the last shard: logits as forward's),
        and {layer id: output [batch, q, hidden]} for the feature_layers among its layers
        """
        x = inputs if self.embed_tokens is None else self.embed_tokens(inputs)
        ragged = None if capturable else Ragged.of(positions)
        rope_pos = positions.clamp_min(0) if tree is None else tree.rope_positions(positions)
        write_pos = torch.where(positions >= 0, positions, cache.max_len)
        cos, sin = self.rotary(rope_pos, x.dtype)
        slots = slots if capturable else cache.batch_index(slots)
        key_pos = torch.arange(kv_len, device=x.device)
        if tree is not None:
            mask = tree.attention_mask(positions, kv_len)
        else:
            causal = not capturable and is_prefix_prefill(positions, kv_len)
            mask = None if causal else (key_pos <= rope_pos[..., None])[:, None]
        unpack = (lambda t: t) if ragged is None else ragged.unpack
        x = x if ragged is None else ragged.pack(x)  # [n, hidden]: real rows only
        features = {}
        for i, layer in enumerate(self.layers):  # cache layer i holds model layer layer_start + i
            x = layer(x, cos, sin, cache, i, slots, write_pos, kv_len, mask, ragged)
            if self.layer_start + i in feature_layers:
                features[self.layer_start + i] = unpack(x)
        if self.lm_head is None:
            return unpack(x), features
        if logits_index is not None:
            x = unpack(x).gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
            return self.lm_head(self.norm(x)).float(), features
        return unpack(self.lm_head(self.norm(x)).float()), features


def is_prefix_prefill(positions, kv_len) -> bool:
    """Whether every row holds positions 0, 1, ... from the start of its cache, then only padding
    (-1), and the batch spans the whole kv_len: then attention is plain causal attention (each row's
    real queries see only its own new keys; padding queries see stale keys and are never read)."""
    q_len = positions.shape[1]
    if q_len != kv_len or q_len < 2:
        return False
    real = positions >= 0
    in_place = (positions == torch.arange(q_len, device=positions.device)) | ~real
    return bool(in_place.all() and (real[:, 1:] <= real[:, :-1]).all())


def ordered_features(features: dict, feature_layers) -> torch.Tensor | None:
    """{layer id: [batch, q, hidden]} -> the feature_layers' outputs concatenated in their order
    [batch, q, n * hidden] (None when none are asked for)."""
    if not feature_layers:
        return None
    return torch.cat([features[i] for i in feature_layers], dim=-1)


class TargetHead(CachedModel):
    """Only the target's token embedding and LM head: what a drafter process needs of the target
    (the drafter embeds its block and reads its logits through them). Its cache is only the
    slot bookkeeping for an Engine that drafts for a target in another process."""

    def __init__(self, target: TargetModel):
        super().__init__()
        self.config = target.config
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head

    def new_cache(self, num_slots, max_len) -> SlotTable:
        return SlotTable(num_slots, max_len)


def read_hf_config(path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in model path {path!s}")
    return json.loads(config_file.read_text())


def load_safetensors_dir(path, keep=None) -> dict:
    """Every tensor of a folder's *.safetensors files, or those whose name `keep(name)` accepts
    (the others are never read)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!s}")
    state = {}
    for f in files:
        with safe_open(str(f), framework="pt") as tensors:
            state.update({name: tensors.get_tensor(name) for name in tensors.keys() if keep is None or keep(name)})
    return state


def fuse_hf_weights(state: dict, config: ModelConfig, layers=None) -> dict:
    """Map Hugging Face names to ours: strip `model.`, fuse q/k/v and gate/up projections. With a
    range of layers (a pipeline shard), its layers are renumbered from 0."""
    start, end = layers or (0, config.num_layers)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    for i in range(start, end):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{p}self_attn.{n}_proj.{kind}" for n in "qkv"]
            if names[0] in state:
                state[f"{p}self_attn.qkv.{kind}"] = torch.cat([state.pop(n) for n in names])
        state[f"{p}mlp.gate_up.weight"] = torch.cat(
            [state.pop(f"{p}mlp.gate_proj.weight"), state.pop(f"{p}mlp.up_proj.weight")]
        )
    if config.tie_word_embeddings:
        embed = state.pop("embed_tokens.weight", None)
        state.pop("lm_head.weight", None)
        if start == 0:
            state["embed_tokens.weight"] = embed
        if end == config.num_layers and start > 0:  # a last shard without the embedding: the tied head's copy
            state["lm_head.weight"] = embed
    if start > 0:
        state = {_shift_layer(k, -start): v for k, v in state.items()}
    return state


def _shift_layer(name: str, by: int) -> str:
    if not name.startswith("layers."):
        return name
    _, i, rest = name.split(".", 2)
    return f"layers.{int(i) + by}.{rest}"


def shard_wants(name: str, config: ModelConfig, layers) -> bool:
    """Whether a checkpoint tensor (Hugging Face name) belongs to the shard of layers [start, end)."""
    start, end = layers
    name = name.removeprefix("model.")
    if name.startswith("layers."):
        return start <= int(name.split(".")[1]) < end
    if name.startswith("embed_tokens."):
        return start == 0 or (config.tie_word_embeddings and end == config.num_layers)
    return end == config.num_layers  # norm, lm_head


def load_target(path, dtype=torch.float32, device="cpu", layers: tuple[int, int] | None = None) -> TargetModel:
    """Load a Llama-family Hugging Face checkpoint folder (config.json + *.safetensors); with
    `layers` (start, end), only that pipeline shard, reading only its tensors."""
    config = ModelConfig.from_hf(read_hf_config(path))
    start, end = layers or (0, config.num_layers)
    with torch.device("meta"):
        model = TargetModel(config, start, end)
    keep = None if layers is None else lambda name: shard_wants(name, config, (start, end))
    state = fuse_hf_weights(load_safetensors_dir(path, keep), config, (start, end))
    unexpected = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
    if unexpected:
        raise ValueError(f"checkpoint {path!s} has weights this model does not use: {unexpected[:5]}")
    if config.tie_word_embeddings and model.embed_tokens is not None and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint {path!s} lacks weights: {missing[:5]}")
    model.rotary = Rotary(config)
    return pack_linears(model.to(device=device, dtype=dtype).eval())
