"""The speculative engine: lossless output, batching, slot hygiene and input validation.

Tiny random models cover the maths; the default model (slow) covers the real thing.
"""

import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from engine.drafter import Drafter, DrafterConfig
from engine.engine import DraftBlock, Engine, SamplingParams, prefill_group
from engine.model import ModelConfig, TargetModel
from engine.policy import FixedBlockPolicy

TINY = ModelConfig(
    vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
    max_position_embeddings=512,
)


def tiny_models(seed=0, vocab_size=None):
    torch.manual_seed(seed)
    config = TINY if vocab_size is None else ModelConfig(**{**TINY.__dict__, "vocab_size": vocab_size})
    target = TargetModel(config).eval()
    for p in target.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.5)
    drafter = Drafter(DrafterConfig.for_target(config, num_layers=1, mask_token_id=0, block_size=4)).eval()
    return target, drafter


def random_prompts(n, vocab, seed=0, lo=2, hi=12):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class OracleEngine(Engine):
    """An engine whose drafts are the known greedy continuation with injected mistakes.

    A mock drafter: no trained drafter exists for a tiny random target, and this is the only way
    to drive long accepted prefixes, partial acceptance and cache cropping through the real
    verify/commit code with known answers.
    """

    def __init__(self, *args, reference, error_rate, **kw):
        super().__init__(*args, **kw)
        self.reference, self.error_rate, self.rng = reference, error_rate, random.Random(0)

    def draft(self, requests, block_sizes):
        b_max = max(block_sizes)
        rows = []
        for r, b in zip(requests, block_sizes):
            ref = self.reference[tuple(r.prompt_ids)][len(r.output_ids):]
            drafts = [t if self.rng.random() > self.error_rate else (t + 1) % self.target.config.vocab_size for t in ref]
            drafts = (drafts + [0] * b_max)[: b_max - 1]
            rows.append([r.last_token] + drafts)
            r.pending_features = None
        return DraftBlock(torch.tensor(rows), None, block_sizes)


def greedy_outputs(engine, prompts, max_tokens):
    return [r.output_ids for r in engine.generate_batch(prompts, SamplingParams(max_tokens=max_tokens))]


@pytest.mark.parametrize("error_rate", [0.0, 0.2, 0.7])
def test_verify_commit_keeps_output_exact(error_rate):
    target, drafter = tiny_models()
    prompts = random_prompts(6, TINY.vocab_size)
    reference = greedy_outputs(Engine(target, max_slots=8), prompts, 40)
    oracle = OracleEngine(
        target, drafter, max_slots=4, reference={tuple(p): o for p, o in zip(prompts, reference)}, error_rate=error_rate,
    )
    requests = oracle.generate_batch(prompts, SamplingParams(max_tokens=40))
    assert [r.output_ids for r in requests] == reference
    steps = [n for r in requests for n in r.acceptance_lengths]
    if error_rate == 0.0:
        assert max(steps) == 4 and sum(steps) / len(steps) > 3.5
    assert oracle.target_cache.num_used == 0 and oracle.draft_cache.num_used == 0


@pytest.mark.parametrize("block_size,denoising_steps", [(2, 1), (4, 1), (8, 2), (16, 3)])
def test_real_drafter_greedy_equals_autoregressive(block_size, denoising_steps):
    target, drafter = tiny_models(seed=1)
    prompts = random_prompts(5, TINY.vocab_size, seed=1)
    reference = greedy_outputs(Engine(target), prompts, 30)
    engine = Engine(target, drafter, max_slots=3, denoising_steps=denoising_steps)
    requests = engine.generate_batch(prompts, SamplingParams(max_tokens=30, block_size=block_size))
    assert [r.output_ids for r in requests] == reference
    assert all(r.stats.num_drafts > 0 for r in requests)
    assert engine.target_cache.num_used == engine.draft_cache.num_used == 0


