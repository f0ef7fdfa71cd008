"""Stage 2, ``tokenized_rollouts``: input ids + loss masks per sample.

- :mod:`.chat_masks`: the chat template rendered with offsets → per-token loss masks.
- :mod:`.schema`: the tokenized dataset's Arrow schema.
- :mod:`.stage`: ``run`` tokenizes one step's accepted rollouts.
- :mod:`.reader`: streams a committed tokenized dataset (for capture and held-out prompts).
- :mod:`.config`: :class:`~.config.TokenizeConfig` (torch-free: the run config mirrors it).
"""
