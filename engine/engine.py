"""The speculative decoding engine: a batch of requests, each with its own sampling parameters
and block size, stepped through prefill -> draft -> verify -> accept -> commit.

It owns the requests' KV-cache slots and committed tokens. It knows nothing about HTTP or
tokenization, except an optional `decode` callable used only to find stop strings.
Invariant per running request: the target slot holds positions 0..num_cached-1, where
num_cached = len(prompt) + len(output) - 1 (the last token is not yet run through the target);
the drafter slot holds context entries for positions below num_cached - len(pending features).
"""

import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from engine.drafter import DraftHead
from engine.kv_cache import KVCache
from engine.model import TargetModel
from engine.policy import BlockPolicy, FixedBlockPolicy
from engine.sampling import sample, sampling_probs, seeded_choice, verify_exact, verify_rejection
from engine.stats import SpecStats
from engine.suffix import Proposal, SuffixProposer
from engine.tree import TREE_TOP_K, TokenTree, Tree, build_tree, outcomes, walk


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    block_size: int | None = None  # None: the engine's policy decides; 1: no speculation

    @property
    def seeded(self) -> bool:
        """A sampled request whose every token is a function of its seed and position (sampling.seeded_choice):
        its drafts are verified by exact match against those tokens, so its output never depends on them."""
        return self.temperature > 0 and self.seed is not None

    def validate(self):
        t, p = self.temperature, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0, got {t!r}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    target_slot: int = -1
    draft_slot: int = -1
    num_cached: int = 0
    num_prefix_cached: int = 0  # prompt positions reused from another request's cache (not prefilled)
    pending_features: torch.Tensor | None = None  # [c, n_layers * hidden]
    stats: SpecStats = field(default_factory=SpecStats)
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per step
    finish_reason: str | None = None
    tenant: str | None = None  # whose earlier outputs suffix drafting may propose to it

    @property
    def finished(self):
        return self.finish_reason is not None

    @property
    def last_token(self):
        return self.output_ids[-1]

    def append_output(self, new: list[int], stop_token_ids=(), decode=None, speculative=True) -> list[int]:
        """Append a step's committed tokens, cut at max_tokens and at a stop token; set finish_reason.
        Returns the tokens actually appended. (Shared by the engine and the disaggregated router.)"""
        new = new[: self.params.max_tokens - len(self.output_ids)]
        stops = set(self.params.stop_token_ids) | set(stop_token_ids)
        for j, t in enumerate(new):
            if t in stops:
                new, self.finish_reason = new[: j + 1], "stop"
                break
        self.output_ids += new
        if speculative:
            self.acceptance_lengths.append(len(new))
        if self.finish_reason is None and self.params.stop and decode is not None:
            if any(s in decode(self.output_ids) for s in self.params.stop):
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        return new


@dataclass
class StepOutput:
    request_id: int
    new_token_ids: list[int]
    finish_reason: str | None


# Defaults of EngineConfig's fields of the same names (engine/config.py, where they are described).
# Bigger prefill groups only add padding and latency: a long prompt costs as much per token alone as in a batch.
PREFILL_TOKEN_BUDGET = 2048
SUFFIX_BLOCK = 16  # the largest block a suffix draft fills when there is no drafter to set it
BACKLOG_CALL_POSITIONS = 64  # set by eye from CPU timings, not tuned
# A prompt reuses another request's cached positions only when they are at least this many and an eighth
# of the prompt: a prefill from position 0 runs unmasked attention, which a short reuse would give up.
PREFIX_MIN_TOKENS = 32


def prefill_group(new: list, budget: int) -> list:
    """The longest prefix of `new` (in arrival order) whose padded size, rows x the longest prompt,
    fits `budget` positions; at least its first request."""
    group, longest = [], 0
    for r in new:
        longest = max(longest, len(r.prompt_ids))
        if group and (len(group) + 1) * longest > budget:
            break
        group.append(r)
    return group


def common_prefix(a: list, b: list, limit: int) -> int:
    """How many leading entries a and b share, at most limit."""
    n, step = 0, 64
    while step and n < limit:  # whole chunks first, then the last chunk entry by entry
        end = min(n + step, limit)
        if a[n:end] == b[n:end]:
            n = end
        else:
            step //= 8
    return n


def by_slot(requests) -> list:
    """Requests in the order of their KV slots: the batch order in which their slots read as one view."""
    return sorted(requests, key=lambda r: r.target_slot)


