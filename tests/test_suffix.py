"""The suffix proposer: what it proposes on hand-made sequences, incremental indexing, the global
index's bound, eviction and tenant isolation, and no blow-up on a request that repeats one token."""

import random
import time
import tracemalloc

import pytest

from engine.suffix import (GlobalIndex, Proposal, SuffixConfig, SuffixProposer, TokenIndex, filled_global_index,
                           measure_cost, text_like_ids)

LONG = SuffixConfig(max_spec_factor=100.0)  # proposals not capped by match length


def proposer_with(prompt_ids, config=LONG, request_id=0, tenant=None):
    proposer = SuffixProposer(config)
    proposer.add_request(request_id, prompt_ids, tenant)
    return proposer


def relative_table(index: TokenIndex) -> dict:
    """The table with positions relative to the buffer's start: equal for equal held documents."""
    return {key: [i - index.start for i in ends] for key, ends in index.table.items()}


def test_a_repeated_phrase_is_proposed():
    proposal = proposer_with([10, 11, 12, 13, 14, 15, 16, 17, 50, 51, 10, 11, 12, 13]).propose(0, 4)
    assert proposal.token_ids == [14, 15, 16, 17]
    assert (proposal.match_length, proposal.num_matches, proposal.counts) == (4, 1, [1, 1, 1, 1])
    assert proposal.source == "request" and proposal.score == 4.0


def test_the_longest_match_wins_over_shorter_more_frequent_ones():
    # "1 7 8 9" once -> 100; "7 8 9" three times, more recently -> 200
    ids = [1, 7, 8, 9, 100, 2, 7, 8, 9, 200, 3, 7, 8, 9, 200, 5, 7, 8, 9, 200, 1, 7, 8, 9]
    proposal = proposer_with(ids).propose(0, 1)
    assert proposal.token_ids == [100] and proposal.match_length == 4


def test_a_long_match_is_found_behind_many_recent_short_ones():
    # "9" occurs 20 times after the long match, more than the 4 candidates a key may examine
    ids = [1, 2, 3, 4, 9, 100] + [t for x in range(20) for t in (50 + x, 9, 200 + x)] + [1, 2, 3, 4, 9]
    proposal = proposer_with(ids, SuffixConfig(max_candidates=4)).propose(0, 1)
    assert proposal.token_ids == [100] and proposal.match_length == 5


def test_the_more_frequent_continuation_wins_then_the_most_recent():
    # three matches of length 3 ("7 8 9"): 200 follows two of them, 100 the most recent one
    ids = [1, 7, 8, 9, 200, 2, 7, 8, 9, 200, 3, 7, 8, 9, 100, 6, 7, 8, 9]
    proposal = proposer_with(ids).propose(0, 1)
    assert proposal.token_ids == [200]
    assert (proposal.match_length, proposal.num_matches, proposal.counts) == (3, 3, [2])
    tie = proposer_with([1, 7, 8, 9, 100, 2, 7, 8, 9, 200, 6, 7, 8, 9]).propose(0, 1)
    assert tie.token_ids == [200] and tie.counts == [1]


def test_a_walk_stops_where_too_few_matches_agree():
    # twelve different continuations of "9": none reaches min_prob (10%) of the matches
    ids = [t for x in range(12) for t in (9, 100 + x)] + [9]
    assert proposer_with(ids).propose(0, 4) == Proposal()
    assert proposer_with(ids, SuffixConfig(min_prob=0.0, max_spec_factor=100.0)).propose(0, 1).token_ids == [111]


def test_incremental_indexing_equals_indexing_at_once():
    rng = random.Random(0)
    ids = [rng.randrange(6) for _ in range(600)]  # a small vocabulary: many repeats and long matches
    whole, pieces = TokenIndex(LONG, "request"), TokenIndex(LONG, "request")
    whole.extend(ids)
    done = 0
    while done < len(ids):
        step = rng.randint(1, 7)
        pieces.extend(ids[done : done + step])
        done += step
    assert pieces.tokens == whole.tokens and pieces.table == whole.table
    for n in (1, 5, 16):
        assert pieces.match(ids, n) == whole.match(ids, n)
    assert whole.match(ids, 16).token_ids


def test_an_empty_or_short_context_or_no_match_gives_no_proposal():
    proposer = SuffixProposer()
    for request_id, prompt_ids in enumerate([[], [5], [5, 6], [5, 6, 7, 8, 9]]):
        proposer.add_request(request_id, prompt_ids)
        assert proposer.propose(request_id, 8) == Proposal()
    proposer.add_request("repeats", [1, 2, 3, 1, 2, 3])
    assert proposer.propose("repeats", 0) == Proposal()
    assert proposer.propose("repeats", 3).token_ids == [1, 2, 3]


def test_max_tokens_and_the_spec_factor_bound_the_length():
    phrase = list(range(100, 140))
    proposer = proposer_with(phrase + [1] + phrase)  # the tail matches 32 (max_match), 41 tokens follow
    for n in range(0, 41):
        assert proposer.propose(0, n).token_ids == (phrase + [1] + phrase)[40 : 40 + n]
    short = proposer_with([1, 2, 3, 4, 5, 6, 9, 1, 2], SuffixConfig(max_spec_factor=1.5))
    assert short.propose(0, 8).token_ids == [3, 4, 5]  # a 2-token match proposes ceil(1.5 * 2)


