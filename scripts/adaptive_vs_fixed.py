"""Adaptive vs fixed block 4 at batch 1, built as `dflash-serve bench` builds them: prompts interleaved, 3 repeats,
best of 3; prints tok/s, ms per step, the blocks the adaptive policy drafted and its bookkeeping per step.
Usage: .venv/bin/python scripts/adaptive_vs_fixed.py [code|chat]   (~4 minutes here)"""
import time, statistics, tempfile, collections, sys
from pathlib import Path
from engine.bench import BenchConfig, setup, load_prompts, sampling_params, make_engine
from engine.engine import Engine
src = sys.argv[1] if len(sys.argv) > 1 else "code"
cfg = BenchConfig(methods=["dflash-adaptive"], block_sizes=[4], prompts=f"docs/train/held-out-{src}.jsonl",
                  num_prompts=6, max_new_tokens=96, dtype="bfloat16")
prompts = load_prompts(cfg)
s = setup(cfg, prompts, Path(tempfile.mkdtemp()))
engines = {n: make_engine(s.loaded, spec, cfg, 1, s.max_len) for n, spec in s.engines.items()}
pol = s.engines["dflash-adaptive"].policy
print(pol.cost_model.table_ms())
# instrument
timing = collections.defaultdict(float); drafted = collections.Counter()
for name in ("choose", "trim", "observe_verified", "observe_step"):
    orig = getattr(pol, name)
    def wrap(*a, _o=orig, _n=name, **k):
        t = time.perf_counter(); r = _o(*a, **k); timing[_n] += time.perf_counter() - t
        if _n == "choose": drafted[max(r)] += 1
        return r
    setattr(pol, name, wrap)
from dataclasses import replace
res = collections.defaultdict(list)
for rep in range(3):
    for i, ids in enumerate(s.prompt_ids):
        for n, e in engines.items():
            p = replace(sampling_params(cfg, i), block_size=s.engines[n].block_size)
            t = time.perf_counter(); r = e.generate_batch([ids], p)[0]; dt = time.perf_counter() - t
            res[n, i].append((dt, len(r.output_ids), len(r.acceptance_lengths)))
steps = 0
for n in engines:
    tot_s = sum(min(res[n, i])[0] for i in range(len(s.prompt_ids)))
    tot_t = sum(min(res[n, i])[1] for i in range(len(s.prompt_ids)))
    st = sum(min(res[n, i])[2] for i in range(len(s.prompt_ids)))
    print(n, "tok/s(best of 3)", round(tot_t / tot_s, 1), "ms/step", round(tot_s / st * 1e3, 2))
    if n == "dflash-adaptive": steps = sum(sum(x[2] for x in res[n, i]) for i in range(len(s.prompt_ids)))
print("adaptive drafted blocks", dict(drafted), "steps", steps)
for k, v in timing.items(): print(k, "ms/step", round(v / steps * 1e3, 3))
