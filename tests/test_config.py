"""One engine configuration: EngineConfig's checks, AppConfig embedding it, the CLI's flags made from its
fields, and every documented way of starting the server handing its replicas the same engine."""

from dataclasses import fields

import pytest
import yaml
from ray.serve import Application

from conftest import ROOT
from deployments.app import build_app
from deployments.config import AppConfig
from dflash_serve import cli
from engine.config import EngineConfig


def replica_engines(application: Application) -> list[EngineConfig]:
    """The EngineConfig every deployment of a Serve application is bound with: what its replicas build."""
    found, todo = [], [application]
    while todo:
        for arg in todo.pop()._bound_deployment.init_args:
            if isinstance(arg, Application):
                todo.append(arg)
            elif isinstance(arg, dict):
                found.append(AppConfig.model_validate(arg).engine)
    return found


def test_every_way_to_serve_starts_the_same_engine():
    """`serve run deployments.app:app` (the default AppConfig), `serve run cluster/serve_config.yaml`,
    `dflash-serve serve` with no flags and ./run.sh (which is that command) build one engine configuration."""
    from deployments.app import app

    (application,) = yaml.safe_load((ROOT / "cluster" / "serve_config.yaml").read_text())["applications"]
    assert application["import_path"] == "deployments.app:build_app"
    served = {
        "serve run deployments.app:app": replica_engines(app),
        "serve run cluster/serve_config.yaml": replica_engines(build_app(application["args"])),
        "dflash-serve serve": replica_engines(build_app(cli.serve_config(cli.build_parser()[0].parse_args(["serve"])))),
    }
    for way, engines in served.items():
        assert len(engines) == 2 and all(e == EngineConfig() for e in engines), (way, engines)  # ingress, replica
    assert 'exec .venv/bin/dflash-serve serve "$@"' in (ROOT / "run.sh").read_text()
    assert EngineConfig().policy == "adaptive"


def test_app_config_takes_the_engine_nested_or_at_the_top_level():
    nested = AppConfig.model_validate({"engine": {"policy": "fixed", "max_slots": 4}})
    flat = AppConfig.model_validate({"policy": "fixed", "max_slots": "4", "block_size": "None"})  # key=value strings
    assert nested.engine == flat.engine == EngineConfig(policy="fixed", max_slots=4)
    assert AppConfig.model_validate(nested.model_dump()) == nested  # what the replicas get back
    with pytest.raises(ValueError, match="max_slots: given both at the top level and in engine"):
        AppConfig.model_validate({"engine": {"max_slots": 2}, "max_slots": 3})
    with pytest.raises(ValueError, match="engine.bogus"):
        AppConfig.model_validate({"engine": {"bogus": 1}})


@pytest.mark.parametrize("field, value, message", [
    ("max_slots", 0, "max_slots must be >= 1, got 0"),
    ("block_size", 0, "block_size must be >= 1, got 0"),
    ("prefill_token_budget", 0, "prefill_token_budget must be >= 1"),
    ("policy", "greedy", "policy must be one of fixed, adaptive, got 'greedy'"),
    ("dtype", "float16", "dtype must be one of auto, float32, bfloat16"),
    ("device", "tpu", "device must be 'cpu' or 'cuda[:N]'"),
    ("target", "/no/such/model", "target /no/such/model: no model there"),
    ("draft", "/no/such/drafter", "draft /no/such/drafter: no drafter there"),
])
def test_engine_config_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        EngineConfig(**{field: value})


def test_every_engine_field_is_a_serve_flag_with_its_default():
    """The flags are made from the fields: a new field is a new flag, with the same default."""
    args = cli.build_parser()[0].parse_args(["serve"])
    assert cli.engine_config(args) == EngineConfig()
    for f in fields(EngineConfig):
        assert getattr(args, f.name) == f.default, f.name
    args = cli.build_parser()[0].parse_args(["serve", "--backlog-call-positions", "none", "--no-full-draft-head",
                                             "--int8-drafter", "--denoising-steps", "2"])
    assert cli.engine_config(args) == EngineConfig(backlog_call_positions=None, int8_drafter=True, denoising_steps=2)


def test_the_readme_configuration_table_lists_every_field_and_real_flags():
    import re

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Configuration"):readme.index("## Results")]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ")][1:]
    names = {n for cell, _ in rows for n in re.findall(r"`([\w.]+)`", cell)}
    flags = {f for _, cell in rows for f in re.findall(r"`(--[\w-]+)`", cell)}
    assert names == {f"engine.{f.name}" for f in fields(EngineConfig)} | (set(AppConfig.model_fields) - {"engine"})
    serve_flags = {a for action in cli.build_parser()[1]["serve"]._actions for a in action.option_strings}
    assert flags and flags <= serve_flags, flags - serve_flags


def test_a_new_engine_field_is_a_new_flag(monkeypatch):
    """EngineConfig is meant to grow: a new field, a list type included, is a flag of every engine command
    without touching the CLI."""
    import argparse
    from dataclasses import dataclass
    from typing import Literal

    from engine.config import knob

    @dataclass
    class Grown(EngineConfig):
        kernels: tuple[Literal["eager", "graphs"], ...] = knob(("eager",), "kernel kinds")

    monkeypatch.setattr(cli, "EngineConfig", Grown)
    monkeypatch.setattr(cli, "ENGINE_FIELDS", tuple(f.name for f in fields(Grown)))
    parser = argparse.ArgumentParser()
    cli.add_engine_flags(parser)
    assert cli.engine_config(parser.parse_args([])) == Grown()
    assert cli.engine_config(parser.parse_args(["--kernels", "eager,graphs"])) == Grown(kernels=("eager", "graphs"))
