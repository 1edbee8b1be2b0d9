"""Block-size policies: how many positions each request verifies in the next step.

A policy sees the running requests (each one's `.stats`, a SpecStats) and each one's cap (the
largest block it may verify: its own block size and remaining budget) and returns one block size
per request. Block b = positions verified in a step: the last committed token + b - 1 drafts; b = 1
is a plain autoregressive step with no drafter call.

- FixedBlockPolicy: the same block for every request, clipped to its cap.
- AdaptiveBlockPolicy: maximises expected committed tokens per second, twice a step: before
  drafting it picks how many positions to draft (from per-request acceptance estimates and an
  engine-wide pooled one that new requests start from), and after drafting it picks how many of
  them each request verifies (`trim`, from each draft's confidence, calibrated online against
  what the target accepted). It knows the hardware only through a CostModel.
- CostModel: measured seconds per engine step by (batch size, block size). `CostModel.profile` is
  the only code here that touches models: it times real forwards through the engine's model
  interface (TargetModel, Drafter) on scratch KV caches.

Expected tokens: with conditional acceptance a_k = P(draft k accepted | drafts 1..k-1 accepted),
a step with block b commits E(b) = 1 + sum_{k=1}^{b-1} prod_{j<=k} a_j tokens on average.
"""

import bisect
import json
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.drafter import DraftHead
from engine.sampling import verify_greedy


class BlockPolicy:
    _suffix_calibration = None

    @property
    def suffix_calibration(self) -> "SuffixCalibration":
        if self._suffix_calibration is None:
            self._suffix_calibration = SuffixCalibration()
        return self._suffix_calibration

    def suffix_widths(self, requests, caps: list[int], proposals) -> list[int]:
        """How many drafts of its suffix proposal (engine.suffix.Proposal, or None) each request verifies
        this step instead of drafting with DFlash; 0: DFlash (or a plain step). Default: the whole proposal
        (up to cap - 1) where its calibrated expected tokens beat the request's DFlash acceptance length so far."""
        out = []
        for r, cap, p in zip(requests, caps, proposals):
            if p is None or not p.token_ids or cap < 2:
                out.append(0)
                continue
            expected = expected_tokens(self.suffix_calibration.acceptance(p, r.params.temperature > 0)[: cap - 1])
            dflash = r.stats.by_proposer.get("dflash")
            out.append(len(expected) - 1 if dflash is None or expected[-1] > dflash.mean_acceptance_length else 0)
        return out

    def observe_suffix(self, requests, proposals, widths: list[int], num_accepted: list[int]):
        """What the target accepted of the suffix drafts it verified (`widths[i]` of proposal i)."""
        for r, p, w, a in zip(requests, proposals, widths, num_accepted):
            self.suffix_calibration.observe(p, r.params.temperature > 0, w, a)

    def choose(self, requests, caps: list[int]) -> list[int]:
        """How many positions each request drafts (its block: last token + drafts), at most its cap."""
        raise NotImplementedError

    def trim(self, requests, block_sizes: list[int], confidence, context: int, trees=None) -> list[int]:
        """How many of its drafted block's positions each request verifies, given each draft's
        confidence [batch, max(block_sizes) - 1] (the peak of its draft distribution) and the
        longest row's cached positions. Deciding from the drafter's distributions alone, never from a
        sampled token, keeps sampling lossless. trees: per row an engine.tree.Tree of its block's
        nodes best first (the row then verifies its first size - 1 nodes instead of a chain), or None.
        Default: verify everything drafted."""
        return list(block_sizes)

    def observe_verified(self, requests, block_sizes: list[int], verified_sizes: list[int], confidence,
                         num_accepted: list[int], trees=None):
        """What the target accepted of each request's verified drafts (ignored by default). trees: per row
        with a token tree, (the engine.tree.Tree of its drafted block, [(node, held)] for each node the
        target tested: engine.tree.outcomes), else None."""

    def observe_step(self, batch: int, block: int, context: int, seconds: float, verified: float | None = None,
                     caught_up: int = 0):
        """The engine's wall time of a decode step it ran with this policy's choice: `block` drafted,
        `verified` positions per row on average (None: all of the block), and the drafter took in the
        target's features of `caught_up` positions (the widest row). Ignored by default."""

    def observe_gap(self, seconds: float):
        """The wall time between two engine steps while requests ran: what the engine's caller spends
        per step (streaming the step's tokens, its event loop). Ignored by default."""


class FixedBlockPolicy(BlockPolicy):
    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    def choose(self, requests, caps):
        return [min(self.block_size, cap) for cap in caps]


# ---- cost model -----------------------------------------------------------------------------


def _bracket(grid, x):
    """(i, j, w): x lies at grid[i] + w * (grid[j] - grid[i]); w > 1 past the end (extrapolation),
    flat (w = 0) below the start."""
    if len(grid) == 1:
        return 0, 0, 0.0
    i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
    return i, i + 1, max(0.0, (x - grid[i]) / (grid[i + 1] - grid[i]))


# Bumped when the engine's step costs change: tables saved before are profiled again.
COST_MODEL_VERSION = 6

EVERY_BLOCK_UP_TO = 4  # the policy's grid holds every block up to this, then powers of two
PROFILE_CONTEXTS = (32, 256, 1024)  # cached positions per row: chat (~100-300) to RAG (~700-1000) prompts


