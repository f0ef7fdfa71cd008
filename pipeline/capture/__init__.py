"""Stage 3, ``hidden_state_shards``: the policy's EAGLE-3 hidden states in Parquet shards.

- :mod:`.base`: the capture backend protocol; :mod:`.hf` (in-process), :mod:`.sglang` (SGLang
  servers) and :mod:`.vllm` (vLLM servers writing files) implement it, the engines over
  :mod:`.engine_http`; :mod:`.backends` opens one.
- :mod:`.parallel`: one step extracted by several processes (``hf``).
- :mod:`.shards`: the shard schema, writer and reader.
- :mod:`.heldout`: the salted held-out split that keeps evaluation prompts out of shards.
- :mod:`.stage`: ``run`` extracts one step, resumably, shard by shard.
- :mod:`.window`: reading the committed shards and policy of a K-step window (for vocab,
  training and evaluation).
- :mod:`.config`: :class:`~.config.ExtractConfig` (torch-free: the run config mirrors it).
"""
