"""Tests for engine.sampling: truncation maths, greedy verification, the statistical check that
speculative rejection sampling emits tokens distributed exactly as the target model (with a buggy
variant to show the check can fail), and seeded sampling's law and purity."""
import math

import pytest
import torch
import torch.nn.functional as F

from engine.sampling import (TOP_P_CANDIDATES, hashed_uniform, sample, sampling_probs, seeded_choice,
                             verify_exact, verify_greedy, verify_rejection)


def _params(batch, temperature=1.0, top_k=0, top_p=1.0):
    return (torch.full((batch,), float(temperature)), torch.full((batch,), int(top_k)),
            torch.full((batch,), float(top_p)))


def _reference_probs(logits, temperature, top_k, top_p):
    """Straightforward one-row implementation: logits [V] -> probs [V] (float64)."""
    x = [v / temperature for v in logits.double().tolist()]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    kept = order[:top_k] if top_k > 0 else order
    z = sum(math.exp(x[i]) for i in kept)
    prob = {i: math.exp(x[i]) / z for i in kept}
    if top_p < 1:
        chosen, mass = [], 0.0
        for i in kept:
            chosen.append(i)
            mass += prob[i]
            if mass >= top_p:
                break
        kept = chosen
    out = torch.zeros(len(x), dtype=torch.float64)
    z = sum(prob[i] for i in kept)
    for i in kept:
        out[i] = prob[i] / z
    return out


# --------------------------------------------------------------------------- sampling_probs

def test_top_k_one_is_argmax_one_hot():
    logits = torch.randn(4, 3, 50)
    probs = sampling_probs(logits, *_params(4, 0.7, top_k=1))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, F.one_hot(logits.argmax(-1), 50).float())


def test_tiny_top_p_keeps_only_top_token():
    logits = torch.randn(4, 3, 50, dtype=torch.bfloat16)
    probs = sampling_probs(logits, *_params(4, 1.3, top_p=1e-6))
    assert torch.equal(probs, F.one_hot(logits.float().argmax(-1), 50).float())


def test_top_p_boundary():
    logits = torch.tensor([0.5, 0.3, 0.2]).log().view(1, 1, 3)
    for top_p, kept in [(0.45, 1), (0.55, 2), (0.75, 2), (0.85, 3), (1.0, 3)]:
        probs = sampling_probs(logits, *_params(1, top_p=top_p))[0, 0]
        assert (probs > 0).sum().item() == kept, top_p


def test_sums_to_one_and_2d_input():
    logits = torch.randn(5, 7, 100) * 3
    temperature, top_k, top_p = torch.rand(5) + 0.2, torch.tensor([0, 1, 5, 50, 100]), torch.rand(5)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, 7))
    assert (probs >= 0).all()
    flat = sampling_probs(logits[:, 0], temperature, top_k, top_p)       # [B, V] works too
    torch.testing.assert_close(flat, probs[:, 0])


def test_mixed_rows_match_per_row_and_reference():
    torch.manual_seed(0)
    batch, n, vocab = 6, 3, 40
    logits = torch.randn(batch, n, vocab) * 2
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.8, 1.0, 1.5])
    top_k = torch.tensor([0, 5, 0, 10, 1, 20])
    top_p = torch.tensor([1.0, 1.0, 0.7, 0.9, 0.5, 0.3])
    probs = sampling_probs(logits, temperature, top_k, top_p)
    for b in range(batch):
        alone = sampling_probs(logits[b:b + 1], temperature[b:b + 1], top_k[b:b + 1], top_p[b:b + 1])
        torch.testing.assert_close(probs[b:b + 1], alone)
        for i in range(n):
            ref = _reference_probs(logits[b, i], temperature[b].item(), top_k[b].item(),
                                   top_p[b].item())
            torch.testing.assert_close(probs[b, i].double(), ref, atol=1e-5, rtol=0)
            assert torch.equal(probs[b, i] > 0, ref > 0)