def test_the_global_index_holds_outputs_only_and_the_request_prefers_the_longer_match():
    proposer = proposer_with([40, 41, 42, 43, 44], SuffixConfig(), request_id="done")
    proposer.extend("done", [20, 21, 22, 23, 24, 25, 26, 27])
    proposer.finish("done")
    proposer.add_request("prompt", [1, 40, 41, 42])
    assert proposer.propose("prompt", 4) == Proposal()  # prompts are never cached
    proposer.add_request("output", [3, 21, 22, 23, 24])
    proposal = proposer.propose("output", 4)
    assert proposal.token_ids == [25, 26, 27] and proposal.source == "global"  # stops at the output's end
    proposer.add_request("own", [9, 23, 24, 99, 5, 9, 23, 24])  # own match of 3 beats the global one of 2
    assert proposer.propose("own", 1).token_ids == [99] and proposer.propose("own", 1).source == "request"
    proposer.finish("own", cache_output=False)
    assert proposer.global_index.num_tokens == 8


def test_the_global_index_evicts_the_oldest_outputs_within_its_bound():
    config = SuffixConfig(global_max_tokens=12)
    index = GlobalIndex(config)
    for output in ([1, 2, 3, 4, 5], [11, 12, 13, 14, 15], [21, 22, 23, 24, 25]):
        index.add(output)
    assert index.num_tokens == 10
    assert index.match([1, 2, 3], 2) == Proposal()
    assert index.match([11, 12, 13], 2).token_ids == [14, 15]
    index.add(list(range(13)))  # longer than the whole budget: not held, nothing evicted
    assert index.num_tokens == 10 and index.match([22, 23], 2).token_ids == [24, 25]


def test_eviction_leaves_exactly_what_indexing_the_held_outputs_gives():
    rng = random.Random(1)
    config = SuffixConfig(global_max_tokens=500)
    index, held = GlobalIndex(config), []
    for _ in range(200):
        output = [rng.randrange(8) for _ in range(rng.randint(1, 60))]
        index.add(output)
        held = (held + [output])[-len(index.order) :]
        assert index.num_tokens == sum(map(len, held)) <= config.global_max_tokens
    fresh = GlobalIndex(config)
    for output in held:
        fresh.add(output)
    assert index.indexes[None].tokens == fresh.indexes[None].tokens
    assert relative_table(index.indexes[None]) == relative_table(fresh.indexes[None])


def test_tenants_never_see_each_others_outputs():
    proposer = SuffixProposer(SuffixConfig(global_max_tokens=10))
    proposer.add_request("a", [1, 2], tenant="key-A")
    proposer.extend("a", [30, 31, 32, 33, 34, 35])
    proposer.finish("a")
    for request_id, tenant in (("b", "key-B"), ("anonymous", None), ("a2", "key-A")):
        proposer.add_request(request_id, [7, 30, 31, 32], tenant)
    assert proposer.propose("b", 4) == Proposal() and proposer.propose("anonymous", 4) == Proposal()
    assert proposer.propose("a2", 4).token_ids == [33, 34, 35]
    proposer.extend("b", [60, 61, 62, 63, 64, 65])
    proposer.finish("b")  # evicts A's output: the oldest, and over the budget together
    assert list(proposer.global_index.indexes) == ["key-B"]
    assert proposer.propose("a2", 4) == Proposal()


def test_a_request_repeating_one_token_stays_cheap():
    config = SuffixConfig(global_max_tokens=4000)
    tracemalloc.start()
    begin = time.perf_counter()
    proposer = proposer_with([7] * 5000, config)
    for _ in range(200):
        proposal = proposer.propose(0, 16)
        proposer.extend(0, proposal.token_ids + [7])
    proposer.finish(0)  # 3,400 sevens into the global index, then evicted by 4,000 eights
    proposer.global_index.add([8] * 4000)
    seconds, peak = time.perf_counter() - begin, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert proposal.token_ids == [7] * 16 and proposal.match_length == config.max_match
    assert proposer.global_index.indexes[None].tokens[:2] == [8, 8]
    assert seconds < 1.0, seconds
    assert peak < 4 * 2**20, peak  # ~40 B per held position (3 per token): linear, never quadratic


def test_measure_cost_runs():
    global_index = filled_global_index(SuffixConfig(global_max_tokens=2048), text_like_ids)
    cost = measure_cost(batch_size=2, context_len=256, num_steps=4, global_index=global_index)
    assert cost["step_us"] > 0 and cost["finish_ms"] > 0 and cost["mean_accepted"] > 0
    assert global_index.num_tokens <= 2048


def test_bad_configs_are_refused():
    for bad in ({"key_lengths": (4, 1)}, {"key_lengths": ()}, {"key_lengths": (1, 64)}, {"min_prob": 2.0},
                {"max_candidates": 0}, {"max_spec_factor": 0.0}):
        with pytest.raises(ValueError):
            SuffixConfig(**bad)
