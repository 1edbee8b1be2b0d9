"""The Serve application: `serve run deployments.app:app` (defaults) or
`serve run deployments.app:build_app key=value ...` / a config file's `args` (see cluster/serve_config.yaml).

It owns how the deployments are wired and sized; the deployments themselves know nothing of it.
Colocated topology: OpenAIIngress (tokenizer, HTTP) -> EngineReplica x N (drafter + target each).
Disaggregated: OpenAIIngress -> Router -> DrafterReplica x N_d and VerifierReplica x N_v (scaled apart).
With num_shards > 1, each replica that runs the target drives that many TargetShard actors in its placement group.
"""

from ray.serve import Application

from deployments.config import AppConfig
from deployments.disaggregated import DrafterReplica, Router, VerifierReplica
from deployments.engine_replica import EngineReplica
from deployments.ingress import OpenAIIngress
from deployments.shards import check_num_shards, resource_bundle

# The ingress only relays streams; requests are bounded (and queued) at the engine replicas.
INGRESS_MAX_ONGOING_REQUESTS = 1024


def actor_resources(num_cpus: float, num_gpus: float, resources: dict[str, float]) -> dict:
    """A replica's ray_actor_options: CPUs, GPUs and custom resources (those pin it to the nodes that have them)."""
    return {"num_cpus": num_cpus, "num_gpus": num_gpus, **({"resources": dict(resources)} if resources else {})}


def target_placement(config: AppConfig) -> dict:
    """Serve options of the replicas that run the target: their resources and, with num_shards > 1,
    a placement group per replica (bundle 0 the replica, then one per shard; see deployments/shards.py)
    that Serve reserves before it starts the replica and removes when the replica goes."""
    options = {"ray_actor_options": actor_resources(config.num_cpus, config.num_gpus, config.resources)}
    if config.num_shards > 1:
        check_num_shards(config)
        bundles = [resource_bundle(config.num_cpus, config.num_gpus, config.resources)]
        bundles += [resource_bundle(config.shard_num_cpus, config.shard_num_gpus, config.shard_resources)] \
            * config.num_shards
        options.update(placement_group_bundles=bundles, placement_group_strategy=config.shard_placement)
    return options


def build_app(config: AppConfig | dict) -> Application:
    """The application for `config` (an AppConfig, or the dict of args Serve passes a builder)."""
    config = config if isinstance(config, AppConfig) else AppConfig.model_validate(config)
    args = config.model_dump()
    scaling = {"autoscaling_config": config.autoscaling_config} if config.autoscaling_config else \
        {"num_replicas": config.num_replicas}
    if config.topology == "disaggregated":
        drafter_scaling = {"autoscaling_config": config.drafter_autoscaling_config} \
            if config.drafter_autoscaling_config else {"num_replicas": config.drafter_num_replicas}
        verifier = VerifierReplica.options(
            **scaling, max_ongoing_requests=config.replica_max_ongoing_requests, **target_placement(config),
        ).bind(args)
        drafter = DrafterReplica.options(
            **drafter_scaling, max_ongoing_requests=config.replica_max_ongoing_requests,
            ray_actor_options=actor_resources(config.drafter_num_cpus, config.drafter_num_gpus, config.drafter_resources),
        ).bind(args)
        engine = Router.options(
            num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
            max_queued_requests=config.max_queued_requests, ray_actor_options={"num_cpus": 0},
        ).bind(drafter, verifier, args)
    else:
        engine = EngineReplica.options(
            **scaling,
            max_ongoing_requests=config.replica_max_ongoing_requests,
            max_queued_requests=config.max_queued_requests,
            **target_placement(config),
        ).bind(args)
    return OpenAIIngress.options(
        num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
    ).bind(engine, args)


app = build_app(AppConfig())
