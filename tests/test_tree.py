"""Token trees (engine/tree.py): the tree is the best one for its size, the target scores each node as it
would score that node's path as a chain, the accepted path's cache and features are the chain's, and the
engine's greedy output stays the target's own, alone and in batches mixed with suffix drafts and sampling.
Tiny random models, float32; one check on the default model and the shipped drafter (marked slow).
"""

import itertools
import random
from pathlib import Path

import pytest
import torch

from engine.engine import Engine, SamplingParams
from engine.policy import AdaptiveBlockPolicy, CostModel
from engine.tree import Tree, TokenTree, build_tree, outcomes, walk
from test_engine import TINY, AlternateSources, greedy_outputs, random_prompts, repetitive_prompts, tiny_models


def random_top(depth, k, seed):
    rng = random.Random(seed)
    probs = [sorted((rng.random() for _ in range(k)), reverse=True) for _ in range(depth)]
    ids = [rng.sample(range(100), k) for _ in range(depth)]
    return ids, probs


def best_value(probs, num_nodes):
    """Brute force: the largest sum of path values over sets of num_nodes rank paths closed under prefixes."""
    depth, k = len(probs), len(probs[0])
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    value = lambda p: torch.tensor([probs[d][r] for d, r in enumerate(p)]).prod().item()
    best = 0.0
    for chosen in itertools.combinations(paths, num_nodes):
        if all(p[:-1] in chosen or len(p) == 1 for p in chosen):
            best = max(best, sum(value(p) for p in chosen))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_build_tree_takes_the_likeliest_paths_first(seed):
    ids, probs = random_top(depth=3, k=3, seed=seed)
    for n in range(1, 6):
        tree = build_tree(ids, probs, n)
        assert len(tree.ids) == n and all(p < j + 1 for j, p in enumerate(tree.parents))  # parents first
        values = []
        for j, (p, d) in enumerate(zip(tree.parents, tree.depths)):
            assert d == (tree.depths[p - 1] + 1 if p else 1)
            assert tree.ids[j] in ids[d - 1] and tree.probs[j] == probs[d - 1][ids[d - 1].index(tree.ids[j])]
            values.append((values[p - 1] if p else 1.0) * tree.probs[j])
        assert sum(values) == pytest.approx(best_value(probs, n))
        assert tree.first(n - 1).ids == build_tree(ids, probs, n - 1).ids  # a smaller budget is a prefix


def test_build_tree_is_a_chain_for_a_sure_drafter_and_stops_where_nothing_was_drafted():
    ids = [[5, 6], [7, 8], [9, 10]]
    assert build_tree(ids, [[0.9, 0.05], [0.9, 0.05], [0.9, 0.05]], 3).is_chain()
    tree = build_tree(ids, [[0.5, 0.4], [0.5, 0.4], [0.0, 0.0]], 10)  # position 3 not drafted
    assert len(tree.ids) == 6 and max(tree.depths) == 2
    assert build_tree(ids, [[0.0, 0.0]] * 3, 4).ids == []


def test_walk_follows_what_the_target_predicts_and_outcomes_name_the_tested_nodes():
    #            root(0) -> a(1) -> c(3)
    #                    -> b(2) -> d(4)
    tree = Tree(ids=[11, 12, 13, 14], parents=[0, 0, 1, 2], probs=[0.5, 0.3, 0.6, 0.2], depths=[1, 1, 2, 2])
    block = [10] + tree.ids
    assert walk(tree.parents, block, predicted=[12, 0, 14, 0, 99]) == [0, 2, 4]
    assert walk(tree.parents, block, predicted=[42, 0, 0, 0, 0]) == [0]
    assert outcomes(tree, [12, 14, 99]) == [(0, False), (1, True), (3, True)]  # root's children, then b's
    assert outcomes(tree, [42]) == [(0, False), (1, False)]