def test_reduced_draft_head_proposes_only_its_vocabulary_and_stays_exact(tmp_path):
    """A drafter saved with a draft vocabulary loads with it; the engine then drafts only those
    ids (greedy and sampled) and the output is still the target's."""
    from engine.drafter import load_drafter, save_drafter

    target, drafter = tiny_models(seed=2)
    save_drafter(drafter, tmp_path, dtype=torch.float32, draft_vocab=[1, 3, 5])
    drafter = load_drafter(tmp_path)
    assert drafter.draft_vocab.tolist() == [1, 3, 5]
    prompts = random_prompts(4, TINY.vocab_size, seed=2)
    reference = greedy_outputs(Engine(target), prompts, 24)
    engine = Engine(target, drafter, max_slots=4)
    proposed = []
    original = engine._propose
    engine._propose = lambda *args: proposed.append(original(*args)) or proposed[-1]
    requests = engine.generate_batch(prompts, SamplingParams(max_tokens=24, block_size=4))
    assert [r.output_ids for r in requests] == reference
    sampled = engine.generate_batch(prompts, SamplingParams(max_tokens=8, block_size=4, temperature=1.0, seed=3))
    assert all(len(r.output_ids) == 8 for r in sampled)
    ids = torch.cat([p[0].flatten() for p in proposed])
    assert set(ids.tolist()) <= {1, 3, 5}
    full = Engine(target, drafter, max_slots=4, reduced_draft_head=False)
    assert full.draft_head.draft_vocab is None and full.draft_head.size == TINY.vocab_size
    (tmp_path / "draft_vocab.json").write_text("[1, 99]")
    with pytest.raises(ValueError, match="draft_vocab.json: expected a non-empty list of token ids below 8"):
        load_drafter(tmp_path)


def exact_sequence_probs(target, prompt, length, probs_fn):
    """Exact probability of every continuation of `length` tokens under the target (tiny vocab)."""
    vocab = target.config.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(vocab)] * length) if length > 1 else torch.arange(vocab)[:, None]
    full = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    cache = target.new_cache(len(seqs), full.shape[1])
    positions = torch.arange(full.shape[1]).expand(len(seqs), -1)
    with torch.inference_mode():
        logits, _ = target(full, positions, cache, torch.arange(len(seqs)), full.shape[1])
    probs = probs_fn(logits[:, len(prompt) - 1 : -1])  # [num_seqs, length, vocab]
    return probs.gather(-1, seqs[..., None])[..., 0].prod(-1)


class ConfidenceCut(FixedBlockPolicy):
    """Verifies a row's drafts while their confidence stays above 0.4: a trim decided from the draft
    distributions alone, as AdaptiveBlockPolicy.trim's is, with a rule whose effect is easy to see."""

    def trim(self, requests, block_sizes, confidence, context, trees=None):  # sampled rows: never trees
        keep = (confidence > 0.4).long().cumprod(dim=1).sum(dim=1)
        return [min(b, 1 + int(k)) for b, k in zip(block_sizes, keep)]


class TokenPeekingEngine(Engine):
    """A wrong trim, for the test to catch: it cuts each block before its first drafted token >= 3,
    a decision that depends on the sampled tokens (the proposal is then no longer q)."""

    def trim(self, requests, drafted, trees=None):
        drafts = drafted.block_ids[:, 1:]
        keep = (drafts < 3).long().cumprod(dim=1).sum(dim=1)
        return drafted.trimmed([min(b, 1 + int(k)) for b, k in zip(drafted.block_sizes, keep)])


def sampled_sequences_fit_the_target(engine, temperature, top_k, top_p, num=3000, seeded=False):
    """Whether the first 3 tokens sampled through `engine` (tiny target, 6-token vocabulary) follow the
    target's law: a chi-square test at z = 4 (p ~ 3e-5). `seeded`: request i carries seed i.
    Returns (fits, chi2, threshold)."""
    from engine.sampling import sampling_probs

    prompt, length = [1, 2, 3], 3
    params = SamplingParams(max_tokens=length, temperature=temperature, top_k=top_k, top_p=top_p, block_size=3)
    counts = torch.zeros(6**length)
    torch.manual_seed(0)
    for batch in range(num // 100):
        seeds = [batch * 100 + i if seeded else None for i in range(100)]
        for r in engine.generate_batch([prompt] * 100, [replace(params, seed=seed) for seed in seeds]):
            counts[sum(t * 6 ** (length - 1 - i) for i, t in enumerate(r.output_ids))] += 1
    assert engine.stats.num_drafts > 0

    def probs_fn(logits):
        n = logits.shape[0]
        return sampling_probs(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p))

    expected = exact_sequence_probs(engine.target, prompt, length, probs_fn) * num
    if counts[expected == 0].sum() > 0:
        return False, math.inf, 0.0
    big = expected >= 5
    chi2 = (((counts[big] - expected[big]) ** 2) / expected[big]).sum().item()
    rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
    if rest_exp > 0:
        chi2 += ((rest_obs - rest_exp) ** 2 / rest_exp).item()
    dof = int(big.sum()) + (1 if rest_exp > 0 else 0) - 1
    # Wilson-Hilferty approximation of the chi-square quantile at z = 4
    threshold = dof * (1 - 2 / (9 * dof) + 4 * math.sqrt(2 / (9 * dof))) ** 3
    return chi2 < threshold, chi2, threshold


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
@pytest.mark.parametrize("trim", [False, True], ids=["all-verified", "confidence-trim"])
def test_speculative_sampling_matches_target_distribution(temperature, top_k, top_p, trim):
    """End to end: the first 3 tokens sampled by DFlash (random drafter) follow the target's law, also
    when each block is cut by its drafts' confidence before verification."""
    target, drafter = tiny_models(seed=2, vocab_size=6)
    engine = Engine(target, drafter, max_slots=100, policy=ConfidenceCut(3) if trim else None)
    fits, chi2, threshold = sampled_sequences_fit_the_target(engine, temperature, top_k, top_p)
    assert fits, (chi2, threshold)
    if trim:
        assert 1 < len(engine.stats.block_sizes)  # blocks were cut