@dataclass
class DraftBlock:
    """What the drafter proposes for a batch: drafts for block positions 1..b-1."""

    block_ids: torch.Tensor  # [batch, b_max] long: last token then drafts (padding past block_sizes)
    draft_probs: torch.Tensor | None  # [batch, b_max - 1, vocab] for sampling rows, else None
    block_sizes: list[int]
    # [batch, b_max - 1] float: the peak probability of each drafted position's distribution (a
    # function of the drafter's output only, never of a sampled token), or None
    confidence: torch.Tensor | None = None
    caught_up: int = 0  # target positions whose features the drafter took in with this pass (the widest row)
    proposers: list[str] | None = None  # per row, what drafted it ("dflash", "suffix"); None: the drafter alone
    # [batch, b_max - 1, TREE_TOP_K] the likeliest tokens of each drafted position and their probabilities
    # (0 past a row's drafted block), for token trees; not cut by `trimmed`
    top_ids: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None
    trees: list[Tree | None] | None = None  # per row, the token tree verified instead of a chain (engine/tree.py), or None

    def trimmed(self, block_sizes: list[int]) -> "DraftBlock":
        """The same drafts, each row verifying only its first block_sizes[i] <= self.block_sizes[i] positions."""
        if block_sizes == self.block_sizes:
            return self
        b_max = max(block_sizes)
        return DraftBlock(self.block_ids[:, :b_max], None if self.draft_probs is None else self.draft_probs[:, : b_max - 1],
                          block_sizes, None if self.confidence is None else self.confidence[:, : b_max - 1], self.caught_up,
                          self.proposers, self.top_ids, self.top_probs)


