"""engine.model.TargetModel against transformers' own Llama/Mistral/Qwen2/Qwen3, and KVCache bookkeeping.

Checkpoints are tiny random models built from config objects and saved to a temp folder (no hub);
the default-model check is marked slow. Nothing here knows about drafting or serving.
"""

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.kv_cache import KVCache
from engine.model import is_prefix_prefill, load_target

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, initializer_range=0.1,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
ARCHS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**COMMON, attention_bias=True)),
    "llama3-tied": (
        LlamaForCausalLM,
        lambda: LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
    ),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**COMMON)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**COMMON)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**COMMON, head_dim=32)),
}
DTYPES = [torch.float32, torch.bfloat16]


def random_hf(arch, **overrides):
    """A random HF model; norm weights and biases are randomized too (HF inits them to 1 and 0)."""
    cls, make_config = ARCHS[arch]
    config = make_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    """(HF float32 reference model, folder holding its safetensors checkpoint)."""
    hf = random_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module", params=DTYPES, ids=["fp32", "bf16"])
def pair(request, checkpoint):
    """(HF float32 reference, our model loaded from the checkpoint in the param dtype)."""
    hf, path = checkpoint
    return hf, load_target(path, request.param)


@torch.no_grad()
def hf_logits(hf, ids):
    """ids [n] -> HF's logits [n, vocab] for that sequence alone."""
    return hf(input_ids=ids[None]).logits[0].float()


def assert_logits_match(ours, ref, dtype):
    """ours, ref [..., vocab]. Tight in float32; in bfloat16 errors are bounded relative to the logit
    scale and each argmax picks a token whose reference logit is within that bound of the best."""
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        return
    tol = 0.05 * ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= tol
    picked = ref.gather(-1, ours.argmax(-1, keepdim=True))[..., 0]
    assert (picked >= ref.max(-1).values - tol).all()


@torch.no_grad()
def step(model, cache, slots, rows, starts, **kw):
    """Run rows (list of [n_i] long) for slots at first positions `starts` in one padded call.

    Returns logits [batch, q, vocab] (or [batch, k, vocab] with logits_index) and features."""
    q = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), q, dtype=torch.long)
    positions = torch.full((len(rows), q), -1, dtype=torch.long)
    for i, (row, start) in enumerate(zip(rows, starts)):
        ids[i, : len(row)] = row
        positions[i, : len(row)] = torch.arange(start, start + len(row))
        cache.crop(slots[i], start + len(row))
    return model(ids, positions, cache, torch.tensor(slots), int(positions.max()) + 1, **kw)


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_prompt_forward(pair):
    hf, model = pair
    cache = model.new_cache(2, 64)
    ids = tokens(24, 1)
    logits, features = step(model, cache, [cache.allocate()], [ids], [0])
    assert logits.dtype == torch.float32 and features is None
    assert_logits_match(logits[0], hf_logits(hf, ids), model.dtype)


def test_padded_batch_in_noncontiguous_slots(pair):
    hf, model = pair
    cache = model.new_cache(6, 64)
    slots = [cache.allocate() for _ in range(6)]
    for s in (0, 2, 3):
        cache.free(s)
    rows = [tokens(n, n) for n in (7, 3, 5)]
    chosen = [slots[5], slots[1], slots[4]]
    logits, _ = step(model, cache, chosen, rows, [0, 0, 0])
    for i, row in enumerate(rows):
        assert_logits_match(logits[i, : len(row)], hf_logits(hf, row), model.dtype)
    untouched = [s for s in range(6) if s not in chosen]
    assert cache.k[:, untouched, :, :-1].abs().sum() == 0  # padding only hits the trash column


def test_causal_prefill_ignores_stale_keys_of_reused_slots(pair):
    """A prefill from position 0 takes the causal path (no mask): padding queries read whatever the
    reused slots hold past each prompt, and real queries must never see it."""
    hf, model = pair
    cache = model.new_cache(3, 64)
    slots = [cache.allocate() for _ in range(3)]
    for t in (cache.k, cache.v):
        t.normal_(generator=torch.Generator().manual_seed(5))  # stale keys/values everywhere
    rows = [tokens(n, 30 + n) for n in (9, 2, 6)]
    logits, _ = step(model, cache, slots, rows, [0, 0, 0])
    for i, row in enumerate(rows):
        assert_logits_match(logits[i, : len(row)], hf_logits(hf, row), model.dtype)


