"""Aerie's framework-free core, laid out like the flow it runs.

One package per stage, in flow order; each has a ``stage`` module (two for ``release``)
whose ``run`` is what the stage's Dagster asset calls:

====  =============  ==========================  ==========================================
 #    package        asset                       ``run`` does
====  =============  ==========================  ==========================================
 1    ``snapshot``   ``rollout_snapshot``        validate a step's rollouts, quarantine bad
 2    ``tokenize``   ``tokenized_rollouts``      chat template + offset-mapping loss masks
 3    ``capture``    ``hidden_state_shards``     hidden states → Parquet shards
 4    ``vocab``      ``vocab_mapping``           draft vocab of the K-step window
 5    ``training``   ``drafter_checkpoint``      TTT training under DeepSpeed, export
 6    ``evaluation`` ``acceptance_eval``         speculative decoding on held-out prompts
 7    ``release``    ``registered_drafter``      MLflow version with lineage (``register``)
      ``release``    ``serving_drafter``         gate + promotion (``serve``)
====  =============  ==========================  ==========================================

Below the stages sits the foundation every stage may use: :mod:`storage` (the fsspec
storage layer; :mod:`owners`: which process a temporary file belongs to;
:mod:`local_tree`: a local directory read for publishing, nothing from outside it;
:mod:`s3_client`: S3 clients that never hang), :mod:`layout`
(every path of the storage tree), :mod:`formats` (the version of each format a stage
writes), :mod:`records` (versioned JSON records), :mod:`contracts`
+ :mod:`manifest` (dataset manifests), :mod:`verified` (reading committed datasets, every
byte checked against its manifest, and the local dataset cache), :mod:`parquet`,
:mod:`serving_now` (the record of the drafter serving now: release writes it, training's
warm start and evaluation's champion read it), :mod:`drafters` (the drafter-algorithm
seam: what every algorithm provides), :mod:`eagle3` (EAGLE-3: the model, TTT, the SGLang
format, its format check and proposer), :mod:`dflash` (DFlash: the block drafter, its loss,
export and proposer), :mod:`algorithms` (every drafter algorithm,
registered once), :mod:`sampling` (the sampler settings a snapshot records and the
evaluation decodes at) and :mod:`attention_kernels` (the fused attention kernels capture,
training and evaluation run with).

Data flows one way: a stage imports the foundation and earlier stages, never a later one;
the foundation imports no stage. :mod:`checks` (quality checks over several stages),
:mod:`demo` (the demo RL trainer), :mod:`adapters` (real RL trainers writing snapshots
and reading the serving drafter back) and :mod:`monitor` (the serving drafter after its
promotion: acceptance as the RL engine saw it, verification, drift) and :mod:`retention`
(deleting old steps' data once it is no longer needed, across several stages) sit on top.
``tests/test_architecture.py`` enforces this, and that nothing here imports ``dagster``.
"""

STAGES = ("snapshot", "tokenize", "capture", "vocab", "training", "evaluation", "release")
FOUNDATION = ("owners", "local_tree", "s3_client", "storage", "layout", "formats", "records",
              "contracts", "manifest", "verified", "parquet", "serving_now", "drafters", "eagle3",
              "dflash", "algorithms", "sampling", "attention_kernels", "argv_template")
ON_TOP = ("checks", "demo", "adapters", "monitor", "retention")
