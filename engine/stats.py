"""Speculative-decoding statistics with vLLM's definitions; exporters live elsewhere.

acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts;
per-position acceptance = accepted_per_pos / drafts. Drafts come from a proposer (dflash: the drafter;
suffix: what the context already says); the totals count every proposer, `by_proposer` each apart.
"""

import math
import random
import statistics
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    reached_per_pos: list[int] = field(default_factory=list)  # drafted with all before accepted
    block_sizes: dict[int, int] = field(default_factory=dict)
    by_proposer: dict[str, "SpecStats"] = field(default_factory=dict)

    def observe_draft(self, num_draft_tokens: int, num_accepted: int, proposer: str | None = None):
        """One verified block with `num_draft_tokens` drafts of which the first `num_accepted` held,
        drafted by `proposer` (None: not told apart)."""
        if proposer is not None and num_draft_tokens > 0:
            self.of(proposer).observe_draft(num_draft_tokens, num_accepted)
        self.block_sizes[num_draft_tokens + 1] = self.block_sizes.get(num_draft_tokens + 1, 0) + 1
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        grow = num_draft_tokens - len(self.reached_per_pos)
        if grow > 0:
            self.reached_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for i in range(min(num_accepted + 1, num_draft_tokens)):
            self.reached_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def of(self, proposer: str) -> "SpecStats":
        """The drafts of one proposer (empty if it drafted none yet)."""
        if proposer not in self.by_proposer:
            self.by_proposer[proposer] = SpecStats()
        return self.by_proposer[proposer]

    def merge(self, other: "SpecStats"):
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for name in ("accepted_per_pos", "reached_per_pos"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine += [0] * (len(theirs) - len(mine))
            for i, n in enumerate(theirs):
                mine[i] += n
        for b, n in other.block_sizes.items():
            self.block_sizes[b] = self.block_sizes.get(b, 0) + n
        for name, theirs in other.by_proposer.items():
            self.of(name).merge(theirs)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def per_position_acceptance(self) -> list[float]:
        """vLLM's definition: accepted at position i / number of drafts."""
        return [n / max(self.num_drafts, 1) for n in self.accepted_per_pos]

    def conditional_acceptance(self) -> list[float]:
        """P(position i accepted | position i drafted and every position before it accepted)."""
        return [acc / max(reached, 1) for acc, reached in zip(self.accepted_per_pos, self.reached_per_pos)]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "block_sizes": dict(sorted(self.block_sizes.items())),
            "proposers": {name: {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                                 "num_accepted_tokens": s.num_accepted_tokens,
                                 "mean_acceptance_length": s.mean_acceptance_length}
                          for name, s in sorted(self.by_proposer.items())},
        }


def geomean_interval(ratios: list[float], resamples: int = 10_000) -> dict:
    """Geometric mean of ratios with a 95% percentile-bootstrap interval (seeded: the same runs give the
    same interval)."""
    logs = [math.log(r) for r in ratios]
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    return {"n": len(logs), "geomean": math.exp(statistics.fmean(logs)),
            "low": math.exp(means[int(0.025 * resamples)]), "high": math.exp(means[int(0.975 * resamples) - 1])}
