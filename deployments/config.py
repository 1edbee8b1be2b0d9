"""The server's configuration: one pydantic model at the Ray boundary (builder args, YAML, CLI).

It owns the deployment's defaults (replicas, resources, topology, limits) and embeds the engine's
(EngineConfig); it knows nothing about models or HTTP. Everything that can be checked without
loading a model fails here, by name.
"""

import dataclasses
import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from engine.config import EngineConfig


API_KEYS_ENV = "DFLASH_API_KEYS"  # a comma list of API keys, in addition to AppConfig.api_keys
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))
DICT_FIELDS = (  # the fields `serve run ... key=value` may pass as a JSON object
    "engine", "autoscaling_config", "drafter_autoscaling_config", "resources", "drafter_resources", "shard_resources")
MIN_RESOURCE_AMOUNT = 0.0001  # the smallest amount of a resource Ray schedules by


def env_api_keys() -> list[str]:
    """The API keys in this process's DFLASH_API_KEYS (on a cluster: the nodes' environment, so a secret
    need not sit in the Serve config, which the dashboard shows)."""
    return [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="The engine every replica runs (engine/config.py): models, "
        "dtype, device, block policy, slots, context length. Its fields may also be given at the top level "
        "(as `serve run ... key=value` passes them).")
    topology: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="'colocated': drafter and target in one replica process. 'disaggregated': a "
        "router, drafter replicas and verifier replicas (the target) as separate deployments that scale apart; "
        "num_cpus/num_gpus/num_replicas/autoscaling_config then size the verifier replicas, drafter_* the drafters.")
    num_cpus: float = Field(
        1, gt=0, description="CPUs reserved per engine replica; torch uses this many threads in it.")
    num_gpus: float = Field(0, ge=0, description="GPUs reserved per engine replica (set with device='cuda').")
    resources: dict[str, float] = Field(
        {}, description="Custom Ray resources reserved per engine replica (verifier replica when disaggregated), "
        "e.g. {'dflash_node_0': 0.01} to pin it to the nodes that have that resource; with num_shards > 1 they "
        "join the replica's bundle of its placement group.")
    num_replicas: int = Field(1, ge=1, description="Engine replicas when autoscaling_config is not given.")
    num_shards: int = Field(
        1, ge=1, description="Pipeline shards of the target per verifier replica (per engine replica when colocated): "
        "Ray actors holding contiguous layer ranges and their KV cache, at most one per target layer. 1: the "
        "target runs in the replica's own process.")
    shard_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="With num_shards > 1: the placement group strategy of each replica and its shards "
        "(one bundle each): 'PACK' on as few nodes as fit, 'SPREAD' across nodes; STRICT_* as in Ray.")
    shard_num_cpus: float = Field(
        1, gt=0, description="With num_shards > 1: CPUs reserved per shard; torch uses this many threads in it.")
    shard_num_gpus: float = Field(
        0, ge=0, description="With num_shards > 1: GPUs reserved per shard (set with device='cuda').")
    shard_resources: dict[str, float] = Field(
        {}, description="With num_shards > 1: custom Ray resources in each shard's placement group bundle "
        "(every shard the same), e.g. to keep the shards on the nodes that have that resource.")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling for the engine replicas (min_replicas, max_replicas, "
        "target_ongoing_requests, ...); replaces num_replicas.")
    drafter_num_cpus: float = Field(
        1, gt=0, description="disaggregated: CPUs reserved per drafter replica (torch uses this many threads).")
    drafter_num_gpus: float = Field(0, ge=0, description="disaggregated: GPUs reserved per drafter replica.")
    drafter_resources: dict[str, float] = Field(
        {}, description="disaggregated: custom Ray resources reserved per drafter replica (pins the drafters "
        "to the nodes that have them).")
    drafter_num_replicas: int = Field(
        1, ge=1, description="disaggregated: drafter replicas when drafter_autoscaling_config is not given.")
    drafter_autoscaling_config: dict[str, Any] | None = Field(
        None, description="disaggregated: Ray Serve autoscaling for the drafter replicas; replaces drafter_num_replicas.")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests Serve sends one engine replica at once; those beyond max_slots wait "
        "in the replica's queue. Default: 2 x max_slots.")
    max_queued_requests: int = Field(
        64, ge=-1, description="Requests waiting for an engine replica (disaggregated: for a decoding slot) "
        "before new ones are answered 503 with Retry-After; -1: no limit.")
    model_name: str = Field("smollm2-135m-dflash", min_length=1, description="The model id clients pass as 'model'.")
    request_timeout_s: float | None = Field(
        600, gt=0, description="Longest a request may run end to end (queued time included) before it is "
        "cancelled, its state freed and the client answered 504 (None: no limit).")
    api_keys: list[SecretStr] = Field(
        [], description="Bearer keys clients must send (Authorization: Bearer KEY) on every route but /health; "
        "empty (and no DFLASH_API_KEYS in the ingress's environment): no authentication.")
    max_request_bytes: int = Field(
        1 << 20, ge=1024, description="Largest request body accepted; larger ones are answered 413.")

    @model_validator(mode="before")
    @classmethod
    def _from_cli(cls, data):
        """`serve run ... key=value` passes strings: 'None'/'null' mean None, a dict may be JSON; the
        engine's fields may come at the top level."""
        if not isinstance(data, dict):
            return data
        data = {k: None if isinstance(v, str) and v in ("None", "none", "null") and k != "draft" else v
                for k, v in data.items()}
        if isinstance(data.get("api_keys"), str):  # key=value: a comma list
            data["api_keys"] = [k for k in data["api_keys"].split(",") if k]
        for name in DICT_FIELDS:
            if isinstance(data.get(name), str):
                try:
                    data[name] = json.loads(data[name])
                except json.JSONDecodeError as e:
                    raise ValueError(f"{name}: not a JSON object: {e}") from None
        flat = {k: data.pop(k) for k in ENGINE_FIELDS if k in data}
        if flat:
            engine = data.get("engine") or {}
            engine = dataclasses.asdict(engine) if isinstance(engine, EngineConfig) else dict(engine)
            both = sorted(set(flat) & set(engine))
            if both:
                raise ValueError(f"{', '.join(both)}: given both at the top level and in engine")
            data["engine"] = {**engine, **flat}
        return data

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v):
        if any(not k.get_secret_value().strip() or k.get_secret_value() != k.get_secret_value().strip() for k in v):
            raise ValueError("api_keys: a key must not be empty or start or end with whitespace")
        return v

    @field_validator("resources", "drafter_resources", "shard_resources")
    @classmethod
    def _resources(cls, v, info):
        prefix = info.field_name.removesuffix("resources")  # "", "drafter_" or "shard_"
        for name, amount in v.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"{info.field_name}: {name} is set with {prefix}num_{name.lower()}s, not here "
                                 "(only custom resources)")
            if not name.strip():
                raise ValueError(f"{info.field_name}: a resource needs a name")
            if not amount >= MIN_RESOURCE_AMOUNT:  # Ray's precision; 0 would reserve (and pin) nothing
                raise ValueError(f"{info.field_name}: {name} must be at least {MIN_RESOURCE_AMOUNT}, got {amount}")
        return v

    @field_validator("autoscaling_config", "drafter_autoscaling_config")
    @classmethod
    def _autoscaling(cls, v):
        if v is not None:
            from ray.serve.config import AutoscalingConfig

            AutoscalingConfig(**v)  # Serve's own checks, here rather than at deploy time
        return v

    @model_validator(mode="after")
    def _consistent(self):
        device = self.engine.device
        if device.startswith("cuda") and self.num_gpus == 0:
            raise ValueError(f"device {device!r} needs num_gpus > 0 per replica")
        if device.startswith("cuda") and self.num_shards > 1 and self.shard_num_gpus == 0:
            raise ValueError(f"device {device!r} with num_shards {self.num_shards} needs shard_num_gpus > 0")
        if self.topology == "disaggregated":
            if self.engine.draft == "none":
                raise ValueError("topology 'disaggregated' needs a drafter (draft='none' has nothing to disaggregate)")
        return self

    @property
    def replica_max_ongoing_requests(self) -> int:
        return self.max_ongoing_requests or 2 * self.engine.max_slots

    @property
    def torch_threads(self) -> int:
        return max(1, round(self.num_cpus))

    @property
    def drafter_torch_threads(self) -> int:
        return max(1, round(self.drafter_num_cpus))
