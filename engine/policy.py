"""Block-size policies: how many positions each request verifies in the next step.

A policy sees the running requests (each one's `.stats`, a SpecStats) and each one's cap (the
largest block it may verify: its own block size and remaining budget) and returns one block size
per request. Block b = positions verified in a step: the last committed token + b - 1 drafts; b = 1
is a plain autoregressive step with no drafter call.

- FixedBlockPolicy: the same block for every request, clipped to its cap.
- AdaptiveBlockPolicy: maximises expected committed tokens per second. It owns per-request
  acceptance estimates (read from the requests' stats) and an engine-wide pooled estimate that new
  requests start from; it knows the hardware only through a CostModel.
- CostModel: measured seconds per engine step by (batch size, block size). `CostModel.profile` is
  the only code here that touches models: it times real forwards through the engine's model
  interface (TargetModel, Drafter) on scratch KV caches.

Expected tokens: with conditional acceptance a_k = P(draft k accepted | drafts 1..k-1 accepted),
a step with block b commits E(b) = 1 + sum_{k=1}^{b-1} prod_{j<=k} a_j tokens on average.
"""

import bisect
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.drafter import draft_logits, reduced_head
from engine.sampling import verify_greedy


class BlockPolicy:
    def choose(self, requests, caps: list[int]) -> list[int]:
        raise NotImplementedError

    def observe_step(self, batch: int, block: int, context: int, seconds: float):
        """The engine's wall time of a decode step it ran with this policy's choice (ignored by default)."""


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
COST_MODEL_VERSION = 4

PROFILE_CONTEXTS = (32, 256, 1024)  # cached positions per row: chat (~100-300) to RAG (~700-1000) prompts