@dataclass
class CostModel:
    """Seconds per engine step (drafter pass + target verify) on a (batch size, block size) grid,
    measured at one or more context lengths; `draft_seconds` (same shape) is the drafter's share.

    Between and past grid points the cost is piecewise linear in batch and in block (bilinear in a
    cell, extended linearly along the last segment past the largest sizes), and piecewise linear in
    the context (cached positions per row) between the measured contexts: flat below the first,
    the last segment extended past the last (never below the last table: attention reads every
    cached position). One table: the same cost whatever the context.
    """

    batch_sizes: list[int]  # ascending
    block_sizes: list[int]  # ascending; block 1 = an autoregressive step (no drafter call)
    seconds: list  # [len(contexts)][len(batch_sizes)][len(block_sizes)]; one [batch][block] table is accepted
    meta: dict = field(default_factory=dict)  # what was profiled: models, dtype, device
    contexts: list[int] = field(default_factory=lambda: [256])  # ascending; cached positions per row of each table
    draft_seconds: list | None = None  # as `seconds`: the drafter pass alone (None: zeros, all is verify)
    # A ragged verify (rows of different sizes) costs the dense verify at its mean size moved this share of the
    # way to its widest row's: attention runs on the padded layout. 1.0: as wide as its widest row, what a CPU
    # measures (docs/design.md); 0.0: only its real positions count.
    ragged_share: float = 1.0

    def __post_init__(self):
        self.batch_sizes, self.block_sizes = [int(b) for b in self.batch_sizes], [int(b) for b in self.block_sizes]
        self.contexts = [int(c) for c in self.contexts]
        for name in ("batch_sizes", "block_sizes", "contexts"):
            values = getattr(self, name)
            if not values or values != sorted(set(values)):
                raise ValueError(f"{name} must be strictly ascending and not empty")
        shape = (len(self.contexts), len(self.batch_sizes), len(self.block_sizes))
        self.seconds = self._tables(self.seconds, shape)
        self.draft_seconds = self._tables(self.draft_seconds or [[[0.0] * shape[2]] * shape[1]] * shape[0], shape)
        self._brackets = {}  # (grid, x) -> _bracket(grid, x); not a field: neither saved nor compared

    @staticmethod
    def _tables(tables, shape):
        if tables and tables[0] and not isinstance(tables[0][0], (list, tuple)):
            tables = [tables]  # one table
        if len(tables) != shape[0] or any(len(t) != shape[1] or any(len(r) != shape[2] for r in t) for t in tables):
            raise ValueError(f"seconds must be a {' x '.join(map(str, shape))} table (contexts x batch x block)")
        return [[[float(x) for x in row] for row in table] for table in tables]

    def cost(self, batch: int, block: int, context: int | None = None) -> float:
        """Seconds for one step of `batch` requests padded to `block` positions, after `context`
        cached positions (the longest row's; None: the first measured context)."""
        return max(self._interpolate(self.seconds, batch, block, context), 1e-9)

    def draft_cost(self, batch: int, block: int, context: int | None = None) -> float:
        """The drafter's share of cost(): one drafter pass over `block` positions."""
        return max(self._interpolate(self.draft_seconds, batch, block, context), 0.0)

    def verify_cost(self, batch: int, block: float, context: int | None = None) -> float:
        """The target's share of cost(); `block` may be fractional (see ragged_block)."""
        return max(self.cost(batch, block, context) - self.draft_cost(batch, block, context), 1e-9)

    def ragged_block(self, mean: float, width: int) -> float:
        """The dense block a ragged verify costs like: rows of `mean` positions on average, the widest `width`."""
        return mean + self.ragged_share * (width - mean)

    def _interpolate(self, tables, batch, block, context):
        (i0, i1, u), (j0, j1, v) = self._where("batch_sizes", batch), self._where("block_sizes", block)

        def lookup(table):
            row0 = table[i0][j0] + v * (table[i0][j1] - table[i0][j0])
            row1 = table[i1][j0] + v * (table[i1][j1] - table[i1][j0])
            return row0 + u * (row1 - row0)

        if context is None or len(self.contexts) == 1:
            return lookup(tables[0])
        i, j, w = self._where("contexts", context)
        low, high = lookup(tables[i]), lookup(tables[j])
        return low + w * (high - low) if w <= 1 else high + (w - 1) * max(0.0, high - low)

    def _where(self, grid: str, x) -> tuple[int, int, float]:
        """_bracket(getattr(self, grid), x), remembered: a policy asks ~15 costs a step at the same few points."""
        key = (grid, x)
        where = self._brackets.get(key)
        if where is None:
            if len(self._brackets) >= 4096:  # contexts grow without end: keep the memo small
                self._brackets.clear()
            where = self._brackets[key] = _bracket(getattr(self, grid), x)
        return where

    def table_ms(self) -> str:
        """The tables as text, milliseconds, one row per batch size, one table per context."""
        lines = []
        for context, table in zip(self.contexts, self.seconds):
            lines.append(f"context {context}: batch\\block " + " ".join(f"{b:>8}" for b in self.block_sizes))
            for n, row in zip(self.batch_sizes, table):
                lines.append(f"{n:>24} " + " ".join(f"{t * 1e3:8.1f}" for t in row))
        return "\n".join(lines)

    def save(self, path):
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> "CostModel":
        return cls(**json.loads(Path(path).read_text()))

    @classmethod
    @torch.inference_mode()
    def profile(cls, target, drafter, batch_sizes=(1, 2, 4, 8, 16), block_sizes=(1, 2, 4, 8, 16),
                contexts=PROFILE_CONTEXTS, repeats=3) -> "CostModel":
        """Time real engine steps: the fastest of `repeats` after one warm-up, per grid point and
        context (on a shared machine the fastest run is the step's own cost; a median of few runs
        was noise). The repeats go round the whole grid in turn, not one grid point after another:
        a slow spell of the machine then spoils one repeat of many points, not all repeats of a few.

        Each step mirrors Engine.draft + Engine.verify on the greedy path: for b > 1 the drafter
        reads b context features (the most a step can leave pending) plus the block, then the
        target's LM head (only the drafter's draft vocabulary when it has one, as the engine does
        by default) and argmax/confidence over the b - 1 drafts (timed apart: `draft_seconds`); then
        the target verifies the b positions with the drafter's feature layers, and verify_greedy. Every row sits at
        positions context..context+b-1 of a scratch cache (keys/values are zeros: attention costs
        the same whatever they hold). Python bookkeeping outside the models is not timed.
        Tables are not smoothed: real ones are not always monotone (bf16 on CPU: block 2 is
        cheaper than block 1 at long contexts, SDPA's q=1 path is slow). Contexts: prompts of
        chat (~100-300 tokens) to RAG (~700-1000) traffic, far enough apart that the slope between
        them is not timing noise. Cost: (repeats + 1) steps per grid point and context.
        """
        if drafter is None:
            block_sizes = (1,)
        batch_sizes, block_sizes, contexts = sorted(set(batch_sizes)), sorted(set(block_sizes)), sorted(set(contexts))
        slots, max_len = max(batch_sizes), max(contexts) + max(block_sizes)
        caches = (target.new_cache(slots, max_len), drafter.new_cache(slots, max_len) if drafter is not None else None)
        closures = [step for ctx in contexts for n in batch_sizes for b in block_sizes
                    for step in _scratch_step(target, drafter, caches, n, b, ctx)]
        times = iter(_fastest(closures, target.device, repeats))
        steps = [[[[next(times), next(times)] for b in block_sizes] for n in batch_sizes]
                 for ctx in contexts]  # [context][batch][block][draft, verify]
        seconds = [[[d + v for d, v in row] for row in table] for table in steps]
        draft_seconds = [[[d for d, _ in row] for row in table] for table in steps]
        return cls(batch_sizes, block_sizes, seconds, describe(target, drafter), contexts, draft_seconds)


