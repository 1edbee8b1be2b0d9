"""Training with online features (engine/train_online.py) and the prepared GPU run (engine/gpu_run.py):
batched generation equals the engine's greedy output, the target pass gives each sequence's own
features, sampled replies are labelled with the greedy chain, the chunked loss equals the plain one,
traffic requests train as their chat template gives them, and the whole GPU run goes through on the CPU
with a tiny random target."""

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from engine.datagen import (HELD_OUT_PROMPTS, NUM_HELD_OUT, TRAIN_PROMPTS, generate_responses, read_prompt_list,
                            rows_that_fit)
from engine.engine import Engine, SamplingParams
from engine.model import ModelConfig, TargetModel
from engine.train import Sequence, loss_and_accuracy, make_batch, position_weights
from engine.train_online import Reply, chunked_loss, target_pass

ROOT = Path(__file__).resolve().parent.parent
TINY = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                   head_dim=8, max_position_embeddings=512)


def tiny_target(seed=0):
    torch.manual_seed(seed)
    target = TargetModel(TINY).eval()
    for p in target.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.5)
    return target


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 40, (int(torch.randint(2, 15, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_batched_generation_equals_the_engines_greedy_output():
    """Rows of different lengths stepping in lockstep (batches of 3 over 7 prompts, prefill groups of
    at most 20 positions) give each prompt the engine's own greedy reply, cut after a stop token."""
    target, ps = tiny_target(), prompts(7)
    free = [r.output_ids for r in Engine(target, max_slots=7, max_len=64).generate_batch(ps, SamplingParams(max_tokens=12))]
    stop = free[0][3]  # a token one reply reaches mid-way
    engine = Engine(target, max_slots=7, max_len=64, stop_token_ids=(stop,))
    reference = [r.output_ids for r in engine.generate_batch(ps, SamplingParams(max_tokens=12))]
    ours = generate_responses(target, ps, max_new_tokens=12, batch_size=3, stop_token_ids=(stop,), prefill_tokens=20)
    assert ours == reference
    assert len(ours[0]) <= 4 and ours[0][-1] == stop


def test_generation_stops_starting_batches_after_the_deadline():
    target, ps = tiny_target(), prompts(6)
    out = generate_responses(target, ps, max_new_tokens=4, batch_size=2, deadline=0.0)
    assert len(out) == 2  # the first batch always runs


def test_reply_rows_are_as_many_as_the_free_memory_holds():
    """On a GPU the reply batch shrinks to the rows whose KV cache and logits fit 60% of the free memory:
    a row's bytes are what the cache allocates for it."""
    target = tiny_target()
    cache = target.new_cache(1, 99)
    per_row = cache.k.nbytes + cache.v.nbytes + TINY.vocab_size * 4  # float32
    assert rows_that_fit(target, 99, free_bytes=10 * per_row / 0.6, most=2048) == 10
    assert rows_that_fit(target, 99, free_bytes=10 * per_row / 0.6 - 1, most=2048) == 9
    assert rows_that_fit(target, 99, free_bytes=10 * per_row, most=4) == 4
    assert rows_that_fit(target, 99, free_bytes=0, most=4) == 1


def test_sampled_generation_is_seeded():
    target, ps = tiny_target(), prompts(4)
    runs = [generate_responses(target, ps, max_new_tokens=8, batch_size=4, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


def test_target_pass_gives_each_sequence_its_own_features_and_greedy_choices():
    """Padded groups (at most 24 positions, 3 slots) give what a pass over each sequence alone gives."""
    target = tiny_target()
    replies = [Reply(p + [7, 8, 9], len(p), "sharegpt") for p in prompts(5, seed=1)]
    cache = target.new_cache(3, 64)
    seqs = target_pass(target, replies, [1, 3], cache, budget_tokens=24)
    assert [s.tokens.tolist() for s in seqs] == [r.tokens for r in replies]
    for r, s in zip(replies, seqs):
        n = len(r.tokens)
        logits, features = target(torch.tensor([r.tokens]), torch.arange(n)[None], target.new_cache(1, 64), [0], n, [1, 3])
        torch.testing.assert_close(s.features, features[0], atol=1e-4, rtol=1e-4)  # padding changes matmul blocking
        assert s.greedy[1:].tolist() == logits[0, :-1].argmax(-1).tolist()


def test_sampled_replies_are_labelled_with_the_greedy_chain():
    """A block's labels are the target's greedy choices while the reply follows them; past the first
    sampled token that is not the greedy one, the block has no labels (the chain from its anchor broke)."""
    tokens = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    greedy = torch.tensor([1, 2, 3, 4, 9, 6, 7, 8])  # the reply left the greedy chain at position 4
    s = Sequence(tokens, 2, torch.zeros(8, 4), greedy=greedy)
    batch = make_batch([s], [torch.tensor([2, 4])], 4, mask_id=0)
    assert batch.labels.tolist() == [[4, 9, -100], [6, 7, 8]]
    assert batch.soft_ids is None
    plain = make_batch([Sequence(tokens, 2, torch.zeros(8, 4))], [torch.tensor([2])], 4, mask_id=0)
    assert plain.labels.tolist() == [[4, 5, 6]]


def test_chunked_loss_equals_the_plain_loss_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 15, 16, generator=g, requires_grad=True)
    head = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (6, 15), generator=g)
    labels[0, 10:] = -100
    weights = position_weights(16)
    batch = make_batch([Sequence(torch.zeros(40, dtype=torch.long), 0, torch.zeros(40, 4))], [torch.arange(6)], 16, 0)
    batch.labels = labels
    full = torch.cat([torch.zeros(6, 1, 16), hidden], 1)
    plain, accuracy = loss_and_accuracy(full, head, None, batch, weights, 0.0)
    plain.backward()
    expected = hidden.grad.clone()
    hidden.grad = None
    ours, hits, counted = chunked_loss(hidden, head, labels, weights, rows_per_chunk=7)
    ours.backward()
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(hidden.grad, expected)
    torch.testing.assert_close(hits.float() / counted, accuracy)


def test_committed_prompt_lists():
    """The held-out list is the held-out split's first 128 prompts (of at most 256 tokens): the data every
    drafter is scored on; the training list never shares a conversation with it."""
    held = read_prompt_list(HELD_OUT_PROMPTS)
    assert len(held) == NUM_HELD_OUT and all(p.held_out for p in held)
    assert {p.source for p in held} == {"sharegpt", "code"}
    train = read_prompt_list(TRAIN_PROMPTS)
    assert len(train) > 40_000 and not any(p.held_out for p in train)
    assert {p.source for p in train} == {"sharegpt", "sharegpt-turns", "code", "code-methods"}
    held_conversations = {p.id.split("#")[0] for p in held}
    assert not held_conversations & {p.id.split("#")[0] for p in train}


@pytest.mark.slow
def test_gpu_run_goes_through_on_the_cpu(tmp_path):
    """scripts/gpu_run.sh, every phase, on the CPU: a tiny random target with the default model's tokenizer
    (the real prompt lists, traffic requests and chat template), a 25-second training budget, small cost shapes.
    Each phase ends ok, the run trains and saves a drafter, evaluates held-out tau (chat, code, agent, RAG), and
    times every phase."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", "scripts/gpu_run.sh", "check,train,costs", "--device", "cpu", "--tiny",
                        "--train-budget", "25", "--lr", "1e-3", "--seqs-per-step", "3", "--traffic-share", "0.3"],
                       cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = json.loads((tmp_path / "phases.json").read_text())
    assert list(record["phases"]) == ["check", "train", "costs"]
    assert all(p["ok"] and p["seconds"] > 0 for p in record["phases"].values())
    assert record["phases"]["check"]["result"]["bench"]["returncode"] == 0
    train = record["phases"]["train"]["result"]
    assert train["replies"] > 0 and train["steps"] > 0 and 1 <= train["final"]["chat"]["tau"] <= 16
    assert (train["lr"], train["seqs_per_step"], train["traffic_share"]) == (1e-3, 3, 0.3)  # the flags reach the recipe
    traffic = train["by_source"]["prompts"]["traffic"]  # 8 of the committed traffic requests (--tiny)
    assert traffic["kept"] + traffic["dropped"] == 8 and traffic["kept"] > 0
    assert all(1 <= train["final"][kind]["tau"] <= 16 for kind in ("chat", "code", "agent", "rag"))
    assert (tmp_path / "train" / "drafter" / "model.safetensors").exists()
    vocab = json.loads((tmp_path / "train" / "drafter" / "draft_vocab.json").read_text())
    assert len(vocab) == len(set(vocab)) == online_config().draft_vocab  # the engine drafts from these
    assert 1 <= train["final"]["chat"]["tau_full_head"] <= 16
    assert (tmp_path / "train" / "curves.png").stat().st_size > 0
    costs = record["phases"]["costs"]["result"]["rows"]
    assert set(costs) == {"1", "8", "32"} and all(row["ceiling_vs_ar"] > 0 for row in costs.values())
    assert all(row["ar_graph"] > 0 and row["verify_graph"] > 0 for row in costs.values())


def test_each_step_draws_its_share_of_traffic_replies():
    """A step's sequences: round(share * n) traffic replies, the rest the others; one pool empty, all from the other."""
    import torch

    from engine.train_online import draw

    traffic, other = [f"t{i}" for i in range(5)], [f"o{i}" for i in range(50)]
    g = torch.Generator().manual_seed(0)
    picks = draw((traffic, other), 20, 0.15, g)
    assert len(picks) == 20 and sum(p in traffic for p in picks) == 3 and all(p in traffic + other for p in picks)
    assert all(p in other for p in draw(([], other), 20, 0.15, g))
    assert all(p in traffic for p in draw((traffic, []), 20, 0.15, g))
    assert all(p in other for p in draw((traffic, other), 20, 0.0, g))


def test_gpu_run_refuses_a_traffic_share_outside_0_to_1(capsys):
    from engine import gpu_run

    with pytest.raises(SystemExit):
        gpu_run.parse_args(["train", "--traffic-share", "1.5"])
    assert "--traffic-share must be between 0 and 1, got 1.5" in capsys.readouterr().err


def online_config():
    from engine.train_online import OnlineConfig

    return OnlineConfig(out="unused")


def test_the_draft_vocabulary_is_the_init_drafters_or_the_most_frequent_reply_tokens():
    from engine.train_online import draft_vocabulary

    counts = torch.tensor([5, 0, 9, 1, 7])
    plain = types.SimpleNamespace(draft_vocab=None)
    assert draft_vocabulary(plain, counts, 3).tolist() == [0, 2, 4]  # the 3 most frequent, in id order
    assert draft_vocabulary(plain, counts, 0) is None  # the whole vocabulary
    assert draft_vocabulary(types.SimpleNamespace(draft_vocab=torch.tensor([1, 3])), counts, 3).tolist() == [1, 3]


def test_a_run_whose_bf16_steps_are_not_finite_goes_on_in_float32(tmp_path, monkeypatch):
    """A drafter whose fc gives NaN under bf16 autocast (a mock of a kernel failing on one device: the
    first GPU run's loss went NaN and the CPU cannot reproduce it) must not end the run: after
    BF16_STRIKES skipped steps it trains in float32, and the log says where the forward first went
    non-finite."""
    from engine import gpu_run, train_online as online

    make = online.make_drafter

    def nan_in_bf16(cfg, target_config):
        drafter = make(cfg, target_config)
        forward = drafter.fc.forward
        drafter.fc.forward = lambda x: forward(x) * (torch.nan if torch.is_autocast_enabled(x.device.type) else 1.0)
        return drafter

    monkeypatch.setattr(online, "make_drafter", nan_in_bf16)
    cfg = online.OnlineConfig(out=str(tmp_path / "run"), target=str(gpu_run.tiny_target(tmp_path / "tiny")),
                              device="cpu", bf16=True, budget_s=30, generate_batch=16, seqs_per_step=4, anchors=16,
                              held_out_limit=2, prompt_limit=32, traffic_limit=8, max_new_tokens=16, eval_every_s=60,
                              reserve_s=3, intermediate_size=0, warmup_steps=2)
    summary = online.train_online(cfg, quiet=True)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    skipped = [e for e in log if "dropped" in e]
    assert len(skipped) == online.BF16_STRIKES and "off" in skipped[-1]["bf16"]
    assert skipped[0]["first_non_finite"] == "module fc (its input finite)"
    assert summary["bf16_off_at_step"] == 0 and summary["steps"] > 0
    assert all(math.isfinite(e["loss"]) for e in log if "loss" in e and "dropped" not in e)


def test_traffic_requests_train_as_their_chat_template_gives_them(tmp_path, monkeypatch):
    """A traffic file's requests reach the target as `Prompt.token_ids` gives them (the chat template's system
    prompt included), up to max_prompt_tokens (768: past the text list's 512) and no further, as source
    "traffic"; held-out agent and RAG tau are scored beside chat and code, in the log and the summary."""
    from engine import gpu_run, train_online as online
    from engine.datagen import TRAFFIC_PROMPTS
    from engine.loading import load_tokenizer
    from engine.prompts import read_prompts, write_prompts

    target = gpu_run.tiny_target(tmp_path / "tiny")
    tokenizer = load_tokenizer(target)
    committed = sorted(read_prompts(TRAFFIC_PROMPTS), key=lambda p: len(p.token_ids(tokenizer)))
    chosen = committed[:2] + [p for p in committed if 512 < len(p.token_ids(tokenizer)) <= 768][-1:] + committed[-1:]
    lengths = [len(p.token_ids(tokenizer)) for p in chosen]
    assert lengths[2] > 512 and lengths[3] > 768  # one the old limit left out, one the new one does
    write_prompts(tmp_path / "traffic.jsonl", chosen)
    seen = []
    generate = online.generate_responses
    monkeypatch.setattr(online, "generate_responses",
                        lambda target, prompts, **kw: seen.extend(prompts) or generate(target, prompts, **kw))
    cfg = online.OnlineConfig(out=str(tmp_path / "run"), target=str(target), traffic_prompts=str(tmp_path / "traffic.jsonl"),
                              device="cpu", bf16=False, budget_s=12, generate_share=0.2, generate_batch=32,
                              seqs_per_step=2, anchors=8, held_out_limit=2, prompt_limit=8, max_new_tokens=16,
                              eval_every_s=60, reserve_s=3, intermediate_size=0)
    summary = online.train_online(cfg, quiet=True)
    expected = [p.token_ids(tokenizer) for p in chosen]
    assert tokenizer.decode(expected[0]).startswith("<|im_start|>system\n")
    assert all(ids in seen for ids in expected[:3]) and expected[3] not in seen
    assert summary["by_source"]["prompts"]["traffic"] == {"kept": 3, "dropped": 1}
    assert summary["by_source"]["replies"]["traffic"] >= 3
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    replies = next(e for e in log if e.get("phase") == "replies")
    kinds = {"chat": 1, "code": 1, "agent": 2, "rag": 2}  # the held-out list's first 2 are one of each
    assert replies["held_out_prompts"] == {kind: {"kept": n, "dropped": 0} for kind, n in kinds.items()}
    evals = [e for e in log if e.get("eval")]
    assert evals and all(1 <= e[kind]["tau"] <= 16 for e in evals for kind in kinds)
    assert all(1 <= summary["final"][kind]["tau"] <= 16 for kind in ("agent", "rag"))
