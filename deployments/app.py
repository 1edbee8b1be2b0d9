"""The Serve application: `serve run deployments.app:app` (defaults) or
`serve run deployments.app:build_app key=value ...` / a config file's `args` (see cluster/serve_config.yaml).

It owns how the deployments are wired and sized; the deployments themselves know nothing of it.
Colocated topology: OpenAIIngress (tokenizer, HTTP) -> EngineReplica x N (drafter + target each).
Disaggregated: OpenAIIngress -> Router -> DrafterReplica x N_d and VerifierReplica x N_v (scaled apart).
"""

from ray.serve import Application

from deployments.config import AppConfig
from deployments.disaggregated import DrafterReplica, Router, VerifierReplica
from deployments.engine_replica import EngineReplica
from deployments.ingress import OpenAIIngress

# The ingress only relays streams; requests are bounded (and queued) at the engine replicas.
INGRESS_MAX_ONGOING_REQUESTS = 1024


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
            **scaling, max_ongoing_requests=config.replica_max_ongoing_requests,
            ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        ).bind(args)
        drafter = DrafterReplica.options(
            **drafter_scaling, max_ongoing_requests=config.replica_max_ongoing_requests,
            ray_actor_options={"num_cpus": config.drafter_num_cpus, "num_gpus": config.drafter_num_gpus},
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
            ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        ).bind(args)
    return OpenAIIngress.options(
        num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
    ).bind(engine, args)


app = build_app(AppConfig())
