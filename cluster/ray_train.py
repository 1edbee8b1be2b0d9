"""Data-parallel drafter training on Ray Train: the same `engine.train.train` loop in N workers
(TorchTrainer, DDP: gloo on CPUs; with --device cuda one GPU per worker, NCCL). Each worker samples
its own blocks; DDP averages the gradients, so every worker holds the same weights after each step.
Rank 0 writes the checkpoint and the drafter into the run's --out folder (shared storage on a real
cluster)."""

import os
from dataclasses import asdict
from pathlib import Path

from engine.train import TrainConfig, train


def worker_loop(config: dict):
    import ray.train
    import ray.train.torch
    import torch
    from ray.train.torch import prepare_model

    torch.set_num_threads(max(1, int(config.get("threads_per_worker", 1))))
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    cfg = TrainConfig(**config["cfg"])
    if cfg.device.startswith("cuda"):
        cfg.device = str(ray.train.torch.get_device())  # the GPU Ray gave this worker

    def report(metrics, out):
        checkpoint = ray.train.Checkpoint.from_directory(str(Path(out) / "drafter")) if rank == 0 else None
        ray.train.report({k: v for k, v in metrics.items() if not isinstance(v, list)}, checkpoint=checkpoint)

    wrap = lambda module: prepare_model(module, move_to_device=False, parallel_strategy_kwargs={"broadcast_buffers": False})
    def dump(drafter):  # for the test: every worker's weights after its last step
        if config.get("dump_weights"):
            torch.save(drafter.state_dict(), Path(cfg.out) / f"weights-rank{rank}.pt")

    train(cfg, rank, world, wrap=wrap, report=report, quiet=True, on_end=dump)


def train_distributed(cfg: TrainConfig, num_workers: int, threads_per_worker: int = 1, dump_weights=False):
    """Run `train` in `num_workers` Ray Train workers on a loopback Ray cluster (or the one that
    is already connected). Returns the final metrics of rank 0."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is imported: else the external address
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    use_gpu = cfg.device.startswith("cuda")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=num_workers * threads_per_worker, include_dashboard=False,
                 _node_ip_address="127.0.0.1")
    out = Path(cfg.out).resolve()
    cfg = TrainConfig(**dict(asdict(cfg), out=str(out), data=str(Path(cfg.data).resolve()),
                             held_out=str(Path(cfg.held_out).resolve()) if cfg.held_out else None))
    trainer = TorchTrainer(
        worker_loop,
        train_loop_config={"cfg": asdict(cfg), "threads_per_worker": threads_per_worker, "dump_weights": dump_weights},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": threads_per_worker, **({"GPU": 1} if use_gpu else {})}),
        run_config=RunConfig(name="train", storage_path=str(out / "ray")),
    )
    result = trainer.fit()
    return dict(result.metrics)