def test_prefix_prefill_detection():
    pos = lambda *rows: torch.tensor(rows)
    assert is_prefix_prefill(pos([0, 1, 2], [0, 1, -1]), 3)
    assert not is_prefix_prefill(pos([0, 1, 2], [0, 1, -1]), 4)  # keys beyond the batch: a cached prefix
    assert not is_prefix_prefill(pos([0, 1, 2], [-1, 0, 1]), 3)  # left padding
    assert not is_prefix_prefill(pos([0, 1, 2], [0, -1, 2]), 3)  # a hole
    assert not is_prefix_prefill(pos([1, 2, 3]), 4) and not is_prefix_prefill(pos([0]), 1)


def test_incremental_decode_matches_full_sequence(pair):
    hf, model = pair
    cache = model.new_cache(4, 64)
    slots = [cache.allocate() for _ in range(3)]
    full = [tokens(30, 10 + i) for i in range(3)]
    lengths = [9, 4, 6]
    step(model, cache, slots, [f[:n] for f, n in zip(full, lengths)], [0, 0, 0])
    refs = [hf_logits(hf, f) for f in full]
    # (tokens per row) per call: 1-token steps, 4-token blocks, and a mixed call padded to 4
    for sizes in ([1, 1, 1], [4, 4, 4], [1, 1, 1], [4, 1, 2], [4, 4, 4]):
        rows = [f[n : n + k] for f, n, k in zip(full, lengths, sizes)]
        logits, _ = step(model, cache, slots, rows, lengths)
        for i, (n, k) in enumerate(zip(lengths, sizes)):
            assert_logits_match(logits[i, :k], refs[i][n : n + k], model.dtype)
        lengths = [n + k for n, k in zip(lengths, sizes)]


def test_crop_then_rewrite_equals_fresh_run(pair):
    hf, model = pair
    cache = model.new_cache(2, 64)
    slot = cache.allocate()
    prompt, rejected, accepted = tokens(10, 20), tokens(4, 21), tokens(2, 22)
    step(model, cache, [slot], [prompt], [0])
    step(model, cache, [slot], [rejected], [10])
    cache.crop(slot, 10)
    assert cache.lengths[slot] == 10
    logits, _ = step(model, cache, [slot], [accepted], [10])
    next_token = tokens(1, 23)
    logits2, _ = step(model, cache, [slot], [next_token], [12])
    ref = hf_logits(hf, torch.cat([prompt, accepted, next_token]))
    assert_logits_match(logits[0], ref[10:12], model.dtype)
    assert_logits_match(logits2[0], ref[12:13], model.dtype)


@pytest.mark.parametrize("layers", [(1, 3), (3, 1)])
def test_feature_layers_are_hf_hidden_states(tmp_path, layers):
    # 5 layers so layer 3 is not the last: HF's hidden_states[-1] is the final-normed output.
    hf = random_hf("llama", num_hidden_layers=5)
    hf.save_pretrained(tmp_path)
    model = load_target(tmp_path)
    cache = model.new_cache(1, 32)
    ids = tokens(12, 30)
    _, features = step(model, cache, [cache.allocate()], [ids], [0], feature_layers=layers)
    with torch.no_grad():
        hidden = hf(input_ids=ids[None], output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[k + 1] for k in layers], dim=-1)
    assert features.shape == (1, 12, 2 * 64)
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)


def test_logits_index_gathers(checkpoint):
    _, path = checkpoint
    model = load_target(path)
    rows = [tokens(6, 40), tokens(4, 41)]
    index = torch.tensor([[5, 0], [3, 1]])
    full_cache, cache = model.new_cache(2, 16), model.new_cache(2, 16)
    full, _ = step(model, full_cache, [0, 1], rows, [0, 0])
    gathered, _ = step(model, cache, [0, 1], rows, [0, 0], logits_index=index)
    assert gathered.shape == (2, 2, 256)
    torch.testing.assert_close(gathered, full.gather(1, index[..., None].expand(-1, -1, 256)))


