"""oneDNN-packed linear weights (engine.model.Linear) against plain F.linear, in one process.

1. One layer shape (576 x 3072, SmolLM2's MLP) over 40 distinct weights, so they stream from memory
   as a model's do: microseconds per call at 1, 2, 4 and 16 rows.
2. Our engine on the default model, generations interleaved: the loaded (packed) target against a
   second copy with packing off, at batch 1 and 8, AR and (with --draft random) block-16 drafting.

    .venv/bin/python scripts/packed_linear_ab.py --threads 1 --draft none [--dtype float32]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.engine import Engine, SamplingParams  # noqa: E402
from engine.loading import load  # noqa: E402
from engine.model import Linear, load_target  # noqa: E402


def per_call_us(fn, calls, repeats=20):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats / calls * 1e6


def layer_bench(dtype):
    layers = [Linear(576, 3072, bias=False).to(dtype) for _ in range(40)]
    for layer in layers:
        layer.pack()
    with torch.inference_mode():
        for rows in (1, 2, 4, 16):
            x = torch.randn(rows, 576, dtype=dtype)
            plain = per_call_us(lambda: [F.linear(x, m.weight) for m in layers], len(layers))
            packed = per_call_us(lambda: [m(x) for m in layers], len(layers))
            print(f"{rows:>2} rows: F.linear {plain:6.1f} us, packed {packed:6.1f} us, {plain / packed:.2f}x")


def engine_bench(draft, dtype, tokens=64, repeats=5):
    loaded = load(None, draft, str(dtype).removeprefix("torch."), "cpu")
    plain = load_target(loaded.target_path, dtype=dtype)
    for m in plain.modules():
        if isinstance(m, Linear):
            m.packed = None
    ids = loaded.tokenizer("Write a short story about a robot learning to paint.")["input_ids"]
    params = SamplingParams(max_tokens=tokens)
    for batch in (1, 8):
        engines = {name: Engine(t, loaded.drafter, max_slots=batch, max_len=512)
                   for name, t in (("plain", plain), ("packed", loaded.target))}
        times = {name: [] for name in engines}
        for _ in range(repeats + 1):  # the first round warms up
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.generate_batch([ids] * batch, params)
                times[name].append(time.perf_counter() - start)
        rate = {name: tokens * batch / statistics.median(t[1:]) for name, t in times.items()}
        print(f"engine, draft {draft}, batch {batch}: plain {rate['plain']:.1f} tok/s, packed {rate['packed']:.1f} tok/s, "
              f"{rate['packed'] / rate['plain']:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--draft", default="none", help="none (AR) or random (block-16 drafting, nothing accepted)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    layer_bench(dtype)
    engine_bench(args.draft, dtype)


if __name__ == "__main__":
    main()