def test_ties_and_nuclei_wider_than_the_candidates_match_reference():
    """Cuts inside runs of equal logits keep the lowest ids, as a stable sort would, and a nucleus
    reaching past the TOP_P_CANDIDATES most probable tokens is still found exactly."""
    torch.manual_seed(1)
    vocab = 3 * TOP_P_CANDIDATES
    tied = torch.randint(0, 4, (3, vocab)).float()        # long runs of equal logits
    flat = torch.randn(2, vocab) * 0.1                      # nuclei of hundreds of tokens
    logits = torch.cat([tied, flat]).unsqueeze(1)           # [5, 1, V]
    temperature = torch.ones(5)
    top_k = torch.tensor([10, 0, 300, 0, 0])
    top_p = torch.tensor([1.0, 0.3, 0.7, 0.95, 0.999])
    probs = sampling_probs(logits, temperature, top_k, top_p)
    for b in range(5):
        ref = _reference_probs(logits[b, 0], 1.0, top_k[b].item(), top_p[b].item())
        assert torch.equal(probs[b, 0] > 0, ref > 0), b
        torch.testing.assert_close(probs[b, 0].double(), ref, atol=1e-6, rtol=0)
    assert (probs[3:, 0] > 0).sum(-1).min() > TOP_P_CANDIDATES  # the wide case was exercised


# --------------------------------------------------------------------------- verify_greedy

def _one_hot_logits(ids, vocab):
    return F.one_hot(ids, vocab).float() * 5 + torch.randn(*ids.shape, vocab) * 0.1


def test_verify_greedy_hand_cases():
    vocab = 10
    t = torch.tensor([[1, 2, 3, 4]] * 5)                   # target argmax per position, [B, K+1]
    draft = torch.tensor([[1, 2, 3],                        # all accepted -> bonus at last position
                          [9, 2, 3],                        # first draft wrong -> 0 accepted
                          [1, 2, 3],                        # only 1 valid draft (padding matches!)
                          [1, 9, 3],                        # second draft wrong
                          [1, 2, 3]])                       # no valid drafts
    num_draft = torch.tensor([3, 3, 1, 3, 0])
    num_acc, next_ids = verify_greedy(draft, _one_hot_logits(t, vocab), num_draft)
    assert num_acc.tolist() == [3, 0, 1, 1, 0]
    assert next_ids.tolist() == [[1, 2, 3, 4], [1, 0, 0, 0], [1, 2, 0, 0], [1, 2, 0, 0],
                                 [1, 0, 0, 0]]
    assert num_acc.dtype == next_ids.dtype == torch.long


def test_verify_greedy_matches_loop():
    torch.manual_seed(1)
    batch, k, vocab = 64, 5, 4                              # small vocab -> many partial accepts
    logits = torch.randn(batch, k + 1, vocab)
    draft = torch.randint(vocab, (batch, k))
    num_draft = torch.randint(0, k + 1, (batch,))
    num_acc, next_ids = verify_greedy(draft, logits, num_draft)
    for b in range(batch):
        a = 0
        while a < num_draft[b] and draft[b, a] == logits[b, a].argmax():
            a += 1
        assert num_acc[b] == a
        assert next_ids[b, :a].tolist() == draft[b, :a].tolist()
        assert next_ids[b, a] == logits[b, a].argmax()


# --------------------------------------------------------------------------- sample / seeds

