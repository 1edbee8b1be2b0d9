"""The records the ingress, the router and the replicas exchange through Ray: one small dataclass per
message, so what a field means is its name and type, not a convention about a dict's keys.

They carry token ids, tensors and counters; they know nothing of HTTP, text or how a replica works.
"""

from dataclasses import dataclass

import torch

from engine.engine import SamplingParams


@dataclass
class RequestParams:
    """A request's sampling parameters as the client gave them; None: the server's default (max_tokens:
    up to the context length; block_size: the server's largest block). Checked by the replica."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    block_size: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    tenant: str | None = None  # whose earlier outputs suffix drafting may propose: a hash of the API key, None without keys


@dataclass
class Chunk:
    """The next committed tokens of a request's stream (EngineReplica.generate, Router.generate)."""

    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", or None while the request runs
    stats: dict  # the request's SpecStats.to_dict() so far: a caller that stops early still has them


@dataclass
class ReplicaInfo:
    """What a replica serves: the /v1/models entry, the router's stop tokens, the checks of tests."""

    model: str
    target: str
    drafter: str  # a folder, "random" or "none"
    dtype: str
    device: str
    policy: str  # "fixed", "adaptive", or "none" without a drafter
    max_block_size: int
    max_slots: int
    max_len: int
    torch_threads: int  # as seen by the thread that runs the engine
    num_shards: int
    topology: str
    stop_token_ids: tuple[int, ...]


# ---- the disaggregated topology: router <-> drafter and verifier replicas ----------------------


@dataclass
class Lost:
    """A replica had no state for the request (never made, evicted, lost in a restart), or it died under
    the call: the router rebuilds the state from the committed tokens."""

    role: str = ""  # "drafter" or "verifier", set by the router
    died: str | None = None  # why the call failed when the replica (or a shard under it) died


@dataclass
class Prefilled:
    """The verifier's state built from the router's truth."""

    params: SamplingParams  # resolved and checked
    token_ids: list[int]  # the first token; empty when rebuilding a request that has output
    features: torch.Tensor  # [num_cached, F] the target's features of every cached position


@dataclass
class DraftStart:
    """What (re)creates a request's drafter state."""

    prompt_ids: list[int]
    params: SamplingParams
    tenant: str | None = None  # RequestParams.tenant


@dataclass
class Drafted:
    block_ids: list[int]  # the last committed token, then the drafts
    draft_probs: torch.Tensor | None  # [len(block_ids) - 1, vocab] for a sampling request, else None
    proposer: str = "dflash"  # what drafted it: "dflash" (the drafter) or "suffix"


@dataclass
class Verified:
    num_accepted: int
    token_ids: list[int]  # the accepted drafts and the bonus token
    features: torch.Tensor  # [num_accepted + 1, F]