@dataclass
class CostModel:
    """Seconds per engine step (drafter pass + target verify) on a (batch size, block size) grid,
    measured at one or more context lengths.

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

    def __post_init__(self):
        self.batch_sizes, self.block_sizes = [int(b) for b in self.batch_sizes], [int(b) for b in self.block_sizes]
        self.contexts = [int(c) for c in self.contexts]
        for name in ("batch_sizes", "block_sizes", "contexts"):
            values = getattr(self, name)
            if not values or values != sorted(set(values)):
                raise ValueError(f"{name} must be strictly ascending and not empty")
        if self.seconds and self.seconds[0] and not isinstance(self.seconds[0][0], (list, tuple)):
            self.seconds = [self.seconds]  # one table
        shape = (len(self.contexts), len(self.batch_sizes), len(self.block_sizes))
        if len(self.seconds) != shape[0] or any(len(t) != shape[1] or any(len(r) != shape[2] for r in t)
                                                for t in self.seconds):
            raise ValueError(f"seconds must be a {' x '.join(map(str, shape))} table (contexts x batch x block)")
        self.seconds = [[[float(x) for x in row] for row in table] for table in self.seconds]

    def cost(self, batch: int, block: int, context: int | None = None) -> float:
        """Seconds for one step of `batch` requests padded to `block` positions, after `context`
        cached positions (the longest row's; None: the first measured context)."""
        lookup = lambda k: self._lookup(self.seconds[k], batch, block)
        if context is None or len(self.contexts) == 1:
            return max(lookup(0), 1e-9)
        i, j, w = _bracket(self.contexts, context)
        low, high = lookup(i), lookup(j)
        seconds = low + w * (high - low) if w <= 1 else high + (w - 1) * max(0.0, high - low)
        return max(seconds, 1e-9)

    def _lookup(self, table, batch, block):
        i0, i1, u = _bracket(self.batch_sizes, batch)
        j0, j1, v = _bracket(self.block_sizes, block)
        row0 = table[i0][j0] + v * (table[i0][j1] - table[i0][j0])
        row1 = table[i1][j0] + v * (table[i1][j1] - table[i1][j0])
        return row0 + u * (row1 - row0)

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
        was noise).

        Each step mirrors Engine.draft + Engine.verify on the greedy path: for b > 1 the drafter
        reads b context features (the most a step can leave pending) plus the block, then the
        target's LM head (only the drafter's draft vocabulary when it has one, as the engine does
        by default) and argmax/confidence over the b - 1 drafts; then the target verifies the
        b positions with the drafter's feature layers, and verify_greedy. Every row sits at
        positions context..context+b-1 of a scratch cache (keys/values are zeros: attention costs
        the same whatever they hold). Python bookkeeping outside the models is not timed.
        Tables are not smoothed: real ones are not always monotone (bf16 on CPU: block 2 is
        cheaper than block 1 at long contexts, SDPA's q=1 path is slow). Contexts: prompts of
        chat (~100-300 tokens) to RAG (~700-1000) traffic; two contexts 224 positions apart gave
        a slope lost in timing noise (long prompts then costed wrong). Cost: (repeats + 1) steps
        per grid point and context; the default 5 x 5 grids at 3 contexts on SmolLM2-135M in
        bf16 take ~25 s on one CPU core (a smaller grid or repeats=1 for less).
        """
        if drafter is None:
            block_sizes = (1,)
        batch_sizes, block_sizes, contexts = sorted(set(batch_sizes)), sorted(set(block_sizes)), sorted(set(contexts))
        slots, max_len = max(batch_sizes), max(contexts) + max(block_sizes)
        caches = (target.new_cache(slots, max_len), drafter.new_cache(slots, max_len) if drafter is not None else None)
        seconds = [[[_time_step(target, drafter, caches, n, b, ctx, repeats) for b in block_sizes]
                    for n in batch_sizes] for ctx in contexts]
        return cls(batch_sizes, block_sizes, seconds, describe(target, drafter), contexts)


def _time_step(target, drafter, caches, batch, block, context, repeats) -> float:
    """Fastest seconds of one scratch step over `repeats`, after a warm-up (the first call of a shape allocates)."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    step = _scratch_step(target, drafter, caches, batch, block, context)
    step()
    times = []
    for _ in range(max(1, repeats)):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


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
    """A closure running one greedy engine step (draft + verify) of `batch` rows at `block`."""
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
        draft_head, draft_vocab = reduced_head(target.lm_head, getattr(drafter, "draft_vocab", None))

    def step():
        if block > 1:  # Engine.draft, one denoising pass
            hidden = drafter(ctx, target.embed_tokens(block_ids), draft_pos, dcache, slots, context + block, block_end)
            logits = draft_logits(hidden[:, 1:].to(target.dtype), target.lm_head, draft_head, draft_vocab)
            logits.argmax(dim=-1), logits.softmax(dim=-1).amax(dim=-1)
        logits, _ = target(block_ids, positions, tcache, slots, context + block, feature_layers)  # Engine.verify
        verify_greedy(block_ids[:, 1:], logits, num_draft)

    return step


# ---- adaptive policy ------------------------------------------------------------------------


def expected_tokens(acceptance: list[float]) -> list[float]:
    """E(b) for b = 1..len(acceptance)+1 from conditional acceptance a_1..a_n (index b - 1)."""
    out, reach = [1.0], 1.0
    for a in acceptance:
        reach *= a
        out.append(out[-1] + reach)
    return out


def shrunk_acceptance(accepted, reached, toward: list[float], weight: float) -> list[float]:
    """Conditional acceptance per draft position, len(toward) positions.

    Observed counts are shrunk towards `toward` as if it were `weight` extra drafts at every
    position: (accepted_k + weight * toward_k) / (reached_k + weight). Positions never reached
    carry the previous estimate forward (optimistic: a good request tries a bigger block and so
    learns its later positions). With no drafts at all the result is `toward` itself.
    """
    if not reached or reached[0] == 0:
        return list(toward)
    out = []
    for k, p in enumerate(toward):
        r = reached[k] if k < len(reached) else 0
        out.append((accepted[k] + weight * p) / (r + weight) if r > 0 else out[-1])
    return out


MAX_EXPLORE_BACKOFF = 16
CALIBRATION_WEIGHT = 32  # steps: how long a block's real / profiled cost ratio remembers
CALIBRATION_BOUNDS = (0.25, 4.0)  # one step's ratio is clipped to these (a stall, a page fault)


class AdaptiveBlockPolicy(BlockPolicy):
    """Pick the block b that maximises sum_i E_i(min(b, cap_i)) / cost(batch, b) for the step.

    One b for the whole step, each request getting min(b, cap_i): a padded batch costs as much as
    its largest block, and E_i is non-decreasing in b, so a request never gains by verifying less
    than the step's block (per-request sizes cannot beat this). The step's real block is
    max_i min(b, cap_i) and that is what it is costed at.

    Acceptance estimates (conditional, per draft position):
    - engine-wide pool: the drafts of every request this policy has seen, shrunk towards `prior`
      (a float, or one value per position) with weight `min_drafts`; it forgets old data by
      keeping at most `pool_drafts` drafts' worth of counts (so it follows a changing workload).
    - request i: its own SpecStats counts shrunk towards the pool with weight `request_drafts`: a
      new request starts at the pool's estimate and its own data dominates after ~request_drafts
      drafts. 32, not 8: at a pooled acceptance of ~0.2, 8 unlucky drafts sent a third of the steps
      of one-at-a-time traffic to block 1, 1-2% below the best fixed block; with 32 it is at or above
      it (scripts/policy_ab.py).
    Step costs are the CostModel's, calibrated online: the engine reports each decode step's wall
    time (`observe_step`), and the policy keeps, per block size, a running mean of real / profiled
    seconds (CALIBRATION_WEIGHT steps' memory); a block never run borrows the mean of the others. The
    profile times the models alone, so it missed what a real step adds (on an AVX2 host in float32,
    batch 1, chat: block 1 ran 11% over its profile, blocks 2 and 4 5% and 12% under it, and the
    policy chose block 1 too often: 0.97-0.98x the best fixed block in `dflash-serve bench`).
    Exploration rule: block 1 yields no acceptance data, so after `explore_every` steps in a row
    where the policy chose block 1 although some request could draft, the next step probes with
    the smallest block > 1 in `block_sizes`; while probes find nothing worth drafting the interval
    doubles (up to MAX_EXPLORE_BACKOFF x explore_every), and a step that drafts resets it.
    """

    def __init__(self, cost_model: CostModel, block_sizes=(1, 2, 4, 8, 16), prior=0.5, min_drafts=8,
                 explore_every=16, pool_drafts=512, request_drafts=32):
        self.cost_model = cost_model
        self.block_sizes = sorted(set(block_sizes) | {1})
        self.prior = prior
        self.min_drafts = min_drafts
        self.explore_every = explore_every
        self.pool_drafts = pool_drafts
        self.request_drafts = request_drafts
        self.pool_reached: list[float] = []  # per draft position, decayed counts over all requests
        self.pool_accepted: list[float] = []
        self._seen: dict[int, tuple] = {}  # id(stats) -> (stats, reached, accepted) at the last step
        self._steps_at_1 = 0
        self._explore_interval = explore_every
        self.last_choice: tuple[int, float] = (1, 0.0)  # last step: (block, best expected tokens/s)
        self.cost_ratio: dict[int, tuple[float, int]] = {}  # block -> (mean real / profiled seconds, steps seen)

    @classmethod
    def profile(cls, target, drafter, max_block_size=16, max_batch_size=16, path=None, prior=0.5, min_drafts=8,
                explore_every=16, pool_drafts=512, request_drafts=32, **profile_kw) -> "AdaptiveBlockPolicy":
        """Profile a CostModel on these models and return the policy over its block sizes.

        Grids: 1, 2, 4, ... up to max_block_size / max_batch_size (or `block_sizes=`/`batch_sizes=`).
        With `path`, a table saved there for the same models and grids is reused, else the new one
        is saved there. Other keywords go to CostModel.profile (contexts, repeats).
        """
        powers = lambda n: sorted({1 << i for i in range(n.bit_length()) if 1 << i <= n} | {n})
        batches = sorted(set(profile_kw.pop("batch_sizes", powers(max_batch_size))))
        blocks = sorted(set(profile_kw.pop("block_sizes", powers(max_block_size))))
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
        return cls(cost_model, blocks, prior, min_drafts, explore_every, pool_drafts, request_drafts)

    def pooled_acceptance(self, n: int) -> list[float]:
        """The engine-wide estimate at draft positions 1..n (what a new request starts from)."""
        prior = self.prior if isinstance(self.prior, (list, tuple)) else [self.prior]
        base = [prior[min(k, len(prior) - 1)] for k in range(n)]
        return shrunk_acceptance(self.pool_accepted, self.pool_reached, base, self.min_drafts)

    def acceptance(self, stats, n: int, pooled: list[float] | None = None) -> list[float]:
        """Request estimate at draft positions 1..n."""
        pooled = self.pooled_acceptance(n) if pooled is None else pooled[:n]
        return shrunk_acceptance(stats.accepted_per_pos, stats.reached_per_pos, pooled, self.request_drafts)

    def choose(self, requests, caps):
        if not caps:
            return []
        self._update_pool(requests)
        max_cap = max(caps)
        if max_cap == 1:
            return [1] * len(caps)
        contexts = [getattr(r, "num_cached", None) for r in requests]
        context = None if None in contexts else max(contexts)  # the longest row sets attention's width
        pooled = self.pooled_acceptance(max_cap - 1)
        expected = [expected_tokens(self.acceptance(r.stats, cap - 1, pooled)) for r, cap in zip(requests, caps)]
        best, best_rate = 1, -1.0
        for b in self.block_sizes:
            sizes = [min(b, cap) for cap in caps]
            seconds = self.step_cost(len(caps), max(sizes), context)
            rate = sum(e[s - 1] for e, s in zip(expected, sizes)) / seconds
            if rate > best_rate:
                best, best_rate = b, rate
            if b >= max_cap:  # bigger candidates give the same sizes
                break
        if best > 1:
            self._steps_at_1, self._explore_interval = 0, self.explore_every
        else:
            self._steps_at_1 += 1
            if self._steps_at_1 >= self._explore_interval:  # probe; back off while probes find nothing
                best, self._steps_at_1 = next((b for b in self.block_sizes if b > 1), 1), 0
                self._explore_interval = min(2 * self._explore_interval, MAX_EXPLORE_BACKOFF * self.explore_every)
        self.last_choice = (best, best_rate)
        return [min(best, cap) for cap in caps]

    def step_cost(self, batch: int, block: int, context: int | None) -> float:
        """Seconds the policy expects a step to take: the profiled cost times the block's calibration."""
        if block in self.cost_ratio:
            ratio = self.cost_ratio[block][0]
        else:
            ratio = statistics.mean(r for r, _ in self.cost_ratio.values()) if self.cost_ratio else 1.0
        return self.cost_model.cost(batch, block, context) * ratio

    def observe_step(self, batch: int, block: int, context: int, seconds: float):
        ratio = min(max(seconds / self.cost_model.cost(batch, block, context), CALIBRATION_BOUNDS[0]), CALIBRATION_BOUNDS[1])
        mean, n = self.cost_ratio.get(block, (ratio, 0))
        n = min(n + 1, CALIBRATION_WEIGHT)
        self.cost_ratio[block] = (mean + (ratio - mean) / n, n)

    def _update_pool(self, requests):
        """Add each request's new drafts (since the last step) to the pool; forget gone requests."""
        seen = {}
        for r in requests:
            s = r.stats
            _, old_reached, old_accepted = self._seen.get(id(s), (None, [], []))
            grow = len(s.reached_per_pos) - len(self.pool_reached)
            if grow > 0:
                self.pool_reached += [0.0] * grow
                self.pool_accepted += [0.0] * grow
            for k, (n, a) in enumerate(zip(s.reached_per_pos, s.accepted_per_pos)):
                self.pool_reached[k] += n - (old_reached[k] if k < len(old_reached) else 0)
                self.pool_accepted[k] += a - (old_accepted[k] if k < len(old_accepted) else 0)
            seen[id(s)] = (s, list(s.reached_per_pos), list(s.accepted_per_pos))  # holding s keeps its id unique
        self._seen = seen
        if self.pool_reached and self.pool_reached[0] > self.pool_drafts:
            scale = self.pool_drafts / self.pool_reached[0]
            self.pool_reached = [n * scale for n in self.pool_reached]
            self.pool_accepted = [a * scale for a in self.pool_accepted]
