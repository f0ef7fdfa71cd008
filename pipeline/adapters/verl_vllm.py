"""verl's vLLM worker extension plus Aerie's draft loader, for verl's own vLLM servers.

verl (0.9.1) starts each vLLM server with ``worker_extension_cls`` set to its
``vLLMColocateWorkerExtension`` and lets ``engine_kwargs.vllm`` override it; this class
keeps verl's methods and adds :class:`~pipeline.release.vllm_worker.AerieDraftLoader`'s::

    +actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=pipeline.adapters.verl_vllm.AerieVerlWorkerExtension

Imports vLLM (through verl's extension): only verl's vLLM worker processes load it.
"""

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from pipeline.release.vllm_worker import AerieDraftLoader


class AerieVerlWorkerExtension(vLLMColocateWorkerExtension, AerieDraftLoader):
    """verl's colocated-sync methods and Aerie's ``aerie_load_draft_weights``."""
