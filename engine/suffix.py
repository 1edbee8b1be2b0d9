"""Suffix drafting (SuffixDecoding's idea): propose what followed the longest earlier match of a
request's last tokens, in its own prompt and output or in recent outputs of the same tenant.

It owns one index per running request and a bounded global index of finished outputs. It knows
nothing about models, sampling, or whether a proposal is worth verifying (the policy decides).
"""

import bisect
import functools
import itertools
import math
import random
import statistics
import time
import tracemalloc
from collections import Counter, deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

SEPARATOR = -1  # between documents in a buffer (token ids are >= 0): no match or continuation crosses it


@dataclass
class SuffixConfig:
    max_match: int = 32  # context tokens compared: longer matches tie, and frequency decides between them
    key_lengths: tuple[int, ...] = (1, 4, 16)  # n-gram lengths indexed, ascending; the first is the shortest match
    max_candidates: int = 64  # most recent occurrences of a key examined per query: bounds a query's time
    min_prob: float = 0.1  # stop where fewer than this share of the matches go on with the proposal
    max_spec_factor: float = 1.0  # propose at most this many tokens per matched token: short matches guess less
    global_max_tokens: int = 200_000  # output tokens the global index holds, all tenants together

    def __post_init__(self):
        lengths = self.key_lengths = tuple(self.key_lengths)
        if not lengths or lengths[0] < 1 or list(lengths) != sorted(set(lengths)):
            raise ValueError(f"key_lengths must be distinct positive integers, ascending; got {lengths}")
        if self.max_match < lengths[-1]:
            raise ValueError(f"max_match ({self.max_match}) must be >= the longest key length ({lengths[-1]})")
        if self.max_candidates < 1 or self.global_max_tokens < 0:
            raise ValueError("max_candidates must be >= 1 and global_max_tokens >= 0")
        if not 0 <= self.min_prob <= 1 or self.max_spec_factor <= 0:
            raise ValueError(f"min_prob must be in [0, 1] and max_spec_factor > 0; got {self.min_prob}, {self.max_spec_factor}")


@dataclass
class Proposal:
    """A continuation and what a calibration can bin it by. Empty token_ids: no proposal."""

    token_ids: list[int] = field(default_factory=list)  # [n], n <= the max_tokens asked for
    match_length: int = 0  # context tokens matched, at most SuffixConfig.max_match
    num_matches: int = 0  # occurrences found with that match length (at most max_candidates)
    counts: list[int] = field(default_factory=list)  # [n] how many of them went on with token_ids[: i + 1]
    source: str = ""  # "request": its own tokens; "global": recent outputs of its tenant

    @property
    def score(self) -> float:
        """Expected accepted tokens if the target went on as the matches did: sum(counts) / num_matches."""
        return sum(self.counts) / self.num_matches if self.num_matches else 0.0