class Engine:
    def __init__(
        self,
        target,
        drafter=None,
        *,
        max_slots: int = 8,
        max_len: int = 2048,
        policy: BlockPolicy | None = None,
        stop_token_ids: tuple[int, ...] = (),
        decode: Callable[[list[int]], str] | None = None,
        denoising_steps: int = 1,
        feature_layers: tuple[int, ...] | None = None,
        reduced_draft_head: bool = True,
        suffix: SuffixProposer | None = None,
        prefill_token_budget: int = PREFILL_TOKEN_BUDGET,
        backlog_call_positions: int | None = BACKLOG_CALL_POSITIONS,
        prefix_cache: bool = False,
        draft_tree: bool = False,
    ):
        """feature_layers: target layers whose features prefill/verify return; default: the drafter's.
        Give them to an engine without a drafter that serves a drafter in another process.
        reduced_draft_head: when the drafter has a draft vocabulary, score only those tokens.
        suffix: a SuffixProposer: each step, each request verifies either the drafter's block or what its
        context already says (the policy's `suffix_widths` decides), with or without a drafter.
        prefill_token_budget, backlog_call_positions: see EngineConfig (engine/config.py).
        prefix_cache: a new prompt starts from the cached positions of a running or finished request whose
        tokens begin it (needs both caches here as KVCaches: not with shards or a drafter elsewhere).
        draft_tree: a greedy request verifies a token tree of the drafter's likeliest tokens, as wide as the
        chain the policy chose, instead of that chain (engine/tree.py; needs the target here, unsharded)."""
        if drafter is not None:
            from engine.drafter import check_drafter_fits

            check_drafter_fits(drafter.config, target.config)
        if denoising_steps < 1:
            raise ValueError(f"denoising_steps must be >= 1, got {denoising_steps}")
        self.target, self.drafter = target, drafter
        max_slots = min(max_slots, getattr(target, "max_batch_size", max_slots))
        self.max_len = min(max_len, target.config.max_position_embeddings)
        self.device = target.device
        self.target_cache = target.new_cache(max_slots, self.max_len)
        self.draft_cache = drafter.new_cache(max_slots, self.max_len) if drafter is not None else None
        default_block = drafter.config.block_size if drafter is not None else 1
        self.policy = policy or FixedBlockPolicy(default_block)
        if feature_layers is None:
            feature_layers = drafter.config.target_layer_ids if drafter is not None else ()
        self.feature_layers = tuple(feature_layers)
        self.stop_token_ids = tuple(stop_token_ids)
        self.decode = decode
        self.denoising_steps = denoising_steps
        self.prefill_token_budget = prefill_token_budget
        self.backlog_call_positions = backlog_call_positions  # None: pad every backlog into the block pass
        vocab = getattr(drafter, "draft_vocab", None) if reduced_draft_head else None
        # only an engine that drafts reads the LM head here (a sharded target has none in this process)
        self.draft_head = DraftHead(target.lm_head, vocab) if drafter is not None else None
        self.prefix_cache = (prefix_cache and isinstance(self.target_cache, KVCache)
                             and (drafter is not None or not self.feature_layers))
        self.draft_tree = (draft_tree and drafter is not None and denoising_steps == 1
                           and isinstance(target, TargetModel) and isinstance(self.target_cache, KVCache))
        # target slot -> (tokens, positions cached, drafter slot) of a finished request, until a new
        # request takes either slot
        self._finished_slots: dict[int, tuple[list[int], int, int]] = {}
        self.suffix = suffix
        self.stats = SpecStats()
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._prefilled_last = False
        self._last_step_end: float | None = None  # when the last step() returned with requests left running

    # ---- request lifecycle -------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams):
        """Raise ValueError saying what is wrong if the request cannot run (needs no free slot)."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.target.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"the prompt has token ids outside the vocabulary [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_len:
            raise ValueError(
                f"this model's context length is {self.max_len} tokens, but {total} were requested "
                f"({len(prompt_ids)} in the prompt, {params.max_tokens} for the completion)"
            )

    def add_request(self, prompt_ids: list[int], params: SamplingParams, tenant=None) -> Request:
        """Validate and admit a request; fails before any work and holds no slot on error. `tenant` (an
        API key, say): the suffix proposer only ever proposes a tenant's own earlier outputs to it."""
        self.check_request(prompt_ids, params)
        if self.target_cache.num_used >= self.target_cache.num_slots:
            raise RuntimeError(f"the engine is full ({self.target_cache.num_slots} requests running)")
        request = Request(next(self._ids), list(prompt_ids), params, tenant=tenant)
        source = self._prefix_source(request.prompt_ids) if self.prefix_cache else None
        request.target_slot = self.target_cache.allocate()
        if self.drafter is not None:
            request.draft_slot = self.draft_cache.allocate()
        if source is not None:
            self._reuse_prefix(request, *source)
        for slot, (_, _, draft_slot) in list(self._finished_slots.items()):
            if slot == request.target_slot or draft_slot == request.draft_slot >= 0:
                del self._finished_slots[slot]
        if self.suffix is not None:
            self.suffix.add_request(request.request_id, request.prompt_ids, tenant)
        self.requests[request.request_id] = request
        return request

    def release(self, request: Request):
        """Free a request's slots in both caches (finished, aborted or failed)."""
        if self.requests.pop(request.request_id, None) is None:
            return
        if self.prefix_cache and request.finish_reason in ("stop", "length", "abort"):
            cached = self._cached_positions(request.target_slot, request.draft_slot)
            if cached >= PREFIX_MIN_TOKENS:
                tokens = request.prompt_ids + request.output_ids
                self._finished_slots[request.target_slot] = (tokens, cached, request.draft_slot)
        self.target_cache.free(request.target_slot)
        if request.draft_slot >= 0:
            self.draft_cache.free(request.draft_slot)
        if self.suffix is not None:  # a finished output joins the shared index; an aborted one does not
            self.suffix.finish(request.request_id, cache_output=request.finish_reason in ("stop", "length"))
        request.pending_features = None
        if not self.requests:
            self._last_step_end = None

    def _cached_positions(self, target_slot, draft_slot) -> int:
        """Positions both caches hold for the request in these slots (the drafter's may lag the target's)."""
        cached = self.target_cache.lengths[target_slot]
        return cached if draft_slot < 0 else min(cached, self.draft_cache.lengths[draft_slot])

    def _prefix_source(self, prompt_ids) -> tuple[int, int, int] | None:
        """(positions, target slot, drafter slot) of the running or finished request whose cached tokens
        begin the prompt furthest; None if that is too short to be worth it. The prompt's last position
        is always run (its logits give the first token)."""
        sources = [(r.prompt_ids + r.output_ids, self._cached_positions(r.target_slot, r.draft_slot), r.target_slot,
                    r.draft_slot) for r in self.requests.values() if r.output_ids]
        sources += [(tokens, cached, slot, draft_slot) for slot, (tokens, cached, draft_slot) in self._finished_slots.items()]
        best = (0, -1, -1)
        for tokens, cached, slot, draft_slot in sources:
            n = common_prefix(prompt_ids, tokens, min(cached, len(prompt_ids) - 1))
            best = max(best, (n, slot, draft_slot))
        return best if best[0] >= max(PREFIX_MIN_TOKENS, len(prompt_ids) // 8) else None

    def _reuse_prefix(self, request, positions, target_slot, draft_slot):
        """Copy the source's first `positions` keys and values into the request's own slots; its
        prefill then runs the rest of the prompt."""
        self.target_cache.copy_prefix(target_slot, request.target_slot, positions)
        if request.draft_slot >= 0:
            self.draft_cache.copy_prefix(draft_slot, request.draft_slot, positions)
        request.num_cached = request.num_prefix_cached = positions

    def forget_finished(self):
        """Reuse no finished request's cache from now on (running requests' caches are still reused)."""
        self._finished_slots.clear()

    def abort(self, request_id: int):
        request = self.requests.get(request_id)
        if request is not None:
            request.finish_reason = request.finish_reason or "abort"
            self.release(request)

    @property
    def num_running(self):
        return len(self.requests)

    # ---- one engine step -----------------------------------------------------------------

    def not_the_callers_time(self):
        """The time since the last step was not spent by this engine's caller on its steps (a harness ran other
        engines meanwhile): it is not told to the policy as the time a step costs outside the engine."""
        self._last_step_end = None

    def step(self) -> list[StepOutput]:
        """Prefill a group of new requests, or run one speculative step for every running request.

        New requests are prefilled first come first served, in groups of at most
        `prefill_token_budget` padded prompt positions (one prompt at least), and while some wait,
        prefill and decode steps alternate: a burst of long prompts neither stalls the running
        requests' streams until all are in, nor pays for padding every prompt to the longest.

        The time from the end of one call to the start of the next, while requests run, is what
        the caller spends per step outside the engine (a server streaming the step's tokens); the
        policy is told it (`observe_gap`).
        """
        if self._last_step_end is not None:
            self.policy.observe_gap(time.perf_counter() - self._last_step_end)
        try:
            return self._step()
        finally:
            self._last_step_end = time.perf_counter() if self.requests else None

    @torch.inference_mode()
    def _step(self) -> list[StepOutput]:
        new = [r for r in self.requests.values() if not r.output_ids]
        running = by_slot(r for r in self.requests.values() if r.output_ids)
        if new and not (running and self._prefilled_last):
            self._prefilled_last = True
            group = by_slot(prefill_group(new, self.prefill_token_budget))
            return self._finish_step(group, self.prefill(group), speculative=False)
        self._prefilled_last = False
        if not running:
            return []
        start, context = time.perf_counter(), max(r.num_cached for r in running)
        caps = [self.block_cap(r) for r in running]
        proposals = self.suffix_proposals(running, caps)
        widths = self.policy.suffix_widths(running, caps, proposals) if any(proposals) else [0] * len(running)
        rows = [i for i, w in enumerate(widths) if w == 0]  # drafted by DFlash (or plain steps)
        drafting = [running[i] for i in rows]
        if drafting:
            drafted = self.draft(drafting, self.policy.choose(drafting, [caps[i] for i in rows]))
        else:  # every request verifies a suffix draft: no drafter pass at all
            drafted = DraftBlock(torch.zeros(0, 1, dtype=torch.long, device=self.device), None, [])
        trees = self.trees(drafting, drafted)
        draft = self.with_suffix(running, rows, self.branch(self.trim(drafting, drafted, trees), trees), proposals, widths)
        num_accepted, next_ids, features = self.verify(running, draft)
        committed = [ids[: a + 1] for ids, a in zip(next_ids, num_accepted)]
        if drafting:
            self.observe(drafting, drafted, [draft.block_sizes[i] for i in rows], [num_accepted[i] for i in rows],
                         trees, [committed[i] for i in rows])
        if len(rows) < len(running):
            self.observe_suffix(running, proposals, widths, num_accepted)
        for i, r in enumerate(running):
            self.commit(r, num_accepted[i] + 1, None if features is None else features[i])
        outputs = self._finish_step(running, committed)
        if len(rows) == len(running):  # the cost model knows drafter + verify steps, not suffix-widened ones
            self.policy.observe_step(len(running), max(drafted.block_sizes), context, time.perf_counter() - start,
                                     verified=sum(draft.block_sizes) / len(running), caught_up=drafted.caught_up)
        return outputs

    def suffix_proposals(self, requests, caps) -> list[Proposal | None]:
        """Each request's suffix proposal of up to cap - 1 tokens (None without a suffix proposer)."""
        if self.suffix is None:
            return [None] * len(requests)
        return [self.suffix.propose(r.request_id, cap - 1) if cap > 1 else None for r, cap in zip(requests, caps)]

    def with_suffix(self, requests, rows, draft: "DraftBlock", proposals, widths) -> "DraftBlock":
        """One block for every request: rows[j] has the drafter's row j, a request with widths[i] > 0 its
        suffix proposal's first widths[i] tokens. A sampled request's suffix drafts have one-hot draft
        probabilities: rejection sampling against them keeps its output distribution the target's."""
        if len(rows) == len(requests):
            return draft
        sizes, ids, trees = [0] * len(requests), [None] * len(requests), [None] * len(requests)
        for j, i in enumerate(rows):
            sizes[i], ids[i] = draft.block_sizes[j], draft.block_ids[j, : draft.block_sizes[j]].tolist()
            trees[i] = draft.trees[j] if draft.trees is not None else None
        for i, (r, w) in enumerate(zip(requests, widths)):
            if w:
                sizes[i], ids[i] = w + 1, [r.last_token] + proposals[i].token_ids[:w]
        b_max = max(sizes)
        block_ids = torch.tensor([row + [0] * (b_max - len(row)) for row in ids], device=self.device)
        probs = None
        if any(r.params.temperature > 0 for r in requests):
            probs = torch.zeros(len(requests), b_max - 1, self.target.config.vocab_size, device=self.device)
            for j, i in enumerate(rows):
                if draft.draft_probs is not None and sizes[i] > 1:
                    probs[i, : sizes[i] - 1] = draft.draft_probs[j, : sizes[i] - 1]
            for i, w in enumerate(widths):
                if w:
                    probs[i, torch.arange(w), block_ids[i, 1: w + 1]] = 1.0
        return DraftBlock(block_ids, probs, sizes, proposers=["suffix" if w else "dflash" for w in widths],
                          trees=trees if any(t is not None for t in trees) else None)

    def observe_suffix(self, requests, proposals, widths, num_accepted):
        """Record the verified suffix drafts: stats (proposer "suffix") and the policy's calibration."""
        rows = [i for i, w in enumerate(widths) if w]
        for i in rows:
            requests[i].stats.observe_draft(widths[i], num_accepted[i], "suffix")
            self.stats.observe_draft(widths[i], num_accepted[i], "suffix")
        self.policy.observe_suffix([requests[i] for i in rows], [proposals[i] for i in rows],
                                   [widths[i] for i in rows], [num_accepted[i] for i in rows])

    def trim(self, requests: list[Request], drafted: DraftBlock, trees=None) -> DraftBlock:
        """The drafted block cut to what the policy wants verified, from the drafts' confidence.
        Not with sampling after several denoising passes: a redrafted position's distribution then
        depends on the other positions' sampled tokens, and so would the cut."""
        if drafted.confidence is None or max(drafted.block_sizes) == 1:
            return drafted
        if self.denoising_steps > 1 and any(r.params.temperature > 0 for r in requests):
            return drafted
        sizes = self.policy.trim(requests, drafted.block_sizes, drafted.confidence, max(r.num_cached for r in requests),
                                 trees)
        return drafted.trimmed(sizes)

    def trees(self, requests: list[Request], drafted: DraftBlock) -> list[Tree | None] | None:
        """Per greedy row, the token tree of its drafted block's size - 1 nodes most likely accepted
        (engine/tree.py); None for sampling rows, whose drafts are samples and whose rejection sampling takes
        one draft per position."""
        if drafted.top_ids is None or max(drafted.block_sizes) < 3:
            return None
        top_ids, top_probs = drafted.top_ids.tolist(), drafted.top_probs.tolist()
        return [build_tree(top_ids[i], top_probs[i], size - 1) if r.params.temperature == 0 and size >= 3 else None
                for i, (r, size) in enumerate(zip(requests, drafted.block_sizes))]

    def branch(self, draft: DraftBlock, trees: list[Tree | None] | None) -> DraftBlock:
        """The trimmed block with each tree row's chain replaced by its tree's first size - 1 nodes, where
        those are not the chain itself."""
        if trees is None:
            return draft
        block_ids, verified = draft.block_ids.clone(), [None] * len(trees)
        for i, (tree, size) in enumerate(zip(trees, draft.block_sizes)):
            tree = None if tree is None else tree.first(size - 1)
            if tree is not None and len(tree.ids) == size - 1 and not tree.is_chain():
                block_ids[i, 1:size] = torch.tensor(tree.ids)
                verified[i] = tree
        if all(t is None for t in verified):
            return draft
        return replace(draft, block_ids=block_ids, trees=verified)

    def observe(self, requests: list[Request], drafted: DraftBlock, verified_sizes: list[int], num_accepted: list[int],
                trees=None, committed=None):
        """Record a verified step: the speculative stats (verified drafts only) and, for the policy, what was
        drafted; of a row with a token tree (trees[i], its verified nodes a prefix), which nodes the target
        tested and what held."""
        proposer = "dflash" if self.drafter is not None else None
        for i, r in enumerate(requests):
            r.stats.observe_draft(verified_sizes[i] - 1, num_accepted[i], proposer)
            self.stats.observe_draft(verified_sizes[i] - 1, num_accepted[i], proposer)
        if drafted.confidence is not None:
            tested = None if trees is None else [
                None if t is None else (t, outcomes(t.first(v - 1), ids))
                for t, v, ids in zip(trees, verified_sizes, committed)]
            self.policy.observe_verified(requests, drafted.block_sizes, verified_sizes, drafted.confidence, num_accepted,
                                         tested)

    def block_cap(self, r: Request) -> int:
        """The largest block this request may verify: its own block size and its remaining budget."""
        if self.drafter is None and self.suffix is None:
            return 1
        cap = r.params.block_size or (self.drafter.config.block_size if self.drafter is not None else SUFFIX_BLOCK)
        return max(1, min(cap, r.params.max_tokens - len(r.output_ids) + 1))

    @torch.inference_mode()
    def prefill(self, requests: list[Request]) -> list[list[int]]:
        """Run prompts through the target (from the positions a request already holds, its reused
        prefix); sample each request's first token."""
        starts = [r.num_cached for r in requests]
        lengths = [len(r.prompt_ids) - start for r, start in zip(requests, starts)]  # positions to run
        width = max(lengths)
        input_ids = torch.zeros(len(requests), width, dtype=torch.long)
        positions = torch.full((len(requests), width), -1, dtype=torch.long)
        for i, r in enumerate(requests):
            input_ids[i, : lengths[i]] = torch.tensor(r.prompt_ids[starts[i]:])
            positions[i, : lengths[i]] = torch.arange(starts[i], starts[i] + lengths[i])
        last = torch.tensor(lengths)[:, None] - 1
        logits, features = self.target(
            input_ids.to(self.device), positions.to(self.device), self.target_cache,
            self._slots(requests, "target_slot"), max(len(r.prompt_ids) for r in requests), self.feature_layers,
            last.to(self.device),
        )
        first = self._sample_next(requests, logits, [len(r.prompt_ids) for r in requests])
        for i, r in enumerate(requests):
            r.num_cached = len(r.prompt_ids)
            self.target_cache.crop(r.target_slot, r.num_cached)
            if features is not None:
                r.pending_features = features[i, : lengths[i]]
        return [[t] for t in first]

    @torch.inference_mode()
    def draft(self, requests: list[Request], block_sizes: list[int]) -> DraftBlock:
        """Fill each request's block [last token, MASK...] with drafts in one drafter pass."""
        b_max = max(block_sizes)
        block_ids = torch.tensor([[r.last_token] for r in requests], device=self.device)
        if b_max == 1:
            return DraftBlock(block_ids, None, block_sizes)
        mask_id = self.drafter.config.mask_token_id
        block_ids = torch.cat([block_ids, torch.full((len(requests), b_max - 1), mask_id, device=self.device)], 1)
        caught_up = max(r.pending_features.shape[0] for r in requests)
        self._take_backlogs(requests)
        ctx_width = max(r.pending_features.shape[0] for r in requests)
        ctx = torch.zeros(len(requests), ctx_width, self.target_features_dim, dtype=self.drafter.dtype, device=self.device)
        positions = torch.full((len(requests), ctx_width + b_max), -1, dtype=torch.long)
        for i, r in enumerate(requests):
            c = r.pending_features.shape[0]
            ctx[i, :c] = r.pending_features
            positions[i, :c] = torch.arange(r.num_cached - c, r.num_cached)
            positions[i, ctx_width : ctx_width + block_sizes[i]] = torch.arange(r.num_cached, r.num_cached + block_sizes[i])
        positions = positions.to(self.device)
        block_end = torch.tensor([r.num_cached + b for r, b in zip(requests, block_sizes)], device=self.device)
        slots = self._slots(requests, "draft_slot")
        kv_len = max(r.num_cached for r in requests) + b_max
        sampling = [r.params.temperature > 0 for r in requests]
        for step in range(self.denoising_steps):
            if step > 0:  # re-mask the least confident drafts and fill them again; context is cached
                remask = self._remask(confidence, block_sizes, step)
                block_ids[:, 1:] = torch.where(remask, mask_id, drafts)
                ctx, positions = ctx[:, :0], positions[:, -b_max:]
            hidden = self.drafter(ctx, self.target.embed_tokens(block_ids), positions, self.draft_cache, slots, kv_len, block_end)
            scores = self.draft_head.scores(hidden[:, 1:])  # [batch, b_max - 1, draft vocabulary]
            ids, q, conf = self._propose(requests, scores, sampling, self._positions(requests, scores.shape[1]))
            if step == 0:
                drafts, probs, confidence = ids, q, conf
            else:
                drafts = torch.where(remask, ids, drafts)
                confidence = torch.where(remask, conf, confidence)
                probs = None if q is None else torch.where(remask[..., None], q, probs)
        block_ids[:, 1:] = drafts
        for r in requests:
            self.draft_cache.crop(r.draft_slot, r.num_cached)
            r.pending_features = None
        top_ids = top_probs = None
        if self.draft_tree and not all(sampling):
            top_probs, index = scores.softmax(dim=-1).topk(min(TREE_TOP_K, scores.shape[-1]), dim=-1)
            drafted = torch.arange(b_max - 1, device=self.device) < torch.tensor(block_sizes, device=self.device)[:, None] - 1
            top_ids, top_probs = self.draft_head.ids(index), top_probs * drafted[..., None]
        return DraftBlock(block_ids, probs, block_sizes, confidence, caught_up, top_ids=top_ids, top_probs=top_probs)

    def _take_backlogs(self, requests):
        """Let the drafter take in long backlogs of target features (a prompt after its prefill, the steps
        of a stretch at block 1) row by row, each unpadded, when that costs less than the block pass
        padding every row to them (docs/design.md). The block pass then pads the other rows to the widest
        backlog left; a pass of its own costs about as much as `backlog_call_positions` more positions."""
        if self.backlog_call_positions is None:
            return
        rows = sorted(requests, key=lambda r: -r.pending_features.shape[0])
        widths = [r.pending_features.shape[0] for r in rows] + [0]
        cost = lambda k: sum(self.backlog_call_positions + w for w in widths[:k]) + len(rows) * widths[k]
        apart = min(range(len(rows) + 1), key=cost)  # the `apart` widest rows each get a pass of their own
        for r in rows[:apart]:
            c = r.pending_features.shape[0]
            positions = torch.arange(r.num_cached - c, r.num_cached, device=self.device)[None]
            self.drafter.take_context(r.pending_features[None], positions, self.draft_cache, [r.draft_slot])
            r.pending_features = r.pending_features[:0]

    @property
    def target_features_dim(self):
        return len(self.feature_layers) * self.target.config.hidden_size

    def _remask(self, confidence, block_sizes, step):
        """Which drafts to redraft in pass `step`: the least confident half, then a quarter, ..."""
        sizes = torch.tensor(block_sizes, device=confidence.device)[:, None]
        drafted = torch.arange(confidence.shape[1], device=confidence.device) < sizes - 1
        ranks = torch.where(drafted, confidence, torch.inf).argsort(dim=1).argsort(dim=1)  # 0 = least sure
        num = (sizes - 1) >> step
        return ranks < num

    def _propose(self, requests, scores, sampling, positions):
        """From the draft head's scores [batch, n, head vocabulary] for the tokens at positions [batch, n]:
        draft ids [batch, n], the distributions of sampling rows over the whole vocabulary
        [batch, n, vocab] (or None), and each position's confidence [batch, n], the peak of the
        distribution it is drafted from (for a greedy row, the probability of its argmax). A seeded row
        drafts with its seed's noise at each position (sampling.seeded_choice), as the target will pick."""
        head = self.draft_head
        greedy = scores.argmax(dim=-1)
        confidence = scores.softmax(dim=-1).amax(dim=-1)
        if not any(sampling):
            return head.ids(greedy), None, confidence
        probs = self._probs(requests, scores)  # the reduced head's -inf elsewhere: zero there
        rows = torch.tensor(sampling, device=self.device)[:, None]
        ids = torch.where(rows, sample(probs), greedy)
        seeded = [i for i, r in enumerate(requests) if r.params.seeded]
        if seeded:  # over the head's columns, with the noise of the tokens they stand for
            index = torch.tensor(seeded, device=self.device)
            seeds = torch.tensor([requests[i].params.seed for i in seeded], device=self.device)
            ids[index] = seeded_choice(probs[index], seeds, positions[index], token_ids=head.draft_vocab)
        confidence = torch.where(rows, probs.amax(dim=-1), confidence)
        return head.ids(ids), head.to_vocab(probs, self.target.config.vocab_size), confidence

    def _positions(self, requests, n):
        """[batch, n]: the positions of the tokens a block's n first positions predict (after its last token)."""
        return torch.tensor([r.num_cached + 1 for r in requests], device=self.device)[:, None] + torch.arange(n, device=self.device)

    @torch.inference_mode()
    def verify(self, requests: list[Request], draft: DraftBlock):
        """Run the block through the target and accept: returns accepted counts, tokens, features."""
        b_max = draft.block_ids.shape[1]
        offsets = torch.arange(b_max)
        positions = torch.stack([
            torch.where(offsets < b, r.num_cached + offsets, -1) for r, b in zip(requests, draft.block_sizes)
        ]).to(self.device)
        kv_len = max(r.num_cached for r in requests) + b_max
        tree = None if draft.trees is None else TokenTree.of([t and t.parents for t in draft.trees], b_max, self.device)
        logits, features = self.target(
            draft.block_ids, positions, self.target_cache, self._slots(requests, "target_slot"), kv_len, self.feature_layers,
            tree=tree,
        )
        num_draft = torch.tensor([b - 1 for b in draft.block_sizes], device=self.device)
        target_ids = self._target_ids(requests, logits, self._positions(requests, b_max))
        num_accepted, next_ids = self._accept(requests, draft.block_ids[:, 1:], draft.draft_probs, logits, num_draft,
                                              target_ids)
        num_accepted, next_ids = num_accepted.tolist(), next_ids.tolist()
        if tree is not None:
            self._accept_trees(requests, draft, target_ids, features, num_accepted, next_ids)
        return num_accepted, next_ids, features

    def _accept_trees(self, requests, draft: DraftBlock, target_ids, features, num_accepted, next_ids):
        """Greedy acceptance of the tree rows, in place: the accepted path's keys and values move to the
        positions after the root in the target cache, and its features to the first rows of `features`
        [batch, b_max, n * hidden], so that commit keeps them as it keeps a chain's.
        target_ids [batch, b_max]: the target's token after each column (_target_ids)"""
        rows = [i for i, t in enumerate(draft.trees) if t is not None]
        predicted = target_ids[rows].tolist()
        block_ids = draft.block_ids[rows].tolist()
        for i, pred, ids in zip(rows, predicted, block_ids):
            path = walk(draft.trees[i].parents, ids, pred)
            num_accepted[i], next_ids[i] = len(path) - 1, [pred[j] for j in path]
            if path != list(range(len(path))):
                self.target_cache.keep(requests[i].target_slot, requests[i].num_cached, path)
                if features is not None:
                    features[i, : len(path)] = features[i, path]

    # ---- helpers -----------------------------------------------------------------------

    def commit(self, r: Request, num_new: int, features):
        """Keep the block's first `num_new` positions in the target cache, queue their features."""
        r.num_cached += num_new
        self.target_cache.crop(r.target_slot, r.num_cached)
        if features is not None:
            new = features[:num_new]
            r.pending_features = new if r.pending_features is None else torch.cat([r.pending_features, new])

    def _finish_step(self, requests, committed, speculative=True) -> list[StepOutput]:
        outputs = []
        for r, new in zip(requests, committed):
            new = r.append_output(new, self.stop_token_ids, self.decode, speculative)
            if self.suffix is not None:
                self.suffix.extend(r.request_id, new)
            if r.finished:
                self.release(r)
            outputs.append(StepOutput(r.request_id, new, r.finish_reason))
        return outputs

    def _slots(self, requests, name):
        return [getattr(r, name) for r in requests]

    def _probs(self, requests, logits):
        """Sampling distributions for [batch, n, vocab] logits with each row's own parameters."""
        temperature = torch.tensor([r.params.temperature or 1.0 for r in requests], device=logits.device)
        top_k = torch.tensor([r.params.top_k for r in requests])  # on the host: see sampling_probs
        top_p = torch.tensor([float(r.params.top_p) for r in requests])
        return sampling_probs(logits, temperature, top_k, top_p)

    def _target_ids(self, requests, logits, positions):
        """[batch, b] the target's own token after each column of an exact-match row: its argmax, or for a
        seeded row its seed's choice for the token at positions [batch, b] (sampling.seeded_choice)."""
        ids = logits.argmax(dim=-1)
        seeded = [i for i, r in enumerate(requests) if r.params.seeded]
        if seeded:
            index, sub = torch.tensor(seeded, device=self.device), [requests[i] for i in seeded]
            seeds = torch.tensor([r.params.seed for r in sub], device=self.device)
            ids[index] = seeded_choice(self._probs(sub, logits[index]), seeds, positions[index])
        return ids

    def _accept(self, requests, draft_ids, draft_probs, logits, num_draft, target_ids):
        """Greedy and seeded rows by exact match against target_ids [batch, b] (see _target_ids), other
        sampling rows by rejection sampling -> (num_accepted, next_ids).

        draft_ids [batch, b - 1]; draft_probs [batch, b - 1, vocab] or None; logits [batch, b, vocab]
        """
        num_accepted, next_ids = verify_exact(draft_ids, target_ids, num_draft)
        rows = [i for i, r in enumerate(requests) if r.params.temperature > 0 and not r.params.seeded]
        if rows:
            sub = [requests[i] for i in rows]
            index = torch.tensor(rows, device=self.device)
            target_probs = self._probs(sub, logits[index])
            q = draft_probs[index] if draft_probs is not None else target_probs[:, :0]
            acc, nxt = verify_rejection(draft_ids[index], q, target_probs, num_draft[index])
            num_accepted, next_ids = num_accepted.index_copy(0, index, acc), next_ids.index_copy(0, index, nxt)
        return num_accepted, next_ids

    def _sample_next(self, requests, logits, positions):
        """The next token, at positions [batch], from [batch, 1, vocab] logits: argmax or a sample, per request."""
        empty = torch.zeros(len(requests), 0, dtype=torch.long, device=logits.device)
        num_draft = torch.zeros(len(requests), dtype=torch.long, device=logits.device)
        target_ids = self._target_ids(requests, logits, torch.tensor(positions, device=logits.device)[:, None])
        return self._accept(requests, empty, None, logits, num_draft, target_ids)[1][:, 0].tolist()

    # ---- convenience drivers -------------------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[list[int]]:
        """Stream one request's tokens as they are committed (other requests may share steps)."""
        request = self.add_request(prompt_ids, params)
        try:
            while not request.finished:
                for out in self.step():
                    if out.request_id == request.request_id and out.new_token_ids:
                        yield out.new_token_ids
        finally:
            self.abort(request.request_id)

    def generate_batch(self, prompts: list[list[int]], params) -> list[Request]:
        """Run several requests to completion in one batch (admitting as slots free up)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        for p in params:
            p.validate()
        queue, done, running = list(zip(prompts, params)), [], []
        try:
            while queue or running:
                while queue and self.target_cache.num_used < self.target_cache.num_slots:
                    running.append(self.add_request(*queue.pop(0)))
                self.step()
                done += [r for r in running if r.finished]
                running = [r for r in running if not r.finished]
        finally:
            for r in running:
                self.abort(r.request_id)
        return sorted(done, key=lambda r: r.request_id)
