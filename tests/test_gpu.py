"""The CUDA path: the same exactness checks as on the CPU, on the default model. Skipped without a
GPU (this project's machines have none; `scripts/gpu_run.sh check` runs these on a lent GPU machine)."""

from dataclasses import replace

import pytest
import torch

from engine.config import EngineConfig, build_engine, load_models
from engine.engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

QUESTIONS = ["What is 2+2?", "Write a haiku about rain.", "Explain what a CPU does in one sentence.",
             "List three prime numbers."]


CONFIG = EngineConfig(dtype="float32", draft="random", device="cuda", policy="fixed", max_slots=4)


@pytest.fixture(scope="module")
def loaded():
    return load_models(CONFIG)


def chat_ids(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_logits_match_transformers_on_cuda(loaded):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(loaded.target_path, dtype=torch.float32).cuda().eval()
    ids = torch.tensor([chat_ids(loaded.tokenizer, QUESTIONS[0])], device="cuda")
    n = ids.shape[1]
    with torch.inference_mode():
        ref = hf(ids).logits
        cache = loaded.target.new_cache(1, 64)
        ours, _ = loaded.target(ids, torch.arange(n, device="cuda")[None], cache, [0], n)
    assert (ours - ref).abs().max() < 1e-3


def test_dflash_equals_greedy_batched_on_cuda(loaded):
    prompts = [chat_ids(loaded.tokenizer, q) for q in QUESTIONS]
    reference = [r.output_ids for r in build_engine(replace(CONFIG, draft="none"), loaded)
                 .generate_batch(prompts, SamplingParams(max_tokens=32))]
    engine = build_engine(CONFIG, loaded)
    assert [r.output_ids for r in engine.generate_batch(prompts, SamplingParams(max_tokens=32))] == reference
    assert engine.target_cache.num_used == 0


def test_graphed_steps_equal_the_eager_ones_on_cuda(loaded):
    """The capturable forward recorded as a CUDA graph (engine.gpu_run.replayable, what the costs phase
    times) gives the eager forward's logits for a one-token step and a 16-position verify, replayed twice."""
    from engine.gpu_run import replayable

    target, device = loaded.target, torch.device("cuda")
    ids = torch.tensor([chat_ids(loaded.tokenizer, q)[:20] for q in QUESTIONS], device=device)
    batch, n = ids.shape
    with torch.inference_mode():
        cache = target.new_cache(batch, 64)
        slots = [cache.allocate() for _ in range(batch)]
        target(ids, torch.arange(n, device=device).expand(batch, -1), cache, slots, n)
        index = cache.batch_index(slots)
        for q in (1, 16):
            step_ids = ids[:, :q].clone()
            positions = torch.arange(n, n + q, device=device).expand(batch, -1).contiguous()
            eager, _ = target(step_ids, positions, cache, slots, n + q)
            out = {}

            def step():
                out["logits"], _ = target(step_ids, positions, cache, index, n + q, capturable=True)

            replay = replayable(step, device)
            for _ in range(2):
                replay()
                torch.cuda.synchronize()
                assert (out["logits"] - eager).abs().max() < 1e-3
                out["logits"].zero_()  # the next replay writes it again


def test_seeded_sampling_on_cuda(loaded):
    """A seeded request gets plain decoding's tokens with speculation, alone and in a batch, on CUDA."""
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    prompt = chat_ids(loaded.tokenizer, QUESTIONS[1])
    plain = build_engine(replace(CONFIG, draft="none"), loaded).generate_batch([prompt], params)[0].output_ids
    engine = build_engine(CONFIG, loaded)
    assert engine.generate_batch([prompt], params)[0].output_ids == plain
    others = [chat_ids(loaded.tokenizer, q) for q in QUESTIONS[2:]]
    assert engine.generate_batch([prompt] + others, [params] + [replace(params, seed=None)] * 2)[0].output_ids == plain


def test_datagen_and_training_on_cuda_match_the_cpu(loaded, tmp_path):
    """Data regenerated on the GPU, then the same 3 float32 training steps on the GPU and on the CPU
    (same seed, so the same blocks): the losses agree, and the GPU run saves a loadable drafter."""
    from engine.datagen import generate_data
    from engine.drafter import load_drafter
    from engine.train import TrainConfig, read_log, train

    # code prompts only: a GPU machine may lack the ShareGPT package
    data = generate_data(loaded, tmp_path / "data", num_prompts=4, sources=("code",), max_new_tokens=32, batch_size=4,
                         quiet=True)
    losses = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        out.mkdir()
        train(TrainConfig(data=str(data), held_out=str(data), out=str(out), steps=3, eval_every=3, anchors=8,
                          seqs_per_step=2, vocab_subset=2048, bf16=False, device=device), quiet=True)
        losses[device] = [e["loss"] for e in read_log(out / "log.jsonl")[0]]
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)
    assert load_drafter(tmp_path / "cuda" / "drafter").config.block_size == 16
