"""Hidden-state capture backends (``hf`` in-process, ``sglang`` over HTTP)."""