def test_a_trim_that_peeks_at_sampled_tokens_is_caught():
    """The same test flags a trim decided from the sampled drafts themselves."""
    target, drafter = tiny_models(seed=2, vocab_size=6)
    engine = TokenPeekingEngine(target, drafter, max_slots=100)
    fits, chi2, threshold = sampled_sequences_fit_the_target(engine, 1.0, 0, 1.0, num=10000)
    assert not fits, (chi2, threshold)


def test_a_seeded_request_gets_the_same_tokens_with_or_without_speculation_in_any_batch():
    """A seeded sampled request's tokens are functions of its seed and positions (float32): plain decoding,
    DFlash at blocks 2 and 4, suffix drafts beside DFlash, a batch shared with other requests and an engine
    that served others first all give the same output, and speculation accepted drafts on the way."""
    from engine.suffix import SuffixProposer

    target, drafter = tiny_models(seed=3)
    prompts = repetitive_prompts(3, TINY.vocab_size, seed=3) + random_prompts(2, TINY.vocab_size, seed=3)
    seeded = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=40 + i) for i in range(len(prompts))]
    reference = [Engine(target).generate_batch([p], [params])[0].output_ids for p, params in zip(prompts, seeded)]
    assert len({tuple(r) for r in reference}) == len(prompts)
    other = SamplingParams(max_tokens=24, temperature=1.0)  # unseeded: rejection sampling beside them
    for engine in (Engine(target, drafter, max_slots=6, policy=FixedBlockPolicy(2)),
                   Engine(target, drafter, max_slots=6, policy=FixedBlockPolicy(4)),
                   Engine(target, drafter, max_slots=6, policy=AlternateSources(4), suffix=SuffixProposer())):
        engine.generate_batch(random_prompts(3, TINY.vocab_size, seed=9), other)  # a history before
        out = engine.generate_batch(prompts + [[1, 2]], seeded + [other])
        assert [r.output_ids for r in out[:-1]] == reference
        alone = [engine.generate_batch([p], [params])[0].output_ids for p, params in zip(prompts, seeded)]
        assert alone == reference
        assert engine.stats.num_accepted_tokens > 0


def test_seeded_speculative_sampling_over_seeds_matches_target_distribution():
    """Over requests with different seeds, the first 3 tokens that seeded DFlash samples (random drafter,
    blocks cut by confidence) follow the target's law."""
    target, drafter = tiny_models(seed=2, vocab_size=6)
    engine = Engine(target, drafter, max_slots=100, policy=ConfidenceCut(3))
    fits, chi2, threshold = sampled_sequences_fit_the_target(engine, 0.8, 0, 0.9, seeded=True)
    assert fits, (chi2, threshold)


def test_prefill_groups_fit_the_budget_in_arrival_order():
    rows = [SimpleNamespace(prompt_ids=[0] * n) for n in (5, 5, 20, 3)]
    assert prefill_group(rows, 12) == rows[:2]  # a third row would pad all three to 20
    assert prefill_group(rows, 4) == rows[:1]  # at least one, whatever its length
    assert prefill_group(rows, 80) == rows


