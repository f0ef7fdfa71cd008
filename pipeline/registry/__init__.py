"""Registry stage: the acceptance gate, the MLflow drafter registry and promotion.

- :mod:`~pipeline.registry.gate`: the pure promote/refuse decision.
- :mod:`~pipeline.registry.format_check`: is a drafter directory loadable by SGLang?
- :mod:`~pipeline.registry.lineage`: required lineage tags of a registered version.
- :mod:`~pipeline.registry.mlflow_registry`: versions and aliases in the MLflow registry;
  :mod:`~pipeline.registry.mlflow_runs`: the training runs they come from.
- :mod:`~pipeline.registry.lock`: the file lock that serialises promotions.
- :mod:`~pipeline.registry.promotion`: promote / force_promote / rollback under a lock.

Importing this package does not import ``mlflow``.
"""
