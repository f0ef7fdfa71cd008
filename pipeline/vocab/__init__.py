"""Stage 4, ``vocab_mapping``: the draft vocabulary of a refresh step's window.

- :mod:`.mapping`: token counting and the d2t/t2d mapping (SGLang's format).
- :mod:`.stage`: ``run`` counts the window's shards and commits the mapping (content-keyed
  cache plus a per-step pointer).
- :mod:`.config`: the default draft vocab size (torch-free).
"""