def test_new_prompts_alternate_with_decode_steps_and_outputs_stay_exact():
    """A request arriving while others decode: its prefill and the running requests' decode steps
    alternate (one budget-sized prefill group at a time), and greedy outputs equal each request alone."""
    target, drafter = tiny_models()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 1], [2, 3, 4, 5], [6, 7]]
    params = lambda: SamplingParams(max_tokens=12, block_size=4)
    alone = [Engine(target, drafter).generate_batch([p], params())[0].output_ids for p in prompts]
    engine = Engine(target, drafter, max_slots=4, prefill_token_budget=8)
    first = engine.add_request(prompts[0], params())
    assert [o.request_id for o in engine.step()] == [first.request_id]  # its prefill
    engine.step()  # a decode step
    later = [engine.add_request(p, params()) for p in prompts[1:]]
    kinds = []
    while not all(r.output_ids for r in later):
        ids = [o.request_id for o in engine.step()]
        kinds.append("decode" if first.request_id in ids else [r.request_id for r in later if r.request_id in ids])
    # budget 8: [5-token prompt] alone, then [4, 2] padded to 2 x 4 = 8 together
    assert kinds == [[later[0].request_id], "decode", [later[1].request_id, later[2].request_id]]
    while engine.num_running:
        engine.step()
    assert [r.output_ids for r in [first, *later]] == alone


def test_long_backlogs_are_taken_in_apart_with_the_same_drafts(monkeypatch):
    """A new request's prompt features (a long backlog) get a drafter pass of their own instead of the
    batch's block pass padding every row to them: the same drafter cache and drafts as the padded pass;
    the short backlogs of the running rows stay in the block pass."""
    target, drafter = tiny_models()
    shorts, long_prompt = random_prompts(3, TINY.vocab_size, seed=2), random_prompts(1, TINY.vocab_size, lo=300, hi=300)[0]

    def draft_once(call_positions):
        engine = Engine(target, drafter, max_slots=4, policy=FixedBlockPolicy(4), backlog_call_positions=call_positions)
        taken = []
        take = engine.drafter.take_context
        monkeypatch.setattr(engine.drafter, "take_context", lambda f, *a: taken.append(f.shape[1]) or take(f, *a))
        params = SamplingParams(max_tokens=20, block_size=4)
        for p in shorts:
            engine.add_request(p, params)
        engine.step()  # their prefill
        engine.step()  # a drafting step takes in the prompts' features
        engine.policy = FixedBlockPolicy(1)
        engine.step()  # a block-1 step: each keeps a few positions' features
        engine.add_request(long_prompt, params)
        engine.step()  # its prefill
        running = list(engine.requests.values())
        widths = [r.pending_features.shape[0] for r in running]
        block = engine.draft(running, [4] * len(running))
        return widths, taken, block, engine.draft_cache

    widths, taken, apart, cache = draft_once(64)
    assert widths[-1] == 300 and max(widths[:-1]) <= 5 and taken == [300] and apart.caught_up == 300
    _, never, padded, padded_cache = draft_once(None)
    assert never == [] and padded.caught_up == 300
    assert torch.equal(apart.block_ids, padded.block_ids)
    torch.testing.assert_close(apart.confidence, padded.confidence)
    positions = slice(0, cache.max_len)  # position max_len is where padding is written
    torch.testing.assert_close(cache.k[:, :, :, positions], padded_cache.k[:, :, :, positions])
    torch.testing.assert_close(cache.v[:, :, :, positions], padded_cache.v[:, :, :, positions])


def test_stream_abort_frees_slots():
    target, drafter = tiny_models()
    engine = Engine(target, drafter, max_slots=2)
    stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=50, block_size=4))
    next(stream)
    assert engine.target_cache.num_used == 1 and engine.draft_cache.num_used == 1
    stream.close()  # a client that goes away
    assert engine.target_cache.num_used == 0 and engine.draft_cache.num_used == 0
    for _ in range(20):  # many requests in a row leave nothing behind
        engine.generate_batch([[1, 2]], SamplingParams(max_tokens=5))
    assert engine.target_cache.num_used == 0 and engine.num_running == 0


