"""Run config a deployment gives the runs the daemon launches.

``AERIE_INGEST_RUN_CONFIG`` (``ingest_step``) and ``AERIE_REFRESH_RUN_CONFIG``
(``drafter_refresh``) each name a YAML or JSON file of Dagster run config, e.g. the
evaluation's device and dtype, or training hyper-parameters::

    ops:
      acceptance_eval:
        config: {device: cuda, dtype: bfloat16}

It is read when the definitions load and merged over the job's own defaults: it is the
Launchpad's default and what every sensor and schedule request carries (a request with run
config of its own is run with that config whole, never the job's default). A missing file,
bad YAML or anything but a mapping stops the code location from loading, naming the
variable. :func:`deep_merge` is how a run config is laid over another.

``AERIE_DRAFTER_ALGORITHM`` (``eagle3`` by default, ``eagle3.1`` or ``dflash``) names the
drafter algorithm the refresh job trains: it becomes ``drafter_checkpoint``'s
``drafter_algorithm`` in the job's default run config, under what ``AERIE_REFRESH_RUN_CONFIG``
sets (and, unless ``AERIE_CAPTURE_AUX_LAYER_IDS`` is set, which target layers the capture
records: ``resources.capture``). A name no
algorithm has stops the code location from loading, naming the choices.
"""

import os
from pathlib import Path

from pipeline.algorithms import UnknownAlgorithmError, algorithm
from resources.env import EnvConfigError

ALGORITHM_VAR = "AERIE_DRAFTER_ALGORITHM"


def drafter_algorithm_from_env() -> dict:
    """The training run config that ``AERIE_DRAFTER_ALGORITHM`` sets; ``{}`` when unset."""
    name = os.environ.get(ALGORITHM_VAR)
    if not name:
        return {}
    try:
        algorithm(name)
    except UnknownAlgorithmError as e:
        raise EnvConfigError(f"{ALGORITHM_VAR}: {e}") from None
    return {"ops": {"drafter_checkpoint": {"config": {"drafter_algorithm": name}}}}


def run_config_from_env(var: str) -> dict:
    """The run config in the file ``$var`` names; ``{}`` when ``var`` is unset."""
    path = os.environ.get(var)
    if not path:
        return {}
    import yaml

    try:
        config = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise EnvConfigError(f"{var}: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise EnvConfigError(f"{var}: {path} is not YAML or JSON: {e}") from None
    if not isinstance(config, dict) or not config:
        raise EnvConfigError(f"{var}: {path} must hold a mapping of run config (ops:, "
                             f"resources:, ...), got {type(config).__name__}")
    return config


def deep_merge(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in, recursively for nested dicts (run configs)."""
    out = dict(base)
    for k, v in over.items():
        both = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = deep_merge(out[k], v) if both else v
    return out