def interleaved_times(calls: dict, repeats: int, device=None) -> dict:
    """{name: seconds of each of `repeats` calls}, going round all of `calls` in turn after a warm-up call
    of each (the first call of a shape allocates): a slow spell of a shared machine then spoils one
    round of many calls, not every call of a few. On a CUDA `device` each call is timed to its end."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(max(1, repeats)):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            call()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def _fastest(steps, device, repeats) -> list[float]:
    """Fastest seconds of each of `steps` over `repeats` interleaved rounds (`interleaved_times`)."""
    return [min(t) for t in interleaved_times(dict(enumerate(steps)), repeats, device).values()]


def describe(target, drafter) -> dict:
    """What a cost table was measured on; a saved table is reused only when this matches."""
    tc = target.config
    return {
        "target": f"{getattr(tc, 'model_type', '')} L{tc.num_layers} H{tc.hidden_size} V{tc.vocab_size}",
        "drafter": None if drafter is None else f"L{drafter.config.num_layers} {drafter.dtype}" + (
            "" if getattr(drafter, "draft_vocab", None) is None else f" draft vocab {len(drafter.draft_vocab)}"),
        "dtype": str(target.dtype), "device": str(target.device), "engine": COST_MODEL_VERSION,
    }


def _scratch_step(target, drafter, caches, batch, block, context):
    """Two closures running one greedy engine step of `batch` rows at `block`: the draft, the verify."""
    device = target.device
    tcache, dcache = caches
    slots = torch.arange(batch, device=device)
    feature_layers = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
    positions = (context + torch.arange(block, device=device)).expand(batch, block)
    block_ids = torch.full((batch, block), target.config.vocab_size - 1, device=device)
    num_draft = torch.full((batch,), block - 1, device=device)
    if block > 1:
        block_ids[:, 1:] = drafter.config.mask_token_id
        features = len(feature_layers) * target.config.hidden_size
        ctx = torch.zeros(batch, block, features, dtype=drafter.dtype, device=device)  # [batch, c = block, features]
        draft_pos = (context - block + torch.arange(2 * block, device=device)).expand(batch, 2 * block)
        block_end = torch.full((batch,), context + block, device=device)
        head = DraftHead(target.lm_head, getattr(drafter, "draft_vocab", None))

    def draft():
        if block > 1:  # Engine.draft, one denoising pass
            hidden = drafter(ctx, target.embed_tokens(block_ids), draft_pos, dcache, slots, context + block, block_end)
            scores = head.scores(hidden[:, 1:])
            head.ids(scores.argmax(dim=-1)), scores.softmax(dim=-1).amax(dim=-1)

    def verify():
        logits, _ = target(block_ids, positions, tcache, slots, context + block, feature_layers)
        verify_greedy(block_ids[:, 1:], logits, num_draft)

    return draft, verify


# ---- adaptive policy ------------------------------------------------------------------------


def expected_tokens(acceptance: list[float]) -> list[float]:
    """E(b) for b = 1..len(acceptance)+1 from conditional acceptance a_1..a_n (index b - 1)."""
    out, reach = [1.0], 1.0
    for a in acceptance:
        reach *= a
        out.append(out[-1] + reach)
    return out


def shrunk_acceptance(accepted, reached, toward: list[float], weight: float, chained: bool = False) -> list[float]:
    """Conditional acceptance per draft position, len(toward) positions.

    Observed counts are shrunk towards `toward` as if it were `weight` extra drafts at every
    position: (accepted_k + weight * toward_k) / (reached_k + weight). A position never reached
    takes the one before's estimate times toward's step between the two (toward_k / toward_k-1): a
    request better than `toward` at its last drafted position is taken to be as much better past it.
    With no drafts at all the result is `toward` itself (carrying the last estimate forward instead
    overrated later positions: docs/design.md).
    `chained`: past the first position, shrink towards the previous position's estimate instead
    (`toward` then only matters at position 1), and carry it forward where never reached (optimistic:
    a good pool tries a bigger block and so learns its later positions). Later positions are reached
    less and less often, so a fixed prior would weigh more there.
    """
    if not reached or reached[0] == 0:
        return list(toward)
    out = []
    for k, p in enumerate(toward):
        r = reached[k] if k < len(reached) else 0
        if chained and k:
            p = out[-1]
        if r > 0:
            out.append((accepted[k] + weight * p) / (r + weight))
        elif chained or toward[k - 1] <= 0:
            out.append(out[-1])
        else:
            out.append(min(out[-1] * (p / toward[k - 1]), 1.0))
    return out


class ConfidenceCalibration:
    """P(a draft is accepted | it was verified and reached, its confidence, its position), learned online.

    Counts per confidence bin, for greedy and sampled drafts apart (acceptance is an exact match for
    one, probability min(1, p/q) for the other), pooled over positions and shrunk towards the confidence
    itself (what a calibrated drafter would give) with `prior_weight` drafts; and per position group
    (draft 1, 2, ..., `positions` and later together), each shrunk towards its bin's pooled estimate
    with `prior_weight` drafts. Later drafts hold less often at the same confidence (pooled, the trim
    took position 2 and 3 drafts for better than they were: docs/design.md). A bin keeps at most `max_count` drafts' worth of counts, so it follows a
    changing workload. Plain lists: a step's handful of drafts costs less in Python than in tensor ops
    (this runs every step).
    """

    def __init__(self, num_bins=20, prior_weight=8.0, max_count=4096.0, positions=3):
        self.num_bins, self.prior_weight, self.max_count, self.positions = num_bins, prior_weight, max_count, positions
        self.centers = [(i + 0.5) / num_bins for i in range(num_bins)] * 2  # [greedy bins, sampled bins]
        self.reached = [0.0] * (2 * num_bins)
        self.accepted = [0.0] * (2 * num_bins)
        self._table = list(self.centers)
        # by position group g: index g * 2 * num_bins + bin (bin as in `bin`, sampled ones after greedy)
        self.reached_at = [0.0] * (positions * 2 * num_bins)
        self.accepted_at = [0.0] * (positions * 2 * num_bins)
        self._table_at = self.centers * positions

    def bin(self, confidence: float, sampled: bool) -> int:
        return min(max(int(confidence * self.num_bins), 0), self.num_bins - 1) + (self.num_bins if sampled else 0)

    def table(self) -> list[float]:
        """Acceptance per bin (greedy bins, then sampled), pooled over positions."""
        return self._table

    def acceptance(self, confidence: list[float], sampled: bool) -> list[float]:
        """Calibrated acceptance of one row's drafts (draft 1 first), from their confidences."""
        return [self.acceptance_at(c, k, sampled) for k, c in enumerate(confidence)]

    def acceptance_at(self, confidence: float, k: int, sampled: bool = False) -> float:
        """Calibrated acceptance of a draft at position k + 1 (a token tree's node at depth k + 1: its
        probability is its confidence, as the chain's first choice's is)."""
        return self._table_at[min(k, self.positions - 1) * 2 * self.num_bins + self.bin(confidence, sampled)]

    def observe(self, confidence: list[float], sampled: bool, num_verified: int, num_accepted: int):
        """One row: its first num_verified drafts (confidences `confidence[:num_verified]`) were
        verified and the first num_accepted of them held."""
        for k in range(min(num_accepted + 1, num_verified)):
            self.observe_one(confidence[k], k, sampled, k < num_accepted)

    def observe_one(self, confidence: float, k: int, sampled: bool, held: bool):
        """One verified draft at position k + 1 (or a tree node at depth k + 1) that was reached."""
        size, w = 2 * self.num_bins, self.prior_weight
        b = self.bin(confidence, sampled)
        g = min(k, self.positions - 1) * size + b
        self._count(self.reached, self.accepted, b, held)
        self._count(self.reached_at, self.accepted_at, g, held)
        self._table[b] = (self.accepted[b] + w * self.centers[b]) / (self.reached[b] + w)
        for i in range(b, len(self._table_at), size):  # every position group of this bin: its prior moved
            self._table_at[i] = (self.accepted_at[i] + w * self._table[b]) / (self.reached_at[i] + w)

    def _count(self, reached, accepted, i, held):
        reached[i] += 1
        accepted[i] += held
        if reached[i] > self.max_count:
            scale = self.max_count / reached[i]
            reached[i] *= scale
            accepted[i] *= scale


