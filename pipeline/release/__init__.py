"""Stage 7, ``registered_drafter`` → ``serving_drafter``: registry, gate, promotion, serving.

- :mod:`.register`: ``run`` logs and registers a refresh's drafter with its lineage.
- :mod:`.serve`: ``run`` asks the gate and promotes through :mod:`.promotion`.
- :mod:`.gate`: the pure promote/refuse decision; :mod:`.format_check`: is a drafter
  directory loadable by SGLang?
- :mod:`.lineage`, :mod:`.mlflow_registry`, :mod:`.mlflow_runs`: versions, aliases and the
  runs they come from in MLflow.
- :mod:`.lock`, :mod:`.promotion`: promote / force_promote / rollback under a lock, serving
  first, then alias ``champion``.
- :mod:`.ledger` (the serving record in storage, see :mod:`pipeline.serving_now`),
  :mod:`.backend` (the ``manifest`` mode), :mod:`.restart` (``sglang-restart``,
  ``vllm-restart``), :mod:`.vllm_reload` (``vllm-reload``).

Importing this package does not import ``mlflow``.
"""