def test_after_churn_a_decode_batch_reads_its_slots_as_one_view():
    """A finished request's slot goes to the next request and steps take requests in slot order, so
    the target reads a step's keys and values as a slice of the cache, not a gathered copy."""
    target, drafter = tiny_models()
    engine = Engine(target, drafter, max_slots=4)
    reads = []
    read = engine.target_cache.read
    engine.target_cache.read = lambda layer, index, kv_len: reads.append(index) or read(layer, index, kv_len)
    params = SamplingParams(max_tokens=30, block_size=4)
    for prompt in random_prompts(4, TINY.vocab_size, seed=1):
        engine.add_request(prompt, params)
    first = engine.requests[min(engine.requests)]
    engine.release(first)  # leaves a hole at slot 0 behind slots 1-3
    late = engine.add_request([1, 2, 3], params)  # arrives last, takes slot 0
    assert late.target_slot == 0
    while engine.num_running and late.output_ids == []:
        engine.step()  # prefills
    reads.clear()
    engine.step()  # a decode step over slots 0-3, the late request first
    assert reads and all(isinstance(index, slice) for index in reads)


def test_prompts_that_extend_other_requests_start_from_their_cache_and_stay_exact():
    """A prompt that extends a finished request's tokens (the next agent turn), or shares a long prefix
    with a running one (a system prompt), copies those keys and values and prefills the rest: same output
    and the same drafts as a full prefill (float32). A slot taken over by another prompt is not reused."""
    target, drafter = tiny_models(seed=6)
    rng = random.Random(6)
    tokens = lambda n: [rng.randrange(TINY.vocab_size) for _ in range(n)]
    params = SamplingParams(max_tokens=16, block_size=4)
    cached, plain = Engine(target, drafter, max_slots=3, prefix_cache=True), Engine(target, drafter, max_slots=3)

    def same_as_plain(*requests):
        while not all(r.finished for r in requests):
            cached.step()
        for r in requests:
            ref = plain.generate_batch([r.prompt_ids], params)[0]
            assert (r.output_ids, r.acceptance_lengths) == (ref.output_ids, ref.acceptance_lengths)

    first = tokens(45)
    a = cached.add_request(first, params)
    same_as_plain(a)
    b = cached.add_request(first + a.output_ids + tokens(6), params)
    same_as_plain(b)
    assert a.num_prefix_cached == 0  # the drafter's cache may lag the target's by the last step's tokens
    assert len(first) + len(a.output_ids) - 5 <= b.num_prefix_cached <= len(first) + len(a.output_ids) - 1

    taking = cached.add_request(tokens(45), params)  # b's slot, the lowest free one
    cached.step()  # its prefill overwrites what b left there
    after_b = cached.add_request(b.prompt_ids + b.output_ids + tokens(6), params)
    assert after_b.num_prefix_cached == 0
    same_as_plain(taking, after_b)

    system = tokens(40)
    running = cached.add_request(system + tokens(5), params)
    cached.step(), cached.step()  # its prefill, then a step that drafts: both caches hold the system prompt
    joining, probe = (cached.add_request(system + tokens(5), params) for _ in range(2))
    assert min(joining.num_prefix_cached, probe.num_prefix_cached) >= len(system)
    cached.step()  # their prefill, from the positions they copied
    alone = plain.add_request(probe.prompt_ids, params)
    plain.step()
    drafts, ref = cached.draft([probe], [4]), plain.draft([alone], [4])  # the drafter's cache was copied too
    assert torch.equal(drafts.block_ids, ref.block_ids)
    torch.testing.assert_close(drafts.confidence, ref.confidence)
    cached.abort(probe.request_id), plain.abort(alone.request_id)
    same_as_plain(running, joining)
    assert cached.target_cache.num_used == cached.draft_cache.num_used == 0


def test_stop_tokens_and_max_tokens():
    target, drafter = tiny_models()
    prompt = [1, 2, 3]
    free = Engine(target, drafter).generate_batch([prompt], SamplingParams(max_tokens=30, block_size=4))[0].output_ids
    stop = free[5]
    stopped = Engine(target, drafter).generate_batch([prompt], SamplingParams(max_tokens=30, stop_token_ids=(stop,)))[0]
    assert stopped.output_ids == free[: free.index(stop) + 1] and stopped.finish_reason == "stop"
    short = Engine(target, drafter).generate_batch([prompt], SamplingParams(max_tokens=7, block_size=4))[0]
    assert short.output_ids == free[:7] and short.finish_reason == "length"


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=10_000), "context length"),
        (dict(block_size=0), "block_size"),
    ],
)
def test_bad_parameters_fail_before_work_without_leaks(params, message):
    target, drafter = tiny_models()
    engine = Engine(target, drafter, max_slots=2, max_len=256)
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2, 3], SamplingParams(**params))
    assert engine.target_cache.num_used == 0 and engine.draft_cache.num_used == 0