class TokenIndex:
    """Hashed n-grams -> the positions that followed them, over documents appended at the end and
    dropped from the front (a hash collision only costs a candidate that fails verification).

    Positions are absolute: tokens[j] is position start + j. Invariant: for each k in key_lengths
    and each token position i (never a separator's) whose k preceding tokens lie in its document,
    table[hash of those k tokens] holds i, in increasing order; nothing else is held. So a held
    position always has a token to propose, and the end of the open document is never held.
    """

    def __init__(self, config: SuffixConfig, source: str):
        self.config = config
        self.source = source
        self.tokens: list[int] = []  # documents joined by SEPARATOR; the last one is open
        self.table: dict[int, list[int]] = {}
        self.start = 0  # absolute position of tokens[0]
        self.doc_start = 0  # absolute position of the open document's first token
        self.doc_lengths: deque[int] = deque()  # closed documents, oldest first

    def _keys_before(self, i: int, doc_start: int) -> Iterator[int]:
        """Hashes of the n-grams that end just before position i inside a document starting at doc_start."""
        j = i - self.start
        for k in self.config.key_lengths:
            if i - k < doc_start:
                return
            yield hash(tuple(self.tokens[j - k : j]))

    def extend(self, token_ids: list[int]):
        """Append tokens to the open document."""
        for token in token_ids:
            i = self.start + len(self.tokens)
            for key in self._keys_before(i, self.doc_start):
                ends = self.table.get(key)
                if ends is None:
                    self.table[key] = [i]
                else:
                    ends.append(i)
            self.tokens.append(token)

    def close_document(self):
        self.doc_lengths.append(self.start + len(self.tokens) - self.doc_start)
        self.tokens.append(SEPARATOR)
        self.doc_start = self.start + len(self.tokens)

    def drop_oldest(self) -> int:
        """Forget the oldest closed document; returns its length in tokens."""
        length = self.doc_lengths.popleft()
        new_start = self.start + length + 1
        for i in range(self.start + 1, self.start + length):
            for key in self._keys_before(i, self.start):
                ends = self.table.get(key)
                if ends is None:  # a repeat of a key already cleared
                    continue
                del ends[: bisect.bisect_left(ends, new_start)]  # the oldest positions are in front
                if not ends:
                    del self.table[key]
        del self.tokens[: length + 1]
        self.start = new_start
        return length

    def match(self, tail: list[int], max_tokens: int) -> Proposal:
        """Up to max_tokens tokens (and at most max_spec_factor per matched token) that followed the
        longest match of `tail` (the context's last tokens).

        Key lengths are tried longest first; for the first whose n-gram ending tail occurs, the match
        is the longest (capped at max_match) among its max_candidates most recent occurrences. From
        the occurrences with that match length, the proposal goes on token by token with the one
        most of them continue with (ties: the most recent), keeping only those, while they are at
        least min_prob of the occurrences. A continuation ends at the end of its document.
        """
        tail = tail[-self.config.max_match :]
        if max_tokens < 1:
            return Proposal()
        for k in reversed(self.config.key_lengths):
            ends = self.table.get(hash(tuple(tail[-k:]))) if len(tail) >= k else None
            if ends:
                match_length, starts = self._longest(ends[-self.config.max_candidates :], tail, k)
                if starts:
                    limit = min(max_tokens, math.ceil(self.config.max_spec_factor * match_length))
                    return self._follow(starts, match_length, limit)
        return Proposal()

    def _longest(self, ends: list[int], tail: list[int], least: int) -> tuple[int, list[int]]:
        """The longest match (>= least tokens) of tail's end right before one of `ends`, and the
        indices in self.tokens where those matches' continuations start, most recent first."""
        tokens, best, starts = self.tokens, least, []
        suffix = tail[-best:]
        for i in reversed(ends):
            j = i - self.start
            if j < best or tokens[j - best : j] != suffix:  # cannot tie the best so far
                continue
            m = best
            while m < len(tail) and j - m > 0 and tokens[j - m - 1] == tail[-m - 1]:
                m += 1
            if m > best:
                best, starts, suffix = m, [], tail[-m:]
            starts.append(j)
        return best, starts

    def _follow(self, starts: list[int], match_length: int, max_tokens: int) -> Proposal:
        """Walk the continuations of `starts` (indices, most recent first) by majority."""
        # distinct continuation -> how many matches go on with it (first seen: the most recent)
        followers = Counter(tuple(self.tokens[j : j + max_tokens]) for j in starts)
        num_matches, floor = len(starts), self.config.min_prob * len(starts)
        ids, counts = [], []
        while len(ids) < max_tokens:
            step = len(ids)
            if len(followers) == 1:  # one way on: take it, up to the end of its document
                (continuation, count), = followers.items()
                rest = continuation[step:]
                rest = rest[: rest.index(SEPARATOR)] if SEPARATOR in rest else rest
                ids += rest
                counts += [count] * len(rest)
                break
            votes: dict[int, int] = {}  # next token -> matches going on with it, first seen first
            for continuation, count in followers.items():
                if len(continuation) > step and continuation[step] != SEPARATOR:
                    votes[continuation[step]] = votes.get(continuation[step], 0) + count
            if not votes:
                break
            token = max(votes, key=votes.get)  # the first of equals: the most recent
            count = votes[token]
            if count < floor:
                break
            ids.append(token)
            counts.append(count)
            followers = {c: n for c, n in followers.items() if len(c) > step and c[step] == token}
        return Proposal(ids, match_length, num_matches, counts, self.source) if ids else Proposal()