def test_kv_cache_bookkeeping():
    cache = KVCache(2, 3, 8, 2, 4, torch.float32, "cpu")
    assert (cache.num_slots, cache.num_used, cache.max_len) == (3, 0, 8)
    assert cache.k.shape == (2, 3, 2, 9, 4)  # one trash column past max_len
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    assert cache.num_used == 3
    with pytest.raises(RuntimeError, match="all 3 KV-cache slots are in use"):
        cache.allocate()
    cache.crop(1, 5)
    assert cache.lengths == [0, 5, 0]
    cache.free(1)
    assert cache.lengths[1] == 0 and cache.num_used == 2
    with pytest.raises(ValueError, match="already free"):
        cache.free(1)
    assert cache.allocate() == 1 and cache.num_used == 3
    cache.free(0)
    cache.free(2)
    assert [cache.allocate(), cache.allocate()] == [0, 2]  # the lowest free slot first: used slots stay packed


@pytest.mark.slow
def test_default_model_matches_transformers():
    from transformers import AutoModelForCausalLM

    from engine.default_model import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    model = load_target(path)
    ids = tokens(16, 50) + 100
    cache = model.new_cache(1, 32)
    slot = cache.allocate()
    prefill, _ = step(model, cache, [slot], [ids[:12]], [0])
    block, _ = step(model, cache, [slot], [ids[12:]], [12])
    ours = torch.cat([prefill[0], block[0]])
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)], ids=["fp32", "bf16"])
def test_packed_linears_match_plain_ones(checkpoint, dtype, tol):
    """On a CPU, load_target packs the linear layers for oneDNN (float32, and bf16 where oneDNN runs it):
    a batch of 3 rows x 4 positions gives the logits of the same model with packing off, within the
    dtype's rounding; one-row inputs give F.linear's result, zero-row ones an empty output; grad mode uses the plain weights."""
    from engine.model import Linear, can_pack

    if not can_pack(dtype, "cpu"):
        pytest.skip(f"this CPU's oneDNN has no {dtype}")
    packed = load_target(checkpoint[1], dtype=dtype)
    plain = load_target(checkpoint[1], dtype=dtype)
    linears = [m for m in plain.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in packed.modules() if isinstance(m, Linear))
    for m in linears:
        m.packed = None
    ids = torch.stack([tokens(4, seed) for seed in range(3)])
    positions = torch.arange(4).expand(3, 4)
    with torch.inference_mode():
        a = packed(ids, positions, packed.new_cache(3, 8), [0, 1, 2], 4)[0]
        b = plain(ids, positions, plain.new_cache(3, 8), [0, 1, 2], 4)[0]
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    layer = next(m for m in packed.modules() if isinstance(m, Linear))
    with torch.inference_mode():  # bf16 sends one row as two
        one = torch.randn(1, 1, layer.in_features, dtype=dtype)
        torch.testing.assert_close(layer(one), torch.nn.functional.linear(one, layer.weight, layer.bias),
                                   atol=tol, rtol=tol)
        # no rows at all (a second denoising pass has no new context features)
        assert layer(torch.randn(1, 0, layer.in_features, dtype=dtype)).shape == (1, 0, layer.out_features)
    x = torch.randn(2, layer.in_features, dtype=dtype, requires_grad=True)
    layer(x).sum().backward()  # grad mode: the plain weight, with a backward
    assert x.grad is not None


def test_ragged_batch_equals_padded_batch(pair, monkeypatch):
    """A batch with enough padding runs its linear layers on real rows only (engine.model.Ragged): logits and
    features of real positions and the KV cache equal the padded run's (rows of 1-4 new tokens after
    different prompts, as a verify step whose blocks were trimmed differently)."""
    import engine.model as model_module

    hf, model = pair
    prompts = [tokens(n, 10 + n) for n in (9, 5, 12, 7)]
    blocks = [tokens(n, 20 + n) for n in (4, 1, 2, 1)]
    layers = (0, model.config.num_layers - 1)
    runs = []
    for min_padding in (0.125, 2.0):  # 2.0: never ragged
        monkeypatch.setattr(model_module, "RAGGED_MIN_PADDING", min_padding)
        cache = model.new_cache(4, 64)
        slots = [cache.allocate() for _ in range(4)]
        step(model, cache, slots, prompts, [0] * 4)
        runs.append((*step(model, cache, slots, blocks, [len(p) for p in prompts], feature_layers=layers), cache))
    (logits, features, cache), (padded_logits, padded_features, padded_cache) = runs
    tol = 1e-5 if model.dtype == torch.float32 else 0.02
    for i, block in enumerate(blocks):
        n = len(block)
        torch.testing.assert_close(logits[i, :n], padded_logits[i, :n], atol=tol * 10, rtol=tol)
        torch.testing.assert_close(features[i, :n], padded_features[i, :n], atol=tol * 10, rtol=tol)
        full = torch.cat([prompts[i], block])
        assert_logits_match(logits[i, :n], hf_logits(hf, full)[-n:], model.dtype)
    torch.testing.assert_close(cache.k[:, :, :, :-1], padded_cache.k[:, :, :, :-1], atol=tol * 10, rtol=tol)
    monkeypatch.undo()
    positions = torch.tensor([[5, 6, 7, -1], [3, 4, 5, 6]])
    assert model_module.Ragged.of(positions) is not None  # 1 of 8 is padding
    assert model_module.Ragged.of(torch.arange(16).view(2, 8)) is None