class SuffixCalibration:
    """P(a suffix draft is accepted | the drafts before it were), learned online per match-length bin and
    per bin of the draft's frequency among the matches (engine.suffix.Proposal.counts / num_matches), greedy
    and sampled drafts apart. Each bin starts at a prior that grows with the match length and the frequency,
    worth `prior_weight` drafts, and keeps at most `max_count` drafts' worth of counts."""

    MATCH_BINS = (1, 2, 4, 8, 16)  # lower bounds of the match-length bins
    MATCH_PRIOR = (0.35, 0.5, 0.7, 0.85, 0.92)  # prior acceptance of a draft every match continued with

    def __init__(self, freq_bins=4, prior_weight=2.0, max_count=4096.0):
        self.freq_bins, self.prior_weight, self.max_count = freq_bins, prior_weight, max_count
        size = 2 * len(self.MATCH_BINS) * freq_bins
        self.prior = [self.MATCH_PRIOR[(i // freq_bins) % len(self.MATCH_BINS)] * ((i % freq_bins) + 1) / freq_bins
                      for i in range(size)]
        self.reached, self.accepted = [0.0] * size, [0.0] * size

    def bin(self, match_length: int, frequency: float, sampled: bool) -> int:
        m = bisect.bisect_right(self.MATCH_BINS, match_length) - 1
        f = min(max(int(frequency * self.freq_bins - 1e-9), 0), self.freq_bins - 1)
        return ((len(self.MATCH_BINS) if sampled else 0) + max(m, 0)) * self.freq_bins + f

    def _bins(self, proposal, sampled) -> list[int]:
        return [self.bin(proposal.match_length, c / proposal.num_matches, sampled) for c in proposal.counts]

    def acceptance(self, proposal, sampled: bool) -> list[float]:
        """Conditional acceptance of each of the proposal's drafts."""
        w = self.prior_weight
        return [(self.accepted[b] + w * self.prior[b]) / (self.reached[b] + w) for b in self._bins(proposal, sampled)]

    def observe(self, proposal, sampled: bool, num_verified: int, num_accepted: int):
        for k, b in enumerate(self._bins(proposal, sampled)[: min(num_accepted + 1, num_verified)]):
            self.reached[b] += 1
            self.accepted[b] += k < num_accepted
            if self.reached[b] > self.max_count:
                scale = self.max_count / self.reached[b]
                self.reached[b] *= scale
                self.accepted[b] *= scale


@dataclass
class ExpectedAcceptance:
    """Per draft position, how often a request's drafts were reached and accepted, counting the drafts
    it did not verify (trimmed by `trim`) at their calibrated expectations: an estimate of what
    verifying everything drafted would have given, which `choose` needs and the verified counts (biased
    towards confident drafts once trimming runs) are not."""

    reached_per_pos: list[float] = field(default_factory=list)
    accepted_per_pos: list[float] = field(default_factory=list)

    def add(self, reached: list[float], accepted: list[float]):
        grow = len(reached) - len(self.reached_per_pos)
        if grow > 0:
            self.reached_per_pos += [0.0] * grow
            self.accepted_per_pos += [0.0] * grow
        for k, (n, a) in enumerate(zip(reached, accepted)):
            self.reached_per_pos[k] += n
            self.accepted_per_pos[k] += a


def drafted_outcome(acceptance: list[float], num_verified: int, num_accepted: int) -> tuple[list[float], list[float]]:
    """(reached, accepted) per drafted position of one block: observed where verified; past the
    verified drafts, if all of them held, the calibrated expectation (a draft is reached with the
    product of the acceptance of the unverified drafts before it)."""
    reached = [1.0 if k <= num_accepted else 0.0 for k in range(num_verified)]
    accepted = [1.0 if k < num_accepted else 0.0 for k in range(num_verified)]
    reach = 1.0 if num_accepted == num_verified else 0.0
    for a in acceptance[num_verified:]:
        reached.append(reach)
        reach *= a
        accepted.append(reach)
    return reached, accepted


@dataclass
class _Tracked:
    """What the adaptive policy keeps of a request while it lives (a weak reference: never keeps it alive)."""

    ref: weakref.ref
    expected: ExpectedAcceptance | None = None
    pooled: tuple[list, list] = ([], [])  # its (reached, accepted) counts already added to the pool


MAX_EXPLORE_BACKOFF = 16
CALIBRATION_WEIGHT = 32  # steps: how long a block's real / profiled cost ratio remembers
CALIBRATION_BOUNDS = (0.25, 4.0)  # one step's ratio is clipped to these (a stall, a page fault)
CALIBRATION_PRIOR_STEPS = 4  # a block's first ratio is averaged with the others' mean as if that were 4 steps


class AdaptiveBlockPolicy(BlockPolicy):
    """Maximise expected committed tokens per second, before drafting (`choose`) and after (`trim`).

    choose: the draft block b maximising sum_i E_i(min(b, cap_i)) / cost(batch, b) for the step. One b
    for the whole step, each request getting min(b, cap_i): a padded drafter pass costs as much as its
    largest block, and E_i is non-decreasing in b. The step's real block is max_i min(b, cap_i) and
    that is what it is costed at (drafter pass and verifying all of it: a lower bound on what drafting
    b is worth, since `trim` only ever raises the step's rate).

    trim: with the drafts in hand, each draft's calibrated acceptance a_ik (ConfidenceCalibration of
    its confidence) makes r_ik = a_i1 ... a_ik the chance that request i's drafts 1..k all hold. The
    target runs a ragged batch (its linear layers on real rows only, attention on the padded layout), so
    verifying m drafts in all, the widest row at w positions, costs about the dense verify at
    CostModel.ragged_block(1 + m / batch, w). For each w the best m drafts are the m largest r_ik among
    the first w - 1 of each row (r falls along a row, so they are a prefix of each row), and (w, m) is the
    pair maximising (batch + their sum) / (drafter pass + verify cost). The drafter pass is spent either
    way; counting it keeps m at the step's real rate. With the drafts in hand this verifies as far as they
    are likely to hold, step by step: what no fixed block can do. Where only real positions cost
    (ragged_share 0) it verifies the likely drafts of any request and skips the rest; on a CPU a ragged
    verify costs about what its widest row's dense one does (share ~1), and cutting rows short below
    the widest saves nothing: the trim then picks one width for the step.

    Acceptance estimates for choose (conditional, per draft position):
    - request i: what it drafted, counted as ExpectedAcceptance (verified drafts as observed, trimmed
      ones at their calibrated expectation), shrunk towards the pool with weight `request_drafts`: a
      new request starts at the pool's estimate and its own data dominates after ~request_drafts
      drafts (32, not 8: a few unlucky drafts must not send a request to block 1). A request the
      policy has seen no verified draft of (a caller that never reports them) is read from its SpecStats.
    - engine-wide pool: every request's drafts, shrunk with weight `min_drafts` towards `prior` at
      position 1 (a float, or one value per position: then the first) and towards its own estimate of
      the position before at later ones (`shrunk_acceptance(chained=True)`); it forgets old data by
      keeping at most `pool_drafts` drafts' worth of counts (so it follows a changing workload).
    Step costs are the CostModel's, calibrated online: the engine reports each decode step's wall
    time (`observe_step`), and the policy keeps, per drafted block size, a running mean of real /
    profiled seconds (CALIBRATION_WEIGHT steps' memory); a block never run borrows the mean of the
    others, and its first steps are averaged with that mean (CALIBRATION_PRIOR_STEPS): one slow first
    step must not make a block look too dear to be chosen again. The profile times the models alone,
    so it misses what a real step adds; the calibration learns it.
    A drafting step that follows block-1 steps is not calibrated: the drafter first takes in the
    features those steps left it (`caught_up` > 2 x block), a cost of the block-1 steps that drafting
    now or later pays the same. Counted, the rarer drafting was, the dearer it looked, and under load
    the policy stayed at block 1.
    Every step also costs what the engine's caller spends between steps (`observe_gap`: a server streams
    each step's tokens to its clients), once per step whatever the block: a running mean of it is added to
    every step's cost, which favours blocks that need fewer steps (a small share on a CPU, a larger one on
    a GPU, where a step takes milliseconds). The measurements behind these rules are in docs/design.md.
    Exploration rule: block 1 yields no acceptance data, so after `explore_every` steps in a row
    where the policy chose block 1 although some request could draft, the next step probes with
    the smallest block > 1 in `block_sizes`; while probes find nothing worth drafting the interval
    doubles (up to MAX_EXPLORE_BACKOFF x explore_every), and a step that drafts resets it.
    """

    def __init__(self, cost_model: CostModel, block_sizes=(1, 2, 4, 8, 16), prior=0.5, min_drafts=8,
                 explore_every=16, pool_drafts=512, request_drafts=32, trim=True):
        self.cost_model = cost_model
        self.block_sizes = sorted(set(block_sizes) | {1})
        self.prior = prior
        self.min_drafts = min_drafts
        self.explore_every = explore_every
        self.pool_drafts = pool_drafts
        self.request_drafts = request_drafts
        self.trims = trim
        self.calibration = ConfidenceCalibration()
        self.pool_reached: list[float] = []  # per draft position, decayed counts over all requests
        self.pool_accepted: list[float] = []
        self._tracked: dict[int, _Tracked] = {}  # id(request) -> what the policy keeps of it, while it lives
        self._steps_at_1 = 0
        self._explore_interval = explore_every
        self.last_choice: tuple[int, float] = (1, 0.0)  # last step: (block, best expected tokens/s)
        self.cost_ratio: dict[int, tuple[float, int]] = {}  # block -> (mean real / profiled seconds, steps seen)
        self.overhead = 0.0  # seconds per step spent outside the engine (running mean of observe_gap)
        self._gaps_seen = 0
        self._last_step_seconds = 0.0

    @classmethod
    def profile(cls, target, drafter, max_block_size=16, max_batch_size=16, path=None, prior=0.5, min_drafts=8,
                explore_every=16, pool_drafts=512, request_drafts=32, trim=True, **profile_kw) -> "AdaptiveBlockPolicy":
        """Profile a CostModel on these models and return the policy over its block sizes.

        Grids: 1, 2, 4, ... up to max_block_size / max_batch_size (or `block_sizes=`/`batch_sizes=`), and
        every block up to EVERY_BLOCK_UP_TO: the policy drafts only blocks of its grid (with powers of two
        alone, a server capped at block 4 could not draft block 3, often the best). With `path`, a table saved there for the
        same models and grids is reused, else the new one is saved there. Other keywords go to
        CostModel.profile (contexts, repeats).
        """
        powers = lambda n: sorted({1 << i for i in range(n.bit_length()) if 1 << i <= n} | {n})
        batches = sorted(set(profile_kw.pop("batch_sizes", powers(max_batch_size))))
        every = range(1, min(max_block_size, EVERY_BLOCK_UP_TO) + 1)
        blocks = sorted(set(profile_kw.pop("block_sizes", powers(max_block_size) + list(every))))
        cost_model = None
        if path is not None and Path(path).exists():
            try:
                saved = CostModel.load(path)
            except (TypeError, ValueError):  # an older format: profile again
                saved = None
            contexts = sorted(set(profile_kw.get("contexts", PROFILE_CONTEXTS)))
            if saved is not None and all(saved.meta.get(k) == v for k, v in describe(target, drafter).items()) \
                    and (saved.batch_sizes, saved.block_sizes, saved.contexts) == \
                    (batches, [1] if drafter is None else blocks, contexts):
                cost_model = saved
        if cost_model is None:
            cost_model = CostModel.profile(target, drafter, batches, blocks, **profile_kw)
            if path is not None:
                cost_model.save(path)
        return cls(cost_model, blocks, prior, min_drafts, explore_every, pool_drafts, request_drafts, trim)

    def pooled_acceptance(self, n: int) -> list[float]:
        """The engine-wide estimate at draft positions 1..n (what a new request starts from)."""
        prior = self.prior if isinstance(self.prior, (list, tuple)) else [self.prior]
        base = [prior[min(k, len(prior) - 1)] for k in range(n)]
        return shrunk_acceptance(self.pool_accepted, self.pool_reached, base, self.min_drafts, chained=True)

    def evidence(self, request):
        """A request's per-position counts: its ExpectedAcceptance once a verified draft was reported, else its SpecStats."""
        tracked = self._track(request, create=False)
        if tracked is not None and tracked.expected is not None:
            return tracked.expected
        return request.stats.by_proposer.get("dflash", request.stats)

    def _track(self, request, create=True) -> "_Tracked | None":
        tracked = self._tracked.get(id(request))
        if tracked is not None and tracked.ref() is not request:  # an id of a request that is gone, reused
            tracked = None
        if tracked is None and create:
            tracked = self._tracked[id(request)] = _Tracked(weakref.ref(request))
        return tracked

    def acceptance(self, request, n: int, pooled: list[float] | None = None) -> list[float]:
        """Request estimate at draft positions 1..n (a request, or counts with reached/accepted_per_pos)."""
        counts = self.evidence(request) if hasattr(request, "stats") else request
        pooled = self.pooled_acceptance(n) if pooled is None else pooled[:n]
        return shrunk_acceptance(counts.accepted_per_pos, counts.reached_per_pos, pooled, self.request_drafts)

    def choose(self, requests, caps):
        if not caps:
            return []
        self._update_pool(requests)
        max_cap = max(caps)
        if max_cap == 1:
            return [1] * len(caps)
        # candidates up to the first block >= every cap: bigger ones give the same sizes
        candidates = self.block_sizes[: bisect.bisect_left(self.block_sizes, max_cap) + 1]
        best, best_rate = 1, -1.0
        for b, (tokens, seconds) in self.outlook(requests, caps, candidates).items():
            if tokens / seconds > best_rate:
                best, best_rate = b, tokens / seconds
        if best > 1:
            self._steps_at_1, self._explore_interval = 0, self.explore_every
        else:
            self._steps_at_1 += 1
            if self._steps_at_1 >= self._explore_interval:  # probe; back off while probes find nothing
                best, self._steps_at_1 = next((b for b in self.block_sizes if b > 1), 1), 0
                self._explore_interval = min(2 * self._explore_interval, MAX_EXPLORE_BACKOFF * self.explore_every)
        self.last_choice = (best, best_rate)
        return [min(best, cap) for cap in caps]

    def outlook(self, requests, caps, blocks) -> dict[int, tuple[float, float]]:
        """Per block b of `blocks`: the step's expected committed tokens (request i verifying min(b, cap_i))
        and the seconds it is expected to take."""
        context = self._context(requests)
        pooled = self.pooled_acceptance(max(caps) - 1)
        expected = [expected_tokens(self.acceptance(r, cap - 1, pooled)) for r, cap in zip(requests, caps)]
        out = {}
        for b in blocks:
            sizes = [min(b, cap) for cap in caps]
            out[b] = (sum(e[s - 1] for e, s in zip(expected, sizes)), self.step_cost(len(caps), max(sizes), context))
        return out

    def suffix_widths(self, requests, caps, proposals):
        """Per request, the suffix drafts to verify (0: draft with DFlash), chosen for the whole step. The
        verify runs on the padded layout, so one row's wide suffix draft makes the whole batch's verify about
        that wide (on a CPU, CostModel.ragged_share ~1). For each bound w on the widths, a request verifies its
        proposal's first min(w, n_i) drafts where they are expected to commit more than DFlash's block would
        (the block `choose` picks for the whole batch), and the step is costed: the drafter pass over the
        other rows, the verify at ragged_block(mean, widest row), the time per step outside the engine. The
        bound with the most expected tokens per second wins; w = 0 is the step without suffix drafts."""
        batch, context = len(requests), self._context(requests)
        suffix = [None if p is None or not p.token_ids or cap < 2 else
                  expected_tokens(self.suffix_calibration.acceptance(p, r.params.temperature > 0)[: cap - 1])
                  for r, cap, p in zip(requests, caps, proposals)]
        longest = max((len(s) - 1 for s in suffix if s is not None), default=0)
        if longest == 0:
            return [0] * batch
        candidates = self.block_sizes[: bisect.bisect_left(self.block_sizes, max(caps)) + 1]
        outlook = self.outlook(requests, caps, candidates)
        block = max(candidates, key=lambda b: outlook[b][0] / outlook[b][1])
        pooled = self.pooled_acceptance(max(caps) - 1)
        dflash_sizes = [min(block, cap) for cap in caps]
        dflash = [expected_tokens(self.acceptance(r, s - 1, pooled))[-1] for r, s in zip(requests, dflash_sizes)]
        cost = self.cost_model
        best, best_rate = [0] * batch, -1.0
        for bound in range(longest + 1):
            widths = [0 if s is None or bound == 0 else min(bound, len(s) - 1) for s in suffix]
            widths = [w if w and suffix[i][w] > dflash[i] else 0 for i, w in enumerate(widths)]
            tokens = sum(suffix[i][w] if w else dflash[i] for i, w in enumerate(widths))
            sizes = [w + 1 if w else s for w, s in zip(widths, dflash_sizes)]
            drafted = [s for w, s in zip(widths, dflash_sizes) if not w]
            draft = cost.draft_cost(len(drafted), max(drafted), context) if drafted and max(drafted) > 1 else 0.0
            verify = cost.verify_cost(batch, cost.ragged_block(sum(sizes) / batch, max(sizes)), context)
            seconds = (draft + verify) * self._cost_ratio(max(drafted, default=1)) + self.overhead
            if tokens / seconds > best_rate:
                best, best_rate = widths, tokens / seconds
        return best

    def trim(self, requests, block_sizes, confidence, context, trees=None):
        batch, block = len(requests), max(block_sizes)
        if not self.trims or block == 1:
            return list(block_sizes)
        candidates = []  # (P(drafts 1..k+1 of row i all hold), k, i): a row's appear in order, so any top-m is a prefix of it
        for i, (r, row) in enumerate(zip(requests, confidence[:, : block - 1].tolist())):
            if trees is not None and trees[i] is not None:
                candidates += [(reach, k, i) for k, reach in enumerate(self.tree_reach(trees[i]))]
                continue
            reach = 1.0
            for k, a in enumerate(self.calibration.acceptance(row[: block_sizes[i] - 1], r.params.temperature > 0)):
                reach *= a
                candidates.append((reach, k, i))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep a row's earlier drafts first
        cost = self.cost_model
        fixed = cost.draft_cost(batch, block, context) + self.overhead  # paid whatever is verified
        verify = [cost.verify_cost(batch, b, context) for b in range(1, block + 1)]  # piecewise linear between
        best, best_rate = (1, 0), batch / (fixed + verify[0])
        for width in range(2, block + 1):  # the widest row verifies `width` positions (or fewer)
            # the dense block costed, minus 1 (an index into verify), is linear in m: x0 + m * slope
            x0 = cost.ragged_block(1, width) - 1
            slope = (cost.ragged_block(2, width) - 1 - x0) / batch
            gained, m = 0.0, 0
            for reach, k, _ in candidates:
                if k >= width - 1:
                    continue
                gained, m = gained + reach, m + 1
                x = x0 + m * slope
                whole = min(int(x), block - 2)
                seconds = fixed + verify[whole] + (x - whole) * (verify[whole + 1] - verify[whole])
                if (batch + gained) / seconds > best_rate:
                    best, best_rate = (width, m), (batch + gained) / seconds
        sizes, (width, m) = [1] * batch, best
        for _, _, i in [c for c in candidates if c[1] < width - 1][:m]:
            sizes[i] += 1
        return sizes

    def tree_reach(self, tree) -> list[float]:
        """P(a tree's node is accepted) for each node (best first), from its path's calibrated acceptance;
        never rising along the order, so that the trim's top-m is a prefix of the tree's nodes."""
        reach, out = [], []
        for prob, parent, depth in zip(tree.probs, tree.parents, tree.depths):
            reach.append((reach[parent - 1] if parent else 1.0) * self.calibration.acceptance_at(prob, depth - 1))
            out.append(min(reach[-1], out[-1]) if out else reach[-1])
        return out

    def observe_verified(self, requests, block_sizes, verified_sizes, confidence, num_accepted, trees=None):
        block = max(block_sizes)
        if block == 1:
            return
        for i, (r, b, v, a, row) in enumerate(zip(requests, block_sizes, verified_sizes, num_accepted,
                                                  confidence[:, : block - 1].tolist())):
            sampled, tracked = r.params.temperature > 0, self._track(r)
            if tracked.expected is None:
                tracked.expected = ExpectedAcceptance()
            if trees is not None and trees[i] is not None:
                # a tree's "positions" are its nodes best first: node k's reach over node k - 1's, so that
                # choose's expected tokens for block b are 1 + the reach of the tree's first b - 1 nodes
                tree, tested = trees[i]
                for j, held in tested:
                    self.calibration.observe_one(tree.probs[j], tree.depths[j] - 1, sampled, held)
                reach = self.tree_reach(tree)
                tracked.expected.add([1.0] + reach[:-1], reach)
                continue
            self.calibration.observe(row, sampled, v - 1, a)
            tracked.expected.add(*drafted_outcome(self.calibration.acceptance(row[: b - 1], sampled), v - 1, a))

    def step_cost(self, batch: int, block: int, context: int | None) -> float:
        """Seconds the policy expects a step to take: the profiled cost times the block's calibration, plus
        the time per step outside the engine."""
        return self.cost_model.cost(batch, block, context) * self._cost_ratio(block) + self.overhead

    def _cost_ratio(self, block: int) -> float:
        if block in self.cost_ratio:
            return self.cost_ratio[block][0]
        if not self.cost_ratio:
            return 1.0
        return sum(r for r, _ in self.cost_ratio.values()) / len(self.cost_ratio)  # statistics.mean: 10x slower

    def observe_step(self, batch: int, block: int, context: int, seconds: float, verified: float | None = None,
                     caught_up: int = 0):
        self._last_step_seconds = seconds
        if caught_up > 2 * block:  # a catch-up after block-1 steps: their deferred cost, not this block's
            return
        profiled = self.cost_model.draft_cost(batch, block, context) + \
            self.cost_model.verify_cost(batch, block if verified is None else verified, context)
        ratio = min(max(seconds / profiled, CALIBRATION_BOUNDS[0]), CALIBRATION_BOUNDS[1])
        mean, n = self.cost_ratio.get(block) or (self._cost_ratio(block), CALIBRATION_PRIOR_STEPS)
        n = min(n + 1, CALIBRATION_WEIGHT)
        self.cost_ratio[block] = (mean + (ratio - mean) / n, n)

    def observe_gap(self, seconds: float):
        seconds = min(seconds, self._last_step_seconds)  # a stall of the host or the caller is not the rule
        self._gaps_seen = min(self._gaps_seen + 1, CALIBRATION_WEIGHT)
        self.overhead += (seconds - self.overhead) / self._gaps_seen

    @staticmethod
    def _context(requests) -> int | None:
        contexts = [getattr(r, "num_cached", None) for r in requests]
        return None if None in contexts else max(contexts)  # the longest row sets attention's width

    def _update_pool(self, requests):
        """Add each request's new drafts (since it was last in a step) to the pool; forget gone requests."""
        self._tracked = {k: t for k, t in self._tracked.items() if t.ref() is not None}
        for r in requests:
            s, tracked = self.evidence(r), self._track(r)
            grow = len(s.reached_per_pos) - len(self.pool_reached)
            if grow > 0:
                self.pool_reached += [0.0] * grow
                self.pool_accepted += [0.0] * grow
            old_reached, old_accepted = tracked.pooled
            for k, (n, a) in enumerate(zip(s.reached_per_pos, s.accepted_per_pos)):
                self.pool_reached[k] += n - (old_reached[k] if k < len(old_reached) else 0)
                self.pool_accepted[k] += a - (old_accepted[k] if k < len(old_accepted) else 0)
            tracked.pooled = (list(s.reached_per_pos), list(s.accepted_per_pos))
        if self.pool_reached and self.pool_reached[0] > self.pool_drafts:
            scale = self.pool_drafts / self.pool_reached[0]
            self.pool_reached = [n * scale for n in self.pool_reached]
            self.pool_accepted = [a * scale for a in self.pool_accepted]