def test_tree_verify_scores_each_node_as_its_path_and_keeps_the_accepted_path():
    """One target pass over a tree gives each node the logits and features its root-to-node path gets as a
    chain; after KVCache.keep the accepted path's keys and values are the chain's, at the chain's positions."""
    target, _ = tiny_models(seed=3)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    tree = Tree(ids=[6, 7, 2, 3, 1], parents=[0, 0, 1, 1, 3], probs=[0.0] * 5, depths=[1, 1, 2, 2, 3])
    block = torch.tensor([[0] + tree.ids])
    n, q = prompt.shape[1], block.shape[1]

    def prefilled():
        cache = target.new_cache(1, 64)
        target(prompt, torch.arange(n)[None], cache, [0], n)
        return cache

    cache = prefilled()
    layers = (0, 2)
    layout = TokenTree.of([tree.parents], q, "cpu")
    logits, features = target(block, torch.arange(n, n + q)[None], cache, [0], n + q, layers, tree=layout)
    chain_cache = prefilled()
    for j in range(q):
        path = [j]
        while path[0]:
            path.insert(0, tree.parents[path[0] - 1])
        ids = block[:, path]
        chain_logits, chain_features = target(ids, torch.arange(n, n + len(path))[None], chain_cache, [0],
                                              n + len(path), layers)
        torch.testing.assert_close(logits[0, j], chain_logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(features[0, j], chain_features[0, -1], atol=1e-4, rtol=1e-4)
    path = [0, 1, 3, 5]  # root, 6, 2, 1: the last path run as a chain, so the chain cache holds it now
    cache.keep(0, n, path)
    for k in (cache.k, cache.v):
        ref = chain_cache.k if k is cache.k else chain_cache.v
        torch.testing.assert_close(k[:, 0, :, : n + len(path)], ref[:, 0, :, : n + len(path)], atol=1e-4, rtol=1e-4)


def count_tree_rows(engine):
    """Wrap engine.branch to count the rows it verifies as trees."""
    seen, branch = [0], engine.branch

    def counting(draft, trees):
        out = branch(draft, trees)
        seen[0] += sum(t is not None for t in out.trees or ())
        return out

    engine.branch = counting
    return seen


@pytest.mark.parametrize("block_size", [3, 4, 8])
def test_tree_engine_greedy_equals_autoregressive(block_size):
    target, drafter = tiny_models(seed=1)
    prompts = random_prompts(6, TINY.vocab_size, seed=1)
    reference = greedy_outputs(Engine(target), prompts, 30)
    engine = Engine(target, drafter, max_slots=3, draft_tree=True)
    trees = count_tree_rows(engine)
    requests = engine.generate_batch(prompts, SamplingParams(max_tokens=30, block_size=block_size))
    assert [r.output_ids for r in requests] == reference
    assert trees[0] > 10
    assert engine.target_cache.num_used == engine.draft_cache.num_used == 0


def test_adaptive_policy_trims_trees_and_stays_exact():
    """The adaptive policy costs each tree's nodes by their calibrated reach, verifies a prefix of them and
    learns from the nodes the target tested; output stays the target's. Costs are set, not profiled (a
    step 10 ms plus 0.5 ms a position): wide verifies pay, whatever this machine's timing noise."""
    target, drafter = tiny_models(seed=2)
    grid = [1, 2, 3, 4, 8]
    costs = CostModel([1, 2, 4], grid, [[(10 + 0.5 * n * b) / 1e3 for b in grid] for n in (1, 2, 4)])
    policy = AdaptiveBlockPolicy(costs, block_sizes=grid)
    prompts = random_prompts(6, TINY.vocab_size, seed=2)
    reference = greedy_outputs(Engine(target), prompts, 30)
    engine = Engine(target, drafter, max_slots=4, policy=policy, draft_tree=True)
    trees = count_tree_rows(engine)
    assert greedy_outputs(engine, prompts, 30) == reference
    assert trees[0] > 0 and sum(policy.calibration.reached) > 0


def test_mixed_batch_of_trees_suffix_drafts_and_sampling_gives_each_request_what_it_gets_alone():
    """Every step, some rows verify suffix drafts, the others the drafter's trees (greedy) or chains
    (seeded sampling): each request's output is what it gets alone, and what plain decoding gives it."""
    from engine.suffix import SuffixProposer

    target, drafter = tiny_models(seed=5)
    prompts = repetitive_prompts(6, TINY.vocab_size, seed=5)
    params = [SamplingParams(max_tokens=30) if i % 3 else SamplingParams(max_tokens=30, temperature=0.8, seed=i)
              for i in range(len(prompts))]
    make = lambda slots: Engine(target, drafter, max_slots=slots, policy=AlternateSources(4), suffix=SuffixProposer(),
                                draft_tree=True)
    alone = [make(1).generate_batch([p], [q])[0].output_ids for p, q in zip(prompts, params)]
    engine = make(6)
    trees = count_tree_rows(engine)
    outputs = [r.output_ids for r in engine.generate_batch(prompts, params)]
    assert outputs == alone == [Engine(target).generate_batch([p], [q])[0].output_ids for p, q in zip(prompts, params)]
    assert trees[0] > 0 and engine.stats.of("suffix").num_drafts > 0



@pytest.mark.slow
def test_trees_are_accepted_further_than_chains_with_the_shipped_drafter():
    """The default model and the shipped drafter (block 8 verified whole; `auto`: bf16 where the CPU has it
    natively, else float32): trees of the same width commit more tokens per step than chains on held-out
    chat prompts."""
    from dataclasses import replace

    from engine.config import EngineConfig, build_engine, load_models
    from engine.prompts import read_prompts

    config = EngineConfig(dtype="auto", policy="fixed", block_size=8, proposers="dflash", max_slots=4)
    loaded = load_models(config)
    held_out = Path(__file__).resolve().parent.parent / "docs/train/held-out-chat.jsonl"
    prompts = [p.token_ids(loaded.tokenizer) for p in read_prompts(str(held_out))[:4]]
    mal = {}
    for tree in (False, True):
        engine = build_engine(replace(config, draft_tree=tree), loaded)
        engine.generate_batch(prompts, SamplingParams(max_tokens=48))
        mal[tree] = engine.stats.mean_acceptance_length
    assert mal[True] > 1.1 * mal[False], mal
