"""A pipeline-sharded target: N Ray actors (TargetShard), each holding a contiguous range of the
target's layers and the KV cache of those layers, in a placement group. ShardedTarget drives them
behind the interface the Engine asks of a target, so the engine code is the same with or without shards.
It knows nothing about requests or drafting; Serve's part is only where a replica's placement group comes from.
"""

import asyncio
import itertools
import weakref

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import AppConfig
from engine.default_model import resolve_model_path
from engine.kv_cache import SlotTable
from engine.model import ModelConfig, TargetHead, load_target, ordered_features, read_hf_config
from engine.runtime import cap_matmul_caches

PLACEMENT_TIMEOUT_S = 120  # how long an engine without Serve waits for the cluster to place its shards


def layer_ranges(num_layers: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering layers 0..num_layers-1, as even as possible (the
    first shards take one more layer each when they do not divide evenly)."""
    if not 1 <= num_shards <= num_layers:
        raise ValueError(f"num_shards must be between 1 and the target's {num_layers} layers, got {num_shards}")
    size, extra = divmod(num_layers, num_shards)
    bounds = list(itertools.accumulate((size + (i < extra) for i in range(num_shards)), initial=0))
    return list(zip(bounds, bounds[1:]))


def resource_bundle(num_cpus: float, num_gpus: float, resources: dict[str, float] | None = None) -> dict:
    """A placement group bundle (a shard's or a replica's resources; custom ones pin it to the nodes that have them)."""
    return {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **(resources or {})}


@ray.remote
class TargetShard:
    """Layers [start, end) of the target (with the token embedding on the first shard, the final norm
    and LM head on the last) and their KV caches: one per cache id its ShardedTarget made."""

    def __init__(self, target: str | None, layers: tuple[int, int], dtype: torch.dtype, device: str, num_threads: int):
        cap_matmul_caches()
        torch.set_num_threads(num_threads)
        self.model = load_target(resolve_model_path(target), dtype, device, layers)
        self.caches = {}

    def layers(self) -> tuple[int, int]:
        return self.model.layer_start, self.model.layer_end

    def new_cache(self, cache_id: int, num_slots: int, max_len: int):
        self.caches[cache_id] = self.model.new_cache(num_slots, max_len)

    def drop_cache(self, cache_id: int):
        self.caches.pop(cache_id, None)

    @torch.inference_mode()
    def forward(self, inputs, positions, cache_id, slots, kv_len, feature_layers, logits_index):
        """TargetModel.forward_shard on this shard's cache `cache_id`, inputs moved to its device."""
        device = self.model.device
        logits_index = None if logits_index is None else logits_index.to(device)
        return self.model.forward_shard(inputs.to(device), positions.to(device), self.caches[cache_id], slots, kv_len,
                                        feature_layers, logits_index)


def _drop_cache(shards, cache_id):
    try:
        for shard in shards:
            shard.drop_cache.remote(cache_id)
    except Exception:  # Ray already shut down: the shards are gone with their caches
        pass


class ShardedTarget:
    """The target as `num_shards` TargetShard actors, one per bundle of a placement group, with what
    the Engine asks of a target: config, dtype, device, new_cache and a forward call (TargetModel's
    arguments). Hidden states pass from shard to shard as object refs (this process never sees them);
    each forward waits once, for the logits and the features. Its caches are SlotTables here (the
    bookkeeping) whose tensors live in the shards. `head` (a local TargetHead) gives embed_tokens and
    lm_head to an engine that also drafts.

    placement_group: the bundles first_bundle.. of it hold the shards (a Serve replica's own group,
    see build_app); None: this object makes a group of its own with `strategy` (one bundle of num_cpus,
    num_gpus and the custom `resources` per shard) and removes it in close().
    """

    def __init__(self, target: str | None, num_shards: int, dtype: torch.dtype, device: str = "cpu", *,
                 num_cpus: float = 1, num_gpus: float = 0, resources: dict[str, float] | None = None,
                 strategy: str = "PACK", placement_group: PlacementGroup | None = None, first_bundle: int = 0,
                 head: TargetHead | None = None):
        hf_config = read_hf_config(resolve_model_path(target))
        try:
            self.config = ModelConfig.from_hf(hf_config)
        except ValueError as e:
            raise ValueError(f"num_shards {num_shards} needs a Llama-family target: {e}") from None
        ranges = layer_ranges(self.config.num_layers, num_shards)
        self.dtype, self.device = dtype, torch.device(device)
        # None without a head: the engine of a verifier (which does not draft) reads them but never calls them
        self.embed_tokens, self.lm_head = (head.embed_tokens, head.lm_head) if head is not None else (None, None)
        self._own_group = placement_group is None
        if self._own_group:
            placement_group, first_bundle = self._make_group(num_shards, resource_bundle(num_cpus, num_gpus, resources),
                                                             strategy), 0
        self.placement_group = placement_group
        threads = max(1, round(num_cpus))
        self.shards = [
            TargetShard.options(
                num_cpus=num_cpus, num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=first_bundle + i),
            ).remote(target, layers, dtype, device, threads)
            for i, layers in enumerate(ranges)
        ]
        self.layer_ranges = ray.get([shard.layers.remote() for shard in self.shards])  # loaded (or raise)
        self._cache_ids = itertools.count()

    @staticmethod
    def _make_group(num_shards, bundle, strategy) -> PlacementGroup:
        group = ray.util.placement_group([bundle] * num_shards, strategy=strategy)
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(group)
            raise RuntimeError(f"the cluster could not place {num_shards} target shards of "
                               f"{bundle} ({strategy}) in {PLACEMENT_TIMEOUT_S} s")
        return group

    def new_cache(self, num_slots, max_len) -> SlotTable:
        table = SlotTable(num_slots, max_len)
        table.cache_id = next(self._cache_ids)
        ray.get([shard.new_cache.remote(table.cache_id, num_slots, max_len) for shard in self.shards])
        weakref.finalize(table, _drop_cache, list(self.shards), table.cache_id).atexit = False
        return table

    def __call__(self, input_ids, positions, cache, slots, kv_len, feature_layers=(), logits_index=None, tree=None):
        """TargetModel.forward through the shards: logits [batch, k or q, vocab] (float32) and features
        [batch, q, n * hidden] (or None), on this object's device. No token trees (`tree` must be None):
        the accepted path would have to move in every shard's cache."""
        if tree is not None:
            raise ValueError("a sharded target verifies chains only, not token trees")
        slots, feature_layers = [int(s) for s in slots], tuple(feature_layers)
        x, feature_refs = input_ids, []
        for shard in self.shards:
            x, features = shard.forward.options(num_returns=2).remote(
                x, positions, cache.cache_id, slots, kv_len, feature_layers, logits_index)
            feature_refs.append(features)
        logits, *per_shard = ray.get([x, *feature_refs])
        features = ordered_features({layer: f for shard in per_shard for layer, f in shard.items()}, feature_layers)
        return logits.to(self.device), None if features is None else features.to(self.device)

    async def check(self):
        """Raise (RayActorError) when a shard is gone: then the replica holding this must be replaced."""
        await asyncio.gather(*(shard.layers.remote() for shard in self.shards))

    def close(self):
        """End the shards (and the placement group if this object made it)."""
        for shard in self.shards:
            ray.kill(shard)
        if self._own_group:
            ray.util.remove_placement_group(self.placement_group)


def check_num_shards(config: AppConfig):
    """Raise ValueError naming num_shards when the target has fewer layers than config.num_shards."""
    layer_ranges(read_hf_config(resolve_model_path(config.engine.target))["num_hidden_layers"], config.num_shards)


def start_shards(config: AppConfig, dtype: torch.dtype, head: TargetHead | None = None) -> ShardedTarget:
    """A replica's target shards, in the placement group build_app gave the replica (bundle 0 holds the
    replica, bundles 1..num_shards the shards); a replica deployed without one gets a group of their own."""
    return ShardedTarget(config.engine.target, config.num_shards, dtype, config.engine.device, num_cpus=config.shard_num_cpus,
                         num_gpus=config.shard_num_gpus, resources=config.shard_resources,
                         strategy=config.shard_placement, placement_group=ray.util.get_current_placement_group(),
                         first_bundle=1, head=head)


async def check_shards(target):
    """A replica's health check of its target: a ShardedTarget's shards must all be alive."""
    if isinstance(target, ShardedTarget):
        await target.check()