def _chi2(counts, expected, z=5.0):
    """Pearson chi-square of counts vs expected; cells with expected < 5 are pooled. Returns
    (statistic, threshold): threshold is the Wilson-Hilferty chi-square quantile at z sigmas
    (~3e-7 false-alarm rate for z=5). Any count in a zero-probability cell gives statistic inf."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    if counts[expected == 0].sum() > 0:
        return math.inf, 0.0
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    df = len(exp) - 1
    threshold = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, threshold


def test_sample_distribution():
    torch.manual_seed(2)
    n, vocab = 40_000, 12
    probs = sampling_probs(torch.randn(1, 1, vocab) * 2, *_params(1, top_k=8))[0, 0]
    ids = sample(probs.expand(n, 1, vocab))
    assert ids.shape == (n, 1) and ids.dtype == torch.long
    stat, threshold = _chi2(torch.bincount(ids.flatten(), minlength=vocab), probs * n)
    assert stat < threshold


# --------------------------------------------------------------------------- verify_rejection

def test_verify_rejection_deterministic_cases():
    vocab, k = 6, 3
    p = torch.randn(4, k + 1, vocab).softmax(-1)
    draft = torch.tensor([[1, 2, 3]] * 4)
    # q == p: always accepted (u * q < q for u < 1); padding never, even with p == q
    num_acc, next_ids = verify_rejection(draft, p[:, :k].clone(), p, torch.tensor([3, 2, 1, 0]))
    assert num_acc.tolist() == [3, 2, 1, 0]
    for b, a in enumerate([3, 2, 1, 0]):
        assert next_ids[b, :a].tolist() == draft[b, :a].tolist()
        assert (next_ids[b, a + 1:] == 0).all()
    # target gives the draft zero probability: rejected, and the correction never repeats it
    p0 = p.clone()
    p0[:, 0, 1] = 0
    p0 = p0 / p0.sum(-1, keepdim=True)
    for _ in range(20):
        num_acc, next_ids = verify_rejection(draft, p[:, :k], p0, torch.full((4,), 3))
        assert (num_acc == 0).all() and (next_ids[:, 0] != 1).all()


def test_bonus_after_full_acceptance_comes_from_p():
    """After all valid drafts are accepted the bonus is drawn from p itself: neither the last real
    draft distribution nor a padding one may be subtracted from it."""
    torch.manual_seed(4)
    n, k, vocab = 8000, 2, 4
    draft = torch.full((n, k), 3)
    q = F.one_hot(draft, vocab).float()                      # [n, K, V], all mass on token 3
    p = torch.cat([q, torch.full((n, 1, vocab), 1 / vocab)], 1)
    p[: n // 2, 0] = 1 / vocab                               # rows with no drafts: p_0 uniform
    num_draft = torch.tensor([0, k]).repeat_interleave(n // 2)
    num_acc, next_ids = verify_rejection(draft, q, p, num_draft)
    assert torch.equal(num_acc, num_draft)
    bonus = next_ids.gather(1, num_acc[:, None])[:, 0]
    for half in (bonus[: n // 2], bonus[n // 2:]):
        stat, threshold = _chi2(torch.bincount(half, minlength=vocab),
                                torch.full((vocab,), len(half) / vocab))
        assert stat < threshold, (stat, threshold)


def _simulate(verify, target, draft, n=40_000, k=3, seed=0, check_bounds=True):
    """Two speculative steps for n independent sequences of a Markov "model": target[prev] and
    draft[prev] are [V, V] tables of next-token distributions. Each step drafts num_draft ~ U{0..k}
    tokens (padding past num_draft is garbage that would be accepted if looked at). Returns counts
    of (x0, x1, x2) = (start token, first two emitted tokens) and their exact expectation."""
    torch.manual_seed(seed)
    vocab = target.shape[0]
    garbage = F.one_hot(torch.zeros(vocab, dtype=torch.long), vocab).float()[0]

    def step(prev):
        tok, ids, qs = prev, [], []
        for _ in range(k):
            qs.append(draft[tok])
            tok = sample(qs[-1])
            ids.append(tok)
        draft_ids, draft_probs = torch.stack(ids, 1), torch.stack(qs, 1)     # [n, K], [n, K, V]
        target_probs = target[torch.cat([prev[:, None], draft_ids], 1)]      # [n, K+1, V]
        num_draft = torch.randint(0, k + 1, (n,))
        pad = torch.arange(k) >= num_draft[:, None]                          # [n, K]
        draft_ids = draft_ids.masked_fill(pad, 0)
        draft_probs[pad] = garbage
        target_probs[:, 1:][pad] = garbage
        num_acc, next_ids = verify(draft_ids, draft_probs, target_probs, num_draft)
        assert not check_bounds or ((num_acc >= 0) & (num_acc <= num_draft)).all()
        return next_ids, num_acc + 1

    x0 = torch.randint(vocab, (n,))
    ids1, count1 = step(x0)
    ids2, _ = step(ids1.gather(1, (count1 - 1)[:, None])[:, 0])
    x1, x2 = ids1[:, 0], torch.where(count1 >= 2, ids1[:, 1], ids2[:, 0])
    counts = torch.bincount((x0 * vocab + x1) * vocab + x2, minlength=vocab ** 3)
    start = torch.bincount(x0, minlength=vocab).double()
    t = target.double()
    expected = start[:, None, None] * t[:, :, None] * t[None, :, :]          # [x0, x1, x2]
    return counts.view(vocab, vocab, vocab), expected


def _markov_tables(temperature, top_k, top_p, vocab=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(vocab, vocab, generator=g) * 1.5
    draft_logits = target_logits + torch.randn(vocab, vocab, generator=g) * 1.5
    params = _params(1, temperature, top_k, top_p)
    return (sampling_probs(target_logits[None], *params)[0],
            sampling_probs(draft_logits[None], *params)[0])


SETTINGS = {"T=1": (1.0, 0, 1.0), "T=0.7,top_k=4": (0.7, 4, 1.0), "T=1.3,top_p=0.8": (1.3, 0, 0.8),
            "top_k=5,top_p=0.9": (1.0, 5, 0.9)}


@pytest.mark.parametrize("setting", SETTINGS)
def test_rejection_sampling_is_lossless(setting):
    target, draft = _markov_tables(*SETTINGS[setting])
    assert (draft - target).abs().sum(-1).mean() > 0.5       # the draft really differs from target
    counts, expected = _simulate(verify_rejection, target, draft)
    stat, threshold = _chi2(counts, expected)
    assert stat < threshold, (stat, threshold)


def _verify_copy(draft_ids, draft_probs, target_probs, num_draft, bug=None):
    """Independent straightforward copy of rejection sampling (multinomial instead of the
    exponential race) with an optional injected bug, to prove the statistical test can fail."""
    batch, k = draft_ids.shape
    rows = torch.arange(batch)
    p_y = target_probs[:, :k].gather(-1, draft_ids[..., None])[..., 0]
    q_y = draft_probs.gather(-1, draft_ids[..., None])[..., 0]
    ratio = q_y / p_y if bug == "accept_q_over_p" else p_y / q_y
    ok = torch.rand(batch, k) < ratio
    if bug != "ignore_num_draft":
        ok &= torch.arange(k) < num_draft[:, None]
    else:
        num_draft = torch.full_like(num_draft, k)
    num_acc = ((~ok).cumsum(1) == 0).sum(1)
    p_a = target_probs[rows, num_acc]
    if bug == "correct_from_p":
        dist = p_a
    else:
        q_a = draft_probs[rows, num_acc.clamp(max=k - 1)] * (num_acc < num_draft)[:, None]
        residual = (p_a - q_a).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        dist = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_a)
    bonus = torch.multinomial(dist, 1)
    return num_acc, F.pad(draft_ids, (0, 1)).scatter(1, num_acc[:, None], bonus)


def test_independent_copy_passes():
    """Control: the un-bugged copy passes, so the failures below come from the injected bugs."""
    target, draft = _markov_tables(*SETTINGS["T=1"])
    stat, threshold = _chi2(*_simulate(_verify_copy, target, draft))
    assert stat < threshold, (stat, threshold)


@pytest.mark.parametrize("bug", ["correct_from_p", "accept_q_over_p", "ignore_num_draft"])
def test_detector_flags_wrong_rules(bug):
    target, draft = _markov_tables(*SETTINGS["T=1"])
    counts, expected = _simulate(lambda *a: _verify_copy(*a, bug=bug), target, draft,
                                 check_bounds=False)
    stat, threshold = _chi2(counts, expected)
    assert stat > 3 * threshold, (stat, threshold)


@pytest.mark.parametrize("candidates", [3, 12, TOP_P_CANDIDATES], ids=["tail", "all-candidates", "default"])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_seeded_choice_over_seeds_follows_the_distribution(candidates, top_p):
    """Over many seeds, one position's seeded token has the row's law: Gumbel-max among the candidates,
    the inverse CDF past them (`tail`: 3 candidates of 12 tokens with mass), and a truncated row's zeros
    never drawn. A choice that ignored the tail, or the candidates' noise, would fail."""
    torch.manual_seed(0)
    probs = sampling_probs(torch.randn(1, 12) * 1.5, 1.0, 0, top_p)[0].double()
    n = 60_000
    ids = seeded_choice(probs.float().expand(n, 1, 12), torch.arange(n), torch.full((n, 1), 5), candidates)
    stat, threshold = _chi2(torch.bincount(ids.flatten(), minlength=12), probs * n)
    assert stat < threshold, (stat, threshold)
    if candidates == 3:  # the test's power: a choice among the candidates alone (the tail ignored) fails it
        kept = torch.zeros(12).scatter(0, probs.topk(3).indices, probs.float().topk(3).values)
        ignored = seeded_choice((kept / kept.sum()).expand(n, 1, 12), torch.arange(n), torch.full((n, 1), 5), 3)
        stat, threshold = _chi2(torch.bincount(ignored.flatten(), minlength=12), probs * n)
        assert stat > threshold, (stat, threshold)


