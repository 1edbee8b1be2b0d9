#!/usr/bin/env bash
# The default drafter's figures, each a `dflash-serve bench` run with everything side by side in
# one process, on held-out prompts never used in training. Writes docs/bench/drafter-*.{txt,json,png}.
# About 15 minutes on 2 cores; run it alone (other processes on the cores distort the timings).
# DFLASH_DTYPE (default bfloat16) and DFLASH_BENCH_OUT (default docs/bench) choose the dtype and folder:
# DFLASH_DTYPE=float32 DFLASH_BENCH_OUT=docs/bench/fp32 for a CPU without native bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${DFLASH_BENCH_OUT:-docs/bench}"
dtype="${DFLASH_DTYPE:-bfloat16}"
mkdir -p "$out"
bench() { name=$1; shift; .venv/bin/dflash-serve bench --json "$out/drafter-$name.json" "$@" | tee "$out/drafter-$name.txt"; }
chat=(--prompts docs/train/held-out-chat.jsonl --num-prompts 6 --max-new-tokens 96 --dtype "$dtype")
code=(--prompts docs/train/held-out-code.jsonl --num-prompts 6 --max-new-tokens 96 --dtype "$dtype")
# the headline lines on 12 prompts (the last --num-prompts wins): in bf16 the block size changes the text,
# so each method's tok/s is over somewhat different replies and 6 prompts left adaptive vs fixed to chance
bench chat "${chat[@]}" --num-prompts 12 --methods hf,ar,dflash,dflash-adaptive --block-sizes 2,4,8 --plot "$out/drafter-chat.png"
bench code "${code[@]}" --num-prompts 12 --methods hf,ar,dflash,dflash-adaptive --block-sizes 2,4,8 --plot "$out/drafter-code.png"
# z-lab's DFlashDraftModel loads the shipped checkpoint; float32, full head: same output and tau
bench zlab --prompts docs/train/held-out-chat.jsonl --num-prompts 3 --max-new-tokens 48 --dtype float32 --methods dflash,zlab --full-draft-head
bench t1 "${chat[@]}" --methods ar,dflash --temperature 1.0 --seed 0
bench t07 "${chat[@]}" --methods ar,dflash --temperature 0.7 --top-p 0.9 --seed 0
bench full-head "${chat[@]}" --methods ar,dflash --full-draft-head
bench int8 "${chat[@]}" --methods ar,dflash --int8-drafter
bench denoise2 "${chat[@]}" --methods ar,dflash --denoising-steps 2
bench denoise3 "${chat[@]}" --methods ar,dflash --denoising-steps 3
