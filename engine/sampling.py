"""Sampling maths: temperature/top-k/top-p distributions, per-request seeded sampling, and lossless
verification of drafted blocks (greedy, and speculative rejection sampling, Leviathan et al. 2023,
arXiv 2211.17192). Pure batched tensor functions; knows nothing about models or caches.

Shapes: B = batch rows, n = positions, K = drafts per row (block - 1), V = vocab.
Seeded requests draw nothing from a random stream: seeded_choice makes each token a function of
(seed, position, distribution), hashed. Unseeded sampling (sample, verify_rejection) draws from the
global RNG.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_TINY = torch.finfo(torch.float32).tiny


# top-p looks for a row's nucleus among its this many most probable tokens, and sorts the row's whole
# vocabulary only when the nucleus is wider (a flat distribution at a high top_p)
TOP_P_CANDIDATES = 256


def sampling_probs(logits, temperature, top_k, top_p):
    """Probabilities after temperature, then top-k, then top-p (float32, each row sums to 1).

    logits:      [B, n, V] (any float dtype; [B, V] works too)
    temperature: [B] float, must be > 0 (greedy rows: callers argmax, or use top_k=1)
    top_k:       [B] long, <= 0 disables
    top_p:       [B] float, >= 1 disables; keeps the smallest most-probable set with mass >= top_p
                 (measured after top-k renormalisation), always at least the top token.
    Scalars are accepted for the three parameters and broadcast to every row. Ties at a cut keep the
    lowest ids (as a stable sort would), so top_k=1 agrees with argmax. Pass top_k and top_p as host
    values (lists, CPU tensors): which cuts to make is decided on the host. Nothing sorts the
    vocabulary but a top-p row whose nucleus reaches past TOP_P_CANDIDATES tokens.
    """
    rows = (-1,) + (1,) * (logits.dim() - 1)  # broadcast a [B] parameter over [B, ..., V]
    top_k, top_p = torch.as_tensor(top_k, device="cpu"), torch.as_tensor(top_p, device="cpu").float()
    k_max = min(int(top_k.max()), logits.shape[-1])
    cut_p = bool((top_p < 1).any())
    temperature = torch.as_tensor(temperature, device=logits.device).float().view(rows)
    scores = logits.float() / temperature
    if k_max > 0:
        scores = _top_k_keep(scores, top_k.to(logits.device).view(rows), k_max)
    probs = scores.softmax(-1)
    if not cut_p:
        return probs
    probs = probs.masked_fill(~_top_p_keep(probs, top_p.to(logits.device).view(rows)), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _keep_first(x, cut, count):
    """Mask of the entries of x above cut, then of those equal to it, lowest ids first, up to count
    entries in all (cut, count: [..., 1])."""
    above = x > cut
    tied = x == cut
    return above | (tied & (tied.cumsum(-1) <= count - above.sum(-1, keepdim=True)))


def _keep_top(flat, largest, index, count, cut, cutting):
    """Mask [rows, V] of each cutting row's `count` largest entries of flat (ties at `cut`, its count-th
    largest, lowest ids first), given its top candidates `largest`, `index` [rows, width] in descending
    order. A row whose candidates drop strictly below its cut right after the count-th keeps its first
    `count` candidates, scattered into the mask; only a row with a tie across its cut or a count past its
    candidates is compared and counted over the vocabulary."""
    width = largest.shape[-1]
    clean = (count < width) & (largest.gather(-1, count.clamp(max=width - 1)) < cut)
    keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, index, torch.arange(width, device=flat.device) < count)
    rest = (~clean[:, 0] & cutting).nonzero()[:, 0]
    if len(rest):
        keep[rest] = _keep_first(flat[rest], cut[rest], count[rest])
    return keep


def _top_k_keep(scores, top_k, k_max):
    """scores with all but each row's top_k largest set to -inf (top_k <= 0: all kept)."""
    vocab = scores.shape[-1]
    flat = scores.reshape(-1, vocab)
    top_k = top_k.expand(*scores.shape[:-1], 1).reshape(-1, 1)
    largest, index = flat.topk(min(k_max + 1, vocab), dim=-1)  # one past the widest cut: is it a tie?
    k = top_k.clamp(1, k_max)
    keep = _keep_top(flat, largest, index, k, largest.gather(-1, k - 1), top_k[:, 0] > 0) | (top_k <= 0)
    return scores.masked_fill(~keep.view(scores.shape), float("-inf"))


def _nucleus(descending, top_p):
    """(count [..., 1], its smallest probability [..., 1]) of each row's nucleus among its probabilities
    sorted in descending order."""
    count = (descending.cumsum(-1) - descending < top_p).sum(-1, keepdim=True).clamp_min(1)
    return count, descending.gather(-1, count - 1)