def test_bad_prompts_and_mismatched_drafter():
    target, drafter = tiny_models()
    engine = Engine(target, drafter, max_slots=2, max_len=64)
    with pytest.raises(ValueError, match="context length"):
        engine.add_request(list(range(8)) * 10, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 99], SamplingParams(max_tokens=4))
    assert engine.target_cache.num_used == 0
    wide = Drafter(DrafterConfig.for_target(ModelConfig(**{**TINY.__dict__, "hidden_size": 48}), mask_token_id=0))
    with pytest.raises(ValueError, match="hidden size"):
        Engine(target, wide)
    big_vocab = Drafter(DrafterConfig.for_target(ModelConfig(**{**TINY.__dict__, "vocab_size": 9}), mask_token_id=0))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(target, big_vocab)


@pytest.mark.slow
def test_default_model_dflash_equals_target_greedy_batched():
    """float32, default model: DFlash output equals plain greedy decoding, alone and as a batch of 8."""
    from engine.config import EngineConfig, build_engine, load_models

    config = EngineConfig(dtype="float32", draft="random", policy="fixed")
    loaded = load_models(config)
    questions = ["What is 2+2?", "Name three colors.", "Write a haiku about rain.", "Say hello in French.",
                 "Explain what a CPU does in one long sentence with many details.", "List two fruits.",
                 "Why is the sky blue?", "Count from one to five."]
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False) for q in questions]
    reference = greedy_outputs(build_engine(replace(config, draft="none"), loaded), prompts, 24)
    engine = build_engine(config, loaded)
    assert greedy_outputs(engine, prompts, 24) == reference
    assert engine.generate_batch(prompts[:1], SamplingParams(max_tokens=24))[0].output_ids == reference[0]
    assert engine.target_cache.num_used == 0


# ---- suffix drafting beside DFlash ----------------------------------------------------------------


class AlternateSources(FixedBlockPolicy):
    """Every other running request verifies its suffix proposal, the rest DFlash's block: a test policy
    that makes every step a mixed batch whatever the calibration would say."""

    def suffix_widths(self, requests, caps, proposals):
        return [len(p.token_ids[: cap - 1]) if p is not None and i % 2 == 0 else 0
                for i, (cap, p) in enumerate(zip(caps, proposals))]


