"""A deployment configures every resource from its environment, and the runs its daemon
launches get that configuration; a bad value stops the definitions from loading, naming the
variable and the field; the configuration reference lists every variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from dagster import ConfigurableResource, EnvVar
from pydantic import Field

from resources.env import EnvConfigError, env_names, parse_value, resource_from_env

ROOT = Path(__file__).resolve().parents[2]
ENV_BUILT = {  # resource key in the definitions → (class, prefix, variable overrides)
    "capture": ("resources.capture", "CaptureResource", "AERIE_CAPTURE_"),
    "trainer": ("resources.trainer", "TrainerResource", "AERIE_TRAINER_"),
    "serving": ("resources.serving", "ServingResource", "AERIE_SERVING_"),
}


class Example(ConfigurableResource):
    mode: Literal["a", "b"] = "a"
    count: int = Field(default=1, ge=1)
    ratio: float = 0.5
    flag: bool = False
    urls: list[str] = Field(default_factory=list)
    ids: list[int] | None = None
    name: str | None = None
    token: str | None = None


def test_values_are_parsed_by_the_field_type():
    env = {"X_MODE": "b", "X_COUNT": "3", "X_RATIO": "0.25", "X_FLAG": "yes",
           "X_URLS": "http://a:1, http://b:2", "X_IDS": "[1, 5, 9]", "X_NAME": "",
           "X_TOKEN": "s3cret"}
    built = resource_from_env(Example, "X_", secrets=("token",), environ=env)
    assert (built.mode, built.count, built.ratio, built.flag) == ("b", 3, 0.25, True)
    assert built.urls == ["http://a:1", "http://b:2"] and built.ids == [1, 5, 9]
    assert built.name is None
    assert built.token == EnvVar("X_TOKEN")  # a secret stays a reference
    assert resource_from_env(Example, "X_", environ={}) == Example()


@pytest.mark.parametrize("var,value,message", [
    ("X_MODE", "c", r"X_MODE \(Example.mode\): 'c' is not a valid value: not one of"),
    ("X_COUNT", "0", r"X_COUNT \(Example.count\): Input should be greater than or equal"),
    ("X_COUNT", "three", r"X_COUNT \(Example.count\): 'three' is not a valid value"),
    ("X_FLAG", "maybe", r"X_FLAG \(Example.flag\): 'maybe' .* expected true or false"),
    ("X_IDS", "[1, x]", r"X_IDS \(Example.ids\): '\[1, x\]' is not a valid value"),
])
def test_a_bad_value_names_the_variable_and_the_field(var, value, message):
    with pytest.raises(EnvConfigError, match=message):
        resource_from_env(Example, "X_", environ={var: value})


def _load_definitions(env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    return subprocess.run([sys.executable, "-c", f"import definitions\n{code}"], cwd=ROOT,
                          env={**clean, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_the_definitions_take_every_resource_from_the_environment(tmp_path):
    refresh = tmp_path / "refresh.yaml"
    refresh.write_text("ops:\n  acceptance_eval:\n    config: {device: cuda, "
                       "dtype: bfloat16}\n")
    ingest = tmp_path / "ingest.json"
    ingest.write_text(json.dumps({"ops": {"hidden_state_shards": {"config": {
        "token_budget": 8192}}}}))
    env = {"AERIE_CAPTURE_BACKEND": "sglang",
           "AERIE_CAPTURE_SGLANG_AUX_URLS": "http://gpu-1:30001,http://gpu-2:30001",
           "AERIE_CAPTURE_SGLANG_FINAL_URLS": '["http://gpu-1:30002"]',
           "AERIE_CAPTURE_ENGINE_MAX_CONCURRENCY": "32",
           "AERIE_CAPTURE_ENGINE_API_KEY": "never-printed",
           "AERIE_TRAINER_WORLD_SIZE": "8", "AERIE_TRAINER_LAUNCHER": "deepspeed",
           "AERIE_TRAINER_DEVICE": "cuda", "AERIE_TRAINER_DTYPE": "bf16",
           "AERIE_SERVING_MODE": "vllm-reload",
           "AERIE_SERVING_SERVER_URLS": "http://rollout-1:8000", "AERIE_REFRESH_EVERY": "10",
           "AERIE_SERVING_API_KEY": "never-printed", "AERIE_SERVING_VERIFY_MIN_SHARE": "0.9",
           "AERIE_DRIFT_WINDOW": "3", "AERIE_REFRESH_MAX_INTERVAL": "20",
           "AERIE_RETAIN_STEPS": "8", "AERIE_PRUNE_POLICIES": "true",
           "AERIE_PRUNE_HISTORY": "1",
           "AERIE_REFRESH_RUN_CONFIG": str(refresh), "AERIE_INGEST_RUN_CONFIG": str(ingest)}
    code = """
