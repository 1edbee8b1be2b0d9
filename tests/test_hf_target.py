"""engine.hf_target.HFTarget against transformers' full-sequence forward, on tiny random checkpoints
built offline in a temp folder: GPT-2 and GPT-NeoX (architectures the lean forward does not cover) and a
Mistral with a 4-token sliding window (rollback past the window needs the cache's past recording).
"""

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from engine.hf_target import load_hf_target

ARCHS = {
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=128, initializer_range=0.1)
    ),
    "gpt_neox": lambda: GPTNeoXForCausalLM(
        GPTNeoXConfig(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
            vocab_size=256, max_position_embeddings=128, initializer_range=0.1,
        )
    ),
    "mistral-sliding": lambda: MistralForCausalLM(
        MistralConfig(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=128, sliding_window=4,
            initializer_range=0.1,
        )
    ),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    """(HF reference model, our HFTarget loaded from its saved checkpoint)."""
    torch.manual_seed(0)
    hf = ARCHS[request.param]().eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_hf_target(path)


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def run(target, cache, slot, ids, start, **kw):
    """ids [q] at positions start.. -> logits [q or k, vocab], features [q, n * hidden] or None."""
    positions = torch.arange(start, start + len(ids))[None]
    cache.crop(slot, start + len(ids))
    logits, features = target(ids[None], positions, cache, torch.tensor([slot]), start + len(ids), **kw)
    return logits[0], None if features is None else features[0]


def test_config_and_modules(pair):
    hf, target = pair
    c = target.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.max_position_embeddings) == (256, 64, 3, 128)
    assert target.dtype == torch.float32 and target.device.type == "cpu"
    ids = tokens(5, 0)[None]
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(target.embed_tokens(ids), hf.get_input_embeddings()(ids))
        torch.testing.assert_close(target.lm_head(out.hidden_states[-1]), out.logits)


def test_incremental_with_crop_matches_full_sequence(pair):
    hf, target = pair
    cache = target.new_cache(3, 64)
    cache.allocate()
    slot = cache.allocate()
    prompt, steps, rejected, accepted, last = (tokens(n, seed) for seed, n in enumerate((10, 3, 4, 4, 1)))
    full = torch.cat([prompt, steps, accepted, last])
    with torch.no_grad():
        ref = hf(input_ids=full[None]).logits[0]
    got = [run(target, cache, slot, prompt, 0)[0]]
    got += [run(target, cache, slot, steps[i : i + 1], 10 + i)[0] for i in range(3)]
    run(target, cache, slot, rejected, 13)
    cache.crop(slot, 13)
    got.append(run(target, cache, slot, accepted, 13)[0])
    got.append(run(target, cache, slot, last, 17)[0])
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=1e-4)
    assert cache.caches[slot].get_seq_length() == 18


def test_features_and_logits_index(pair):
    hf, target = pair
    cache = target.new_cache(1, 32)
    ids = tokens(8, 6)
    index = torch.tensor([[7, 2]])
    logits, features = run(target, cache, cache.allocate(), ids, 0, feature_layers=(1, 0), logits_index=index)
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_hidden_states=True)
    torch.testing.assert_close(logits, out.logits[0, [7, 2]], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(features, torch.cat([out.hidden_states[2][0], out.hidden_states[1][0]], -1))


def test_rejects_batches_and_padding(pair):
    _, target = pair
    cache = target.new_cache(2, 32)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    ids = tokens(8, 7).view(2, 4)
    with pytest.raises(ValueError, match="one request per call"):
        target(ids, torch.arange(4).repeat(2, 1), cache, slots, 4)
    with pytest.raises(ValueError, match="without padding"):
        target(ids[:1], torch.tensor([[0, 1, 2, -1]]), cache, slots[:1], 3)
    with pytest.raises(ValueError, match="cannot write at 5"):
        target(ids[:1, :1], torch.tensor([[5]]), cache, slots[:1], 6)


def test_cache_bookkeeping(pair):
    _, target = pair
    cache = target.new_cache(2, 16)
    assert (cache.num_slots, cache.num_used, cache.max_len) == (2, 0, 16)
    a, b = cache.allocate(), cache.allocate()
    with pytest.raises(RuntimeError, match="all 2 KV-cache slots are in use"):
        cache.allocate()
    run(target, cache, b, tokens(4, 8), 0)
    assert cache.lengths == [0, 4]
    cache.crop(b, 2)
    assert cache.lengths[b] == 2
    cache.free(b)
    with pytest.raises(ValueError, match="already free"):
        cache.free(b)
    assert cache.allocate() == b and cache.lengths[b] == 0 and cache.caches[b].get_seq_length() == 0
    assert cache.num_used == 2 and a == 0


def test_engine_speculates_over_the_fallback(pair):
    """DFlash through the engine on a fallback target: greedy output equals transformers' own."""
    from engine.drafter import Drafter, DrafterConfig
    from engine.engine import Engine, SamplingParams
    from engine.model import ModelConfig

    hf, target = pair
    c = target.config
    shape = ModelConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=128,
                        num_layers=c.num_layers, num_heads=4, num_kv_heads=2, head_dim=16)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.for_target(shape, mask_token_id=0, block_size=4)).eval()
    engine = Engine(target, drafter, max_slots=4, max_len=64)
    prompts = [tokens(5, 1).tolist(), tokens(9, 2).tolist()]
    outputs = [r.output_ids for r in engine.generate_batch(prompts, SamplingParams(max_tokens=12))]
    for prompt, output in zip(prompts, outputs):
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert output == reference[0, len(prompt):].tolist()
    assert engine.target_cache.num_slots == 1 and engine.target_cache.num_used == 0