class GlobalIndex:
    """Recent finished outputs, one TokenIndex per tenant, at most global_max_tokens tokens in all;
    the oldest output (of any tenant) is evicted first. A tenant (an API key, say; None is one of
    its own) only ever matches its own outputs, so no tenant's text reaches another's proposals."""

    def __init__(self, config: SuffixConfig):
        self.config = config
        self.indexes: dict[Hashable, TokenIndex] = {}
        self.order: deque[Hashable] = deque()  # the tenant of each held output, oldest first
        self.num_tokens = 0

    def add(self, token_ids: list[int], tenant: Hashable = None):
        """Hold an output; one longer than the whole budget is not held."""
        if not token_ids or len(token_ids) > self.config.global_max_tokens:
            return
        while self.num_tokens + len(token_ids) > self.config.global_max_tokens:
            self._evict_oldest()
        if tenant not in self.indexes:
            self.indexes[tenant] = TokenIndex(self.config, "global")
        self.indexes[tenant].extend(token_ids)
        self.indexes[tenant].close_document()
        self.order.append(tenant)
        self.num_tokens += len(token_ids)

    def _evict_oldest(self):
        tenant = self.order.popleft()
        index = self.indexes[tenant]
        self.num_tokens -= index.drop_oldest()
        if not index.doc_lengths:
            del self.indexes[tenant]

    def match(self, tail: list[int], max_tokens: int, tenant: Hashable = None) -> Proposal:
        index = self.indexes.get(tenant)
        return index.match(tail, max_tokens) if index is not None else Proposal()


@dataclass
class RequestIndex:
    index: TokenIndex  # its prompt then its committed output, one open document
    tenant: Hashable
    num_prompt_tokens: int


class SuffixProposer:
    """What an engine (or a drafter replica) calls: one index per running request plus the global
    index of finished outputs. Calls per request: add_request, then per step extend (the tokens
    committed) and propose, and finish once. Not thread-safe: one owner calls it."""

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self.global_index = GlobalIndex(self.config)
        self.requests: dict[Hashable, RequestIndex] = {}

    def add_request(self, request_id: Hashable, prompt_ids: list[int], tenant: Hashable = None):
        index = TokenIndex(self.config, "request")
        index.extend(prompt_ids)
        self.requests[request_id] = RequestIndex(index, tenant, len(prompt_ids))

    def extend(self, request_id: Hashable, token_ids: list[int]):
        """The tokens a step committed for the request (after any cut at a stop or max_tokens)."""
        self.requests[request_id].index.extend(token_ids)

    def propose(self, request_id: Hashable, max_tokens: int) -> Proposal:
        """TokenIndex.match of the request's last max_match tokens in its own index and in its
        tenant's global one: the longer match wins, then the higher score, then the request's own.
        Empty (never an error) when neither matches."""
        request = self.requests[request_id]
        tail = request.index.tokens[-self.config.max_match :]
        own = request.index.match(tail, max_tokens)
        shared = self.global_index.match(tail, max_tokens, request.tenant)
        return shared if (shared.match_length, shared.score) > (own.match_length, own.score) else own

    def finish(self, request_id: Hashable, cache_output: bool = True):
        """Free the request; with cache_output its output (never its prompt) joins the global index."""
        request = self.requests.pop(request_id)
        if cache_output:
            self.global_index.add(request.index.tokens[request.num_prompt_tokens :], request.tenant)


# ---- cost measurement (python -m engine.suffix) ------------------------------------------------


@functools.cache
def _phrases(vocab_size: int, num_phrases: int) -> tuple[list[list[int]], list[float]]:
    """A fixed vocabulary of phrases of 2-12 ids, and cumulative Zipf weights (1 / rank) to draw them with."""
    rng = random.Random(f"phrases {vocab_size} {num_phrases}")
    phrases = [[rng.randrange(vocab_size) for _ in range(rng.randint(2, 12))] for _ in range(num_phrases)]
    return phrases, list(itertools.accumulate(1 / (rank + 1) for rank in range(num_phrases)))


def text_like_ids(num_tokens: int, seed: int = 0, vocab_size: int = 32_000, num_phrases: int = 2_000) -> list[int]:
    """Ids that repeat like text: the same phrases for every seed, drawn in a seeded order."""
    phrases, cum_weights = _phrases(vocab_size, num_phrases)
    rng, ids = random.Random(seed), []
    while len(ids) < num_tokens:
        ids += rng.choices(phrases, cum_weights=cum_weights)[0]
    return ids[:num_tokens]