def _top_p_keep(probs, top_p):
    """Mask of each row's nucleus: the smallest most-probable set with mass >= top_p (all if >= 1), found
    among its TOP_P_CANDIDATES most probable tokens, or over its sorted vocabulary where it is wider."""
    vocab = probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    top_p = top_p.expand(*probs.shape[:-1], 1).reshape(-1, 1)
    largest, index = flat.topk(min(TOP_P_CANDIDATES, vocab), dim=-1)  # descending
    count, cut = _nucleus(largest, top_p)
    wide = ((largest.cumsum(-1)[:, -1] < top_p[:, 0]) & (top_p[:, 0] < 1)).nonzero()[:, 0]  # nuclei past the candidates
    if len(wide):
        count[wide], cut[wide] = _nucleus(flat[wide].sort(dim=-1, descending=True).values, top_p[wide])
    return (_keep_top(flat, largest, index, count, cut, top_p[:, 0] < 1) | (top_p >= 1)).view(probs.shape)


def sample(probs) -> torch.Tensor:
    """Sample ids [B, n] (long) from probs [B, n, V] ([B, V] -> [B]).

    Inverse CDF: one U[0, 1) draw per sampled position, placed on the running
    sum of the probabilities (searchsorted): id i is picked with probability p_i, a zero-probability id
    never (its interval is empty). One draw per position, not one per vocabulary entry as an exponential
    race takes: on a CPU those cost ~1 ms per row of 49,152 ids (docs/design.md).
    """
    cdf = probs.float().cumsum(-1)
    u = torch.rand((*probs.shape[:-1], 1), device=probs.device)
    ids = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return ids.squeeze(-1).clamp_max(probs.shape[-1] - 1)


# ---- seeded sampling: a position's token is a function of (seed, position, distribution) ----------------


def _u64(x: int) -> int:
    """A 64-bit constant as the int64 torch holds it."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _u64(0x9E3779B97F4A7C15), _u64(0xBF58476D1CE4E5B9), _u64(0x94D049BB133111EB)


def _shr(x, s):
    """Logical right shift of int64 x (torch shifts arithmetically)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x):
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic): every input bit reaches every output bit."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def hashed_uniform(seeds, positions, ids):
    """U(0, 1) float64 noise that is a pure function of (seed, position, id): the same on any device, in
    any batch, on any step. seeds [B] long; positions [B, n] long; ids [B, n, m] long (-1: a draw of the
    position that belongs to no token). Returns [B, n, m]."""
    key = _mix(_mix(positions + _GOLDEN) ^ seeds[:, None])  # [B, n]
    bits = _mix(key[..., None] + (ids + 2) * _GOLDEN)
    return (_shr(bits, 11).double() + 0.5) / float(1 << 53)


def seeded_choice(probs, seeds, positions, candidates: int = TOP_P_CANDIDATES, token_ids=None):
    """A sample of each position's distribution decided by its request's seed and its position alone.

    probs [B, n, V] (each row summing to ~1), seeds [B] long, positions [B, n] long (the position of the
    token drawn). Returns ids [B, n] long, each distributed exactly as its row of probs:
    - with a hashed uniform u of the position, the token is one of the row's `candidates` most probable
      ones if u * total < their mass (always when no other token has mass), else one of the others;
    - among the candidates: Gumbel-max, argmax(log p + g) with g = -log(-log(u_id)) hashed per token id,
      which picks each with probability p / mass; among the others, the inverse CDF at u's rescaled value.
    Gumbel noise by token id couples two distributions: a drafter that draws its q with the same seed and
    position picks the target's token whenever argmax(log q + g) = argmax(log p + g), which is likely when
    q is close to p; and the target's token never depends on what was drafted (docs/design.md).
    token_ids [V] long: the token id of each column of probs, when they are a subset of the vocabulary
    (a reduced draft head's); the noise is the token's, the result a column index."""
    probs = probs.float()
    top, ids = probs.topk(min(candidates, probs.shape[-1]), dim=-1)  # [B, n, m], descending
    gumbel = -torch.log(-torch.log(hashed_uniform(seeds, positions, ids if token_ids is None else token_ids[ids])))
    scores = torch.where(top > 0, top.double().log() + gumbel, -torch.inf)
    choice = ids.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    wider = (top[..., -1] > 0) & (top.shape[-1] < probs.shape[-1])  # mass may lie past the candidates
    if not bool(wider.any()):
        return choice
    mass, total = top.double().sum(-1), probs.sum(-1).double()
    u = hashed_uniform(seeds, positions, torch.full_like(ids[..., :1], -1))[..., 0] * total
    tail = (wider & (u >= mass)).nonzero(as_tuple=True)
    if not len(tail[0]):
        return choice
    rest = probs[tail].scatter(-1, ids[tail], 0.0)  # [t, V]: the mass past the candidates
    cdf = rest.double().cumsum(-1)
    v = (u[tail] - mass[tail]).clamp_min(0) / (total[tail] - mass[tail]).clamp_min(_TINY)
    tail_ids = torch.searchsorted(cdf, (v.clamp_max(1) * cdf[:, -1])[:, None], right=True)[:, 0]
    has_rest = cdf[:, -1] > 0  # rounding put u past a candidate mass that held everything: keep the Gumbel choice
    choice[tail] = torch.where(has_rest, tail_ids.clamp_max(probs.shape[-1] - 1), choice[tail])
    return choice