import json
from dagster import EnvVar
from jobs.refresh import refresh_request
from jobs.snapshots import INGEST_RUN_CONFIG
r = definitions.defs.resources
print(json.dumps({
    "capture": [r["capture"].backend, r["capture"].sglang.aux_urls,
                r["capture"].sglang.final_urls, r["capture"].engine.max_concurrency,
                r["capture"].engine.api_key == EnvVar("AERIE_CAPTURE_ENGINE_API_KEY")],
    "trainer": [r["trainer"].world_size, r["trainer"].launcher, r["trainer"].device,
                r["trainer"].dtype],
    "serving": [r["serving"].mode, r["serving"].server_urls, r["serving"].verify_min_share,
                r["serving"].api_key == EnvVar("AERIE_SERVING_API_KEY")],
    "refresh": [r["refresh"].every, r["refresh"].drift_window, r["refresh"].max_interval,
                r["refresh"].retain_steps, r["refresh"].prune_policies,
                r["refresh"].prune_history],
    "refresh_request": refresh_request(12).run_config["ops"]["acceptance_eval"],
    "ingest_request": INGEST_RUN_CONFIG}))
"""
    done = _load_definitions(env, code)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["capture"] == ["sglang", ["http://gpu-1:30001", "http://gpu-2:30001"],
                              ["http://gpu-1:30002"], 32, True]
    assert got["trainer"] == [8, "deepspeed", "cuda", "bf16"]
    assert got["serving"] == ["vllm-reload", ["http://rollout-1:8000"], 0.9, True]
    assert got["refresh"] == [10, 3, 20, 8, True, True]
    assert got["refresh_request"] == {"config": {"device": "cuda", "dtype": "bfloat16"}}
    assert got["ingest_request"]["ops"]["hidden_state_shards"]["config"]["token_budget"] == \
        8192
    assert "never-printed" not in done.stdout + done.stderr


@pytest.mark.integration
@pytest.mark.parametrize("env,message", [
    ({"AERIE_TRAINER_LAUNCHER": "mpirun"}, "AERIE_TRAINER_LAUNCHER (TrainerResource.launcher)"),
    ({"AERIE_CAPTURE_HF_DEVICE": "gpu0"}, "AERIE_CAPTURE_HF_DEVICE (CaptureResource.hf.device)"),
    ({"AERIE_SERVING_NUM_STEPS": "0"}, "AERIE_SERVING_NUM_STEPS (ServingResource.num_steps)"),
    ({"AERIE_REFRESH_MAX_INTERVAL": "2"}, "max_interval 2 is below every 4"),
    ({"AERIE_PRUNE_POLICIES": "1"}, "prune_policies needs retain_steps > 0"),
    ({"AERIE_PRUNE_HISTORY": "yes"}, "prune_history needs retain_steps > 0"),
    ({"AERIE_REFRESH_RUN_CONFIG": "/nonexistent.yaml"}, "AERIE_REFRESH_RUN_CONFIG: cannot read"),
])
def test_a_bad_deployment_value_stops_the_definitions_loading(env, message):
    done = _load_definitions(env, "")
    assert done.returncode != 0
    assert message in done.stderr


@pytest.mark.integration
def test_the_configuration_reference_lists_every_variable():
    """docs/reference/configuration.md (generated by docs/gen_reference.py, committed) has a
    row for every field of every resource, with its variable, and names the run config
    variables: a field added without regenerating the page fails here."""
    import importlib

    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    missing = []
    for key, (module, name, prefix) in ENV_BUILT.items():
        mod = importlib.import_module(module)
        cls, names = getattr(mod, name), getattr(mod, "_ENV", None)
        section = page.split(f"\n## {key} {{#{key}}}\n", 1)[1].split("\n## ", 1)[0]
        missing += [f"{key}.{field}: {var}"
                    for field, var in env_names(cls, prefix, names).items()
                    if f"| `{field}` | `{var}` |" not in section]
    named = [v for module in ("storage", "mlflow", "ingest", "refresh")
             for v in importlib.import_module(f"resources.{module}")._ENV.values()]
    for var in ("AERIE_REFRESH_RUN_CONFIG", "AERIE_INGEST_RUN_CONFIG", "AERIE_HOME", *named):
        if f"`{var}`" not in page:
            missing.append(var)
    assert missing == []


def test_a_list_of_a_literal_parses_each_item():
    assert parse_value("a,b", list[Literal["a", "b"]], "X") == ["a", "b"]
    with pytest.raises(EnvConfigError):
        parse_value("a,c", list[Literal["a", "b"]], "X")


def test_the_evaluation_offers_the_devices_and_dtypes_it_accepts():
    import typing

    from assets.evaluation import EvalRunConfig
    from pipeline.evaluation.config import DEVICES, DTYPES

    fields = EvalRunConfig.model_fields
    assert typing.get_args(fields["device"].annotation) == DEVICES
    assert typing.get_args(fields["dtype"].annotation) == DTYPES


def test_a_check_of_several_fields_names_the_resource():
    with pytest.raises(EnvConfigError, match=r"RefreshPolicyResource: .*retain_steps 2 would "
                                             r"delete steps"):
        resource_from_env(importlib_resource("refresh", "RefreshPolicyResource"), "X_",
                          environ={"X_WINDOW": "4", "X_RETAIN_STEPS": "2"})
    with pytest.raises(TypeError, match=r"fields \['mode'"):
        resource_from_env(Example, "", names={"count": "COUNT"})


def importlib_resource(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(f"resources.{module}"), name)