def random_ids(num_tokens: int, seed: int = 0, vocab_size: int = 151_936) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def filled_global_index(config: SuffixConfig, make_ids, output_len: int = 512) -> GlobalIndex:
    """A global index filled past its bound with outputs of output_len tokens (so it has evicted)."""
    index = GlobalIndex(config)
    for seed in range(config.global_max_tokens // output_len + 4):
        index.add(make_ids(output_len, seed=-1 - seed))  # seeds no stream of measure_cost uses
    return index


def measure_cost(batch_size: int = 16, context_len: int = 2048, num_steps: int = 64, max_tokens: int = 16,
                 make_ids=text_like_ids, global_index: GlobalIndex | None = None, first_seed: int = 0) -> dict:
    """Replay one stream of make_ids per request as greedy verification would: each step propose up
    to max_tokens, accept the prefix the stream agrees with, and extend by it plus one token.
    Returns microseconds of propose + extend per request per step, the mean accepted tokens per
    step, and milliseconds per request of add_request (a context_len-token prompt) and of finish
    (its output joins the global index, evicting). The global index: full, filled here if not given.
    Streams use seeds first_seed.. : repeats over one global index need new ones (it holds the old)."""
    if global_index is None:
        global_index = filled_global_index(SuffixConfig(), make_ids)
    proposer = SuffixProposer(global_index.config)
    proposer.global_index = global_index
    num_ids = context_len + (max_tokens + 1) * num_steps
    streams = [make_ids(num_ids, seed=first_seed + i) for i in range(batch_size)]
    begin = time.perf_counter()
    for request_id, ids in enumerate(streams):
        proposer.add_request(request_id, ids[:context_len])
    add_s = time.perf_counter() - begin
    positions, num_accepted, step_s = [context_len] * batch_size, 0, 0.0
    for _ in range(num_steps):
        for request_id, ids in enumerate(streams):
            position, begin = positions[request_id], time.perf_counter()
            proposal = proposer.propose(request_id, max_tokens)
            step_s += time.perf_counter() - begin
            accepted = 0
            while accepted < len(proposal.token_ids) and proposal.token_ids[accepted] == ids[position + accepted]:
                accepted += 1
            begin = time.perf_counter()
            proposer.extend(request_id, ids[position : position + accepted + 1])
            step_s += time.perf_counter() - begin
            positions[request_id] += accepted + 1
            num_accepted += accepted
    begin = time.perf_counter()
    for request_id in range(batch_size):
        proposer.finish(request_id)
    finish_s = time.perf_counter() - begin
    num_calls = num_steps * batch_size
    return {"step_us": 1e6 * step_s / num_calls, "mean_accepted": num_accepted / num_calls,
            "add_request_ms": 1e3 * add_s / batch_size, "finish_ms": 1e3 * finish_s / batch_size}


def measure_memory(make_ids=text_like_ids, config: SuffixConfig | None = None, context_len: int = 2048) -> dict:
    """Traced bytes of a global index filled to its bound, and of one request's index of context_len tokens."""
    config = config or SuffixConfig()
    tracemalloc.start()
    index = filled_global_index(config, make_ids)
    global_bytes = tracemalloc.get_traced_memory()[0]
    request = TokenIndex(config, "request")
    request.extend(make_ids(context_len))
    request_bytes = tracemalloc.get_traced_memory()[0] - global_bytes
    tracemalloc.stop()
    return {"global_mb": global_bytes / 2**20, "global_tokens": index.num_tokens, "request_mb": request_bytes / 2**20}


def print_costs(config: SuffixConfig | None = None, repeats: int = 3):
    """Medians of `repeats` runs of measure_cost at batch 1 and 16 (2,048-token prompts), then memory."""
    config = config or SuffixConfig()
    print(config)
    for name, make_ids in (("text-like", text_like_ids), ("random", random_ids)):
        global_index = filled_global_index(config, make_ids)
        for batch_size in (1, 16):
            runs = [measure_cost(batch_size, make_ids=make_ids, global_index=global_index,
                                 first_seed=1000 * batch_size + 100 * repeat)
                    for repeat in range(repeats)]
            cost = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            print(f"{name:9} batch {batch_size:2}: propose+extend {cost['step_us']:5.1f} us/request/step "
                  f"({batch_size * cost['step_us'] / 1e3:.2f} ms/step), accepted {cost['mean_accepted']:4.2f}/step; "
                  f"per request: add_request {cost['add_request_ms']:4.1f} ms, finish {cost['finish_ms']:4.1f} ms")
        memory = measure_memory(make_ids, config)
        print(f"{name:9} memory: global index {memory['global_mb']:.1f} MiB for {memory['global_tokens']:,} tokens "
              f"({2**20 * memory['global_mb'] / memory['global_tokens']:.0f} B/token), "
              f"one 2,048-token request {memory['request_mb']:.2f} MiB")


if __name__ == "__main__":
    print_costs()