def test_seeded_choice_is_a_function_of_seed_position_and_distribution():
    """The same (seed, position, row) gives the same token in any batch, row order or step; another seed or
    position draws afresh; hashed noise lies in (0, 1) and its rows differ."""
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(4, 3, 50) * 2, -1)
    seeds, positions = torch.tensor([7, 8, 7, 9]), torch.tensor([[10, 11, 12]] * 4)
    together = seeded_choice(probs, seeds, positions, candidates=8)
    alone = torch.stack([seeded_choice(probs[i: i + 1], seeds[i: i + 1], positions[i: i + 1], candidates=8)[0]
                         for i in range(4)])
    assert torch.equal(together, alone)
    flipped = seeded_choice(probs.flip(0), seeds.flip(0), positions, candidates=8)
    assert torch.equal(flipped.flip(0), together)
    row = probs[0].expand(200, 3, 50)
    by_seed = seeded_choice(row, torch.arange(200), positions[:1].expand(200, 3), candidates=8)
    assert len({tuple(t) for t in by_seed.tolist()}) > 20
    u = hashed_uniform(torch.arange(3), torch.arange(4).expand(3, 4), torch.arange(-1, 99).expand(3, 4, 100))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[:, 0], u[:, 1])


def test_seeded_choice_over_a_subset_of_the_vocabulary_draws_the_same_tokens():
    """A reduced draft head's columns (token_ids) take the noise of the tokens they stand for: the choice
    equals the full vocabulary's where the rest has no mass."""
    torch.manual_seed(3)
    subset = torch.tensor([2, 5, 9, 11, 17, 30, 31, 40])
    full = torch.zeros(64, 2, 50).index_copy_(-1, subset, torch.softmax(torch.randn(64, 2, 8) * 2, -1))
    seeds, positions = torch.arange(64), torch.tensor([[3, 4]]).expand(64, 2)
    for candidates in (3, 256):
        on_subset = seeded_choice(full[..., subset], seeds, positions, candidates, token_ids=subset)
        assert torch.equal(subset[on_subset], seeded_choice(full, seeds, positions, candidates))


def test_verify_exact_accepts_the_prefix_equal_to_the_targets_tokens():
    drafts = torch.tensor([[3, 4, 5], [3, 9, 5], [1, 1, 1]])
    target_ids = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [2, 2, 2, 2]])
    num_accepted, next_ids = verify_exact(drafts, target_ids, torch.tensor([3, 3, 3]))
    assert num_accepted.tolist() == [3, 1, 0]
    assert next_ids.tolist() == [[3, 4, 5, 6], [3, 4, 0, 0], [2, 0, 0, 0]]
