"""One engine's configuration (EngineConfig) and the one function that builds a ready engine from it.

It owns the engine's knobs and their defaults: every entry point (the server's AppConfig, the
`dflash-serve` flags, bench, tests) starts from these. It knows nothing about Ray, HTTP or the CLI.
"""

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from engine.default_model import cache_dir
from engine.engine import BACKLOG_CALL_POSITIONS, PREFILL_TOKEN_BUDGET, Engine
from engine.loading import Loaded, load, stop_token_ids
from engine.policy import AdaptiveBlockPolicy, BlockPolicy, FixedBlockPolicy
from engine.suffix import SuffixConfig, SuffixProposer

DRAFTS = ("default", "random", "none")
PROPOSERS = ("dflash", "suffix")


def knob(default, text: str, minimum: int | None = None):
    """A field with the help text its command-line flag shows, and its least value."""
    return field(default=default, metadata={"help": text, "minimum": minimum})


def choices_of(hint) -> tuple:
    """The values a Literal[...] type allows; () for any other type."""
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


@dataclass
class EngineConfig:
    """What an engine runs and how. Checked without loading a model (ValueError naming the field)."""

    target: str | None = knob(None, "target checkpoint folder (Hugging Face layout); None: SmolLM2-135M-Instruct")
    draft: str = knob("default", "drafter: default (the shipped one), random, none (no speculation) or a "
                                 "z-lab-format drafter folder")
    dtype: Literal["auto", "float32", "bfloat16"] = knob(
        "auto", "weights and activations; auto: bf16 on CUDA and on CPUs with native bf16, else float32")
    device: str = knob("cpu", "cpu or cuda[:N]")
    int8_drafter: bool = knob(False, "dynamic int8 drafter (CPU only)")
    full_draft_head: bool = knob(False, "score the full vocabulary, not the drafter's reduced draft vocabulary")
    policy: Literal["fixed", "adaptive"] = knob(
        "adaptive", "block-size policy: fixed verifies block_size positions every step; adaptive profiles a cost "
                    "model once (cached on disk) and picks the block that maximises committed tokens per second")
    block_size: int | None = knob(None, "largest block verified per step; None: the drafter's", minimum=1)
    denoising_steps: int = knob(1, "drafter passes per block", minimum=1)
    max_slots: int = knob(8, "requests decoded together (KV-cache slots)", minimum=1)
    max_len: int = knob(2048, "context length per request: prompt + generated tokens", minimum=2)
    prefill_token_budget: int = knob(
        PREFILL_TOKEN_BUDGET, "padded prompt positions per prefill call (one prompt at least)", minimum=1)
    backlog_call_positions: int | None = knob(
        BACKLOG_CALL_POSITIONS, "what a drafter pass of its own costs, in positions of a batch pass (long "
        "feature backlogs are taken apart when cheaper); None: pad every backlog into the block pass", minimum=0)
    proposers: str = knob(
        "dflash,suffix", "comma list of draft sources: dflash (the drafter's block), suffix (what the request's "
        "context and recent outputs already say); with both the policy picks one per request and step")
    prefix_cache: bool = knob(
        True, "a new prompt starts from the cached keys and values of a running or recently finished request "
              "whose tokens begin it (agent turns, a shared system prompt); not with shards or the "
              "disaggregated topology")
    draft_tree: bool = knob(
        True, "a greedy request verifies a token tree of the drafter's likeliest tokens per position, as many "
              "as the chain it replaces, instead of that chain; not with shards or the disaggregated topology")
    suffix_index_tokens: int = knob(
        200_000, "recent output tokens the suffix proposer keeps for all requests of a replica (oldest evicted; "
        "with API keys on, each key's outputs are proposed to that key only)", minimum=0)

    def __post_init__(self):
        if self.target in ("default", ""):
            self.target = None
        if self.target is not None and not (Path(self.target) / "config.json").is_file():
            raise ValueError(f"target {self.target}: no model there (config.json missing)")
        if self.draft not in DRAFTS and not (Path(self.draft) / "config.json").is_file():
            raise ValueError(f"draft {self.draft}: no drafter there (config.json missing); or use {', '.join(DRAFTS)}")
        if not (self.device == "cpu" or self.device == "cuda" or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, minimum, choices = getattr(self, f.name), f.metadata.get("minimum"), choices_of(hints[f.name])
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")
            if minimum is not None and value is not None and value < minimum:
                raise ValueError(f"{f.name} must be >= {minimum}, got {value}")
        unknown = set(self.proposer_names) - set(PROPOSERS)
        if unknown or not self.proposer_names:
            raise ValueError(f"proposers must be a comma list of {', '.join(PROPOSERS)}, got {self.proposers!r}")
        if self.int8_drafter and self.device != "cpu":
            raise ValueError("int8_drafter runs on CPU only; use device cpu")
        if self.int8_drafter and self.draft == "none":
            raise ValueError("int8_drafter needs a drafter, but draft is none")

    @property
    def proposer_names(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.proposers.split(",") if p.strip())

    def max_block_size(self, drafter) -> int:
        """The largest block a request may verify: block_size, else the drafter's; 1 without a drafter."""
        if drafter is None:
            return 1
        return self.block_size or drafter.config.block_size


def load_models(config: EngineConfig) -> Loaded:
    """The target, drafter and tokenizer `config` names (the default model converted on first use)."""
    return load(config.target, config.draft, config.dtype, config.device, config.int8_drafter)


def build_engine(config: EngineConfig, loaded: Loaded | None = None, *, target=None, drafts: bool = True,
                 cost_table_tag: str = "") -> Engine:
    """A ready engine for `config`: models loaded (or `loaded`'s reused; draft 'none' leaves its drafter
    out), the block policy built (an adaptive one profiled once per models and size: the table is cached
    under the cache directory, `cost_table_tag` naming how the target runs when that changes its costs).

    target: run this instead of loaded.target (a sharded target, or the target's head in an engine that
    only drafts); the policy is profiled on loaded.target while it is loaded, else on `target`.
    drafts=False: the drafter runs elsewhere; this engine verifies and returns the features it reads.
    """
    loaded = loaded or load_models(config)
    drafter = None if config.draft == "none" or "dflash" not in config.proposer_names else loaded.drafter
    target = loaded.target if target is None else target
    feature_layers = None
    if not drafts:
        feature_layers = () if drafter is None else tuple(drafter.config.target_layer_ids)
        drafter = None
    profiled_on = loaded.target if loaded.target is not None else target
    policy = block_policy(config, loaded, profiled_on, drafter, cost_table_tag)
    return Engine(
        target, drafter, max_slots=config.max_slots, max_len=config.max_len, policy=policy,
        stop_token_ids=stop_token_ids(loaded.target_path), denoising_steps=config.denoising_steps,
        feature_layers=feature_layers, reduced_draft_head=not config.full_draft_head,
        prefill_token_budget=config.prefill_token_budget, backlog_call_positions=config.backlog_call_positions,
        suffix=suffix_proposer(config) if drafts else None,
        prefix_cache=config.prefix_cache and drafts and target is loaded.target,
        draft_tree=config.draft_tree and drafts,
    )


def suffix_proposer(config: EngineConfig) -> SuffixProposer | None:
    """The suffix proposer `config` asks for; none with draft 'none' (no speculation at all)."""
    if "suffix" not in config.proposer_names or config.draft == "none":
        return None
    return SuffixProposer(SuffixConfig(global_max_tokens=config.suffix_index_tokens))


def block_policy(config: EngineConfig, loaded: Loaded, target, drafter, tag: str = "") -> BlockPolicy:
    """The configured policy; an adaptive one is profiled on `target` and `drafter` (or read from the cache)."""
    max_block = config.max_block_size(drafter)
    if config.policy == "fixed" or drafter is None:
        return FixedBlockPolicy(max_block)
    path = cost_table_path(config, loaded, max_block, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    return AdaptiveBlockPolicy.profile(target, drafter, max_block_size=max_block, max_batch_size=config.max_slots,
                                      path=path)


def cost_table_path(config: EngineConfig, loaded: Loaded, max_block: int, tag: str = "") -> Path:
    """Where the adaptive policy's cost table for these models, this engine size and thread count lives."""
    drafter = Path(loaded.drafter_name).name
    dtype = str(loaded.dtype).removeprefix("torch.")
    name = f"{loaded.target_path.name}-{drafter}-{dtype}-{config.device.replace(':', '')}-" \
           f"b{max_block}-n{config.max_slots}-t{torch.get_num_threads()}{tag}.json"
    return cache_dir() / "cost-models" / name