def test_capturable_forward_equals_the_plain_one(pair):
    """The forward a CUDA graph can record (no host sync, slots given as index tensors, padding kept in
    the linear layers, masked attention) gives the plain forward's logits, features and cache: a prefill,
    then a padded verify step, then a one-token step."""
    hf, model = pair
    layers = (0, model.config.num_layers - 1)
    prompts = [tokens(n, 30 + n) for n in (9, 5, 12)]
    blocks = [tokens(n, 40 + n) for n in (4, 1, 2)]
    nexts = [tokens(1, 50 + n) for n in range(3)]
    runs = []
    for capturable in (False, True):
        cache = model.new_cache(4, 64)
        slots = [cache.allocate() for _ in range(3)][::-1]  # not consecutive from 0: an index tensor, not a slice
        index = cache.batch_index(slots) if capturable else slots
        out = []
        for rows, starts in ((prompts, [0] * 3), (blocks, [len(p) for p in prompts]),
                             (nexts, [len(p) + len(b) for p, b in zip(prompts, blocks)])):
            q = max(len(r) for r in rows)
            ids = torch.zeros(3, q, dtype=torch.long)
            positions = torch.full((3, q), -1, dtype=torch.long)
            for i, (row, start) in enumerate(zip(rows, starts)):
                ids[i, : len(row)], positions[i, : len(row)] = row, torch.arange(start, start + len(row))
            with torch.no_grad():
                out.append(model(ids, positions, cache, index, int(positions.max()) + 1, layers, capturable=capturable))
        runs.append((out, cache))
    (plain, plain_cache), (captured, captured_cache) = runs
    tol = 1e-5 if model.dtype == torch.float32 else 0.02
    for (logits, features), (ref_logits, ref_features), rows in zip(captured, plain, (prompts, blocks, nexts)):
        for i, row in enumerate(rows):
            n = len(row)
            torch.testing.assert_close(logits[i, :n], ref_logits[i, :n], atol=tol * 10, rtol=tol)
            torch.testing.assert_close(features[i, :n], ref_features[i, :n], atol=tol * 10, rtol=tol)
    torch.testing.assert_close(captured_cache.k[:, :, :, :-1], plain_cache.k[:, :, :, :-1], atol=tol * 10, rtol=tol)
    full = torch.cat([prompts[0], blocks[0], nexts[0]])
    assert_logits_match(captured[2][0][0, :1], hf_logits(hf, full)[-1:], model.dtype)


@pytest.mark.parametrize("batch, heads, kv_heads, q_len, kv_len", [(4, 9, 3, 1, 50), (2, 9, 3, 16, 70), (3, 4, 4, 5, 20)])
def test_grouped_attention_equals_sdpa_with_grouped_queries(batch, heads, kv_heads, q_len, kv_len):
    """The GPU's masked grouped-query attention (query heads of a KV head as more query rows) is SDPA's own
    grouped attention, for a per-row mask and for one mask shared by the batch."""
    import torch.nn.functional as F

    from engine.model import grouped_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, 8, generator=g)
    k, v = torch.randn(2, batch, kv_heads, kv_len, 8, generator=g)
    mask = torch.rand(batch, 1, q_len, kv_len, generator=g) > 0.3
    mask[..., 0] = True
    for m in (mask, mask[0, 0]):
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        torch.testing.assert_close(grouped_attention(q, k, v, m), reference)