def _accepted_prefix(ok, num_draft):
    """Length [B] of the leading run of True in ok [B, K], positions >= num_draft [B] never count."""
    pos = torch.arange(ok.shape[1], device=ok.device)
    ok = ok & (pos < num_draft[:, None])
    return ((~ok).cumsum(-1) == 0).sum(-1)


def _zero_tail(ids, num_accepted):
    """Zero ids [B, K+1] after position num_accepted [B] (the bonus token's slot)."""
    pos = torch.arange(ids.shape[1], device=ids.device)
    return ids.masked_fill(pos > num_accepted[:, None], 0)


def verify_exact(draft_ids, target_ids, num_draft):
    """Accept the longest prefix of drafts equal to the target's own tokens; bonus = the target's token there.

    draft_ids:  [B, K] long, tokens for block positions 1..K
    target_ids: [B, K+1] long, the target's token after each block position (its argmax, or its seeded
                sample): position i's is the token at position i+1
    num_draft:  [B] long, valid drafts per row; entries past it are padding, never accepted
    Returns num_accepted [B] long in [0, num_draft] and next_ids [B, K+1] long holding the accepted
    drafts then the bonus token in positions 0..num_accepted (zeros after). No host sync.
    """
    num_accepted = _accepted_prefix(draft_ids == target_ids[:, :-1], num_draft)  # [B]
    # accepted drafts equal the target's tokens, so those already are the emitted tokens
    return num_accepted, _zero_tail(target_ids, num_accepted)


def verify_greedy(draft_ids, target_logits, num_draft):
    """verify_exact against the target's argmax (target_logits [B, K+1, V])."""
    return verify_exact(draft_ids, target_logits.argmax(-1), num_draft)


def verify_rejection(draft_ids, draft_probs, target_probs, num_draft):
    """Speculative rejection sampling: the emitted tokens are distributed exactly as under p.

    draft_ids:    [B, K] long, draft i was sampled from draft_probs[:, i]
    draft_probs:  [B, K, V] q, the exact (post temperature/top-k/top-p) draft distributions
    target_probs: [B, K+1, V] p, target distributions (same processing); position i predicts i+1
    num_draft:    [B] long, valid drafts per row; padding past it is never accepted
    Draft i is accepted w.p. min(1, p_i(y)/q_i(y)); at the first rejection a the token is drawn from
    normalize(max(0, p_a - q_a)) (p_a if that is all zero); if all num_draft drafts are accepted
    the bonus is drawn from p at position num_draft. Returns (num_accepted [B], next_ids [B, K+1])
    as verify_greedy. No host sync.
    """
    batch, k = draft_ids.shape
    rows = torch.arange(batch, device=draft_ids.device)
    y = draft_ids.unsqueeze(-1)
    p_y = target_probs[:, :k].gather(-1, y).squeeze(-1)                           # [B, K]
    q_y = draft_probs.gather(-1, y).squeeze(-1)                                   # [B, K]
    u = torch.rand((batch, k), device=draft_ids.device)                          # [B, K]
    num_accepted = _accepted_prefix(u * q_y < p_y, num_draft)                     # [B]

    # distribution of the token at position num_accepted: residual after a rejection, else p
    p_a = target_probs[rows, num_accepted]                                        # [B, V]
    rejected = (num_accepted < num_draft)[:, None]                                # [B, 1]
    q_a = draft_probs[rows, num_accepted.clamp(max=k - 1)] if k else torch.zeros_like(p_a)
    residual = (p_a - q_a * rejected).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(_TINY), p_a)
    bonus = sample(residual)                                                      # [B]

    next_ids = F.pad(draft_ids, (0, 1)).scatter(1, num_accepted[:, None], bonus[:, None])
    return num_accepted, _zero_tail(next_ids, num_accepted)