def repetitive_prompts(n, vocab, seed=0):
    """Prompts that repeat a phrase, so their own tokens give suffix proposals from the first step."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(vocab) for _ in range(rng.randint(3, 6))]
        out.append(phrase * rng.randint(2, 4) + [rng.randrange(vocab)])
    return out


@pytest.mark.parametrize("with_drafter", [False, True], ids=["suffix-only", "dflash+suffix"])
def test_suffix_drafting_greedy_equals_autoregressive(with_drafter):
    """Greedy output with suffix drafts (alone, or chosen per request and step beside the drafter's blocks)
    is the target's own; drafts were made and accepted by the suffix proposer; no slot or index is left."""
    from engine.suffix import SuffixProposer

    target, drafter = tiny_models(seed=4)
    prompts = repetitive_prompts(6, TINY.vocab_size) + random_prompts(2, TINY.vocab_size, seed=4)
    reference = greedy_outputs(Engine(target), prompts, 40)
    engine = Engine(target, drafter if with_drafter else None, max_slots=3, suffix=SuffixProposer())
    assert greedy_outputs(engine, prompts, 40) == reference
    suffix = engine.stats.of("suffix")
    assert suffix.num_drafts > 0 and suffix.num_accepted_tokens > 0
    assert engine.target_cache.num_used == 0 and not engine.suffix.requests
    assert engine.suffix.global_index.num_tokens == sum(len(r) for r in reference)  # finished outputs are kept


def test_mixed_batch_gives_each_request_what_it_gets_alone():
    """A batch where some rows verify suffix drafts and others the drafter's block, every step (float32):
    each row's output is exactly what the request gets alone, and both proposers drafted in it."""
    from engine.suffix import SuffixProposer

    target, drafter = tiny_models(seed=5)
    prompts = repetitive_prompts(6, TINY.vocab_size, seed=5)
    alone = [greedy_outputs(Engine(target, drafter, max_slots=1), [p], 30)[0] for p in prompts]
    engine = Engine(target, drafter, max_slots=6, policy=AlternateSources(4), suffix=SuffixProposer())
    assert greedy_outputs(engine, prompts, 30) == alone
    assert engine.stats.of("suffix").num_drafts > 0 and engine.stats.of("dflash").num_drafts > 0


@pytest.mark.parametrize("with_drafter", [False, True], ids=["suffix-only", "dflash+suffix"])
def test_sampling_with_suffix_drafts_matches_target_distribution(with_drafter):
    """Suffix drafts enter rejection sampling with one-hot draft probabilities: the first 3 sampled tokens
    still follow the target's law (earlier outputs in the shared index give proposals at most steps)."""
    from engine.suffix import SuffixProposer

    target, drafter = tiny_models(seed=2, vocab_size=6)
    policy = AlternateSources(3) if with_drafter else None
    engine = Engine(target, drafter if with_drafter else None, max_slots=100, policy=policy, suffix=SuffixProposer())
    fits, chi2, threshold = sampled_sequences_fit_the_target(engine, 0.9, 0, 1.0)
    assert fits, (chi2, threshold)
    assert engine.stats.of("suffix").num_drafts > 100


def test_suffix_engine_takes_short_and_repetitive_prompts():
    """A one-token prompt (nothing to match yet) and a prompt of one token repeated 400 times (the tiny
    model's context is 512) decode
    exactly, without error, and in bounded time."""
    import time

    from engine.suffix import SuffixProposer

    target, _ = tiny_models(seed=6)
    engine = Engine(target, max_slots=2, suffix=SuffixProposer())
    prompts = [[3], [5] * 400]
    reference = greedy_outputs(Engine(target, max_slots=2), prompts, 48)
    start = time.perf_counter()
    assert greedy_outputs(engine, prompts, 48) == reference
    assert time.perf_counter() - start < 30


def test_two_branch_recording_scores_each_draft_as_verification_did():
    """engine.branches: its recording engine gives the engine's own greedy output (float32), records one step
    per verify with both drafts, and scores the chosen draft's accepted length as the verify found it; the
    estimate commits the better draft (best single) or the longer of both (tree) at the costs given."""
    from engine.branches import RecordingEngine, Step, accepted, copy_walk, estimate
    from engine.policy import CostModel
    from engine.suffix import SuffixProposer

    target, drafter = tiny_models(seed=5)
    prompts = repetitive_prompts(4, TINY.vocab_size, seed=5)
    reference = greedy_outputs(Engine(target), prompts, 30)
    engine = RecordingEngine(target, drafter, max_slots=4, policy=AlternateSources(4), suffix=SuffixProposer())
    requests = engine.generate_batch(prompts, SamplingParams(max_tokens=30))
    assert [r.output_ids for r in requests] == reference
    chose = set()
    for r in requests:
        steps = engine.steps[r.request_id]
        assert len(steps) == len(r.acceptance_lengths)
        for s, committed in zip(steps, r.acceptance_lengths):
            a = accepted(s.suffix if s.chose_suffix else s.dflash, r.output_ids, s.position)
            assert min(a + 1, len(r.output_ids) - s.position) == committed
            chose.add(s.chose_suffix)
    assert chose == {True, False}

    flat = CostModel([1], [1, 33], [[1.0, 1.0]], draft_seconds=[[0.0, 0.0]])  # every verify 1 s, drafting free
    steps = [Step(0, dflash=[5, 6], drafted=3, suffix=[5, 7, 8], chose_suffix=False)]
    est = estimate(steps, [5, 7, 8, 9], flat, context=10)
    assert est == {"policy": 2.0, "best single": 4.0, "tree": 4.0, "ar": 1.0}
    # the copy ceiling: 5 is nowhere before it (the target's own token), then [7, 8] is copied from the prompt
    assert copy_walk([1, 7, 8, 2], [5, 7, 8, 9]) == [0, 2]
    assert estimate(steps, [5, 7, 8, 9], flat, context=10, copied=[0, 2])["copy ceiling"] == 2.0
    # a copy holds what the context already has (at most `limit`), and the reply's last token is the target's
    assert copy_walk([3], [3] * 10) == [1, 3, 3]
    assert copy_walk([3], [3] * 20, limit=4) == [1, 3, 4, 4, 3]
