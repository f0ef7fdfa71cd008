"""A stand-in for vLLM's HTTP API as far as serving a drafter goes (``server.py``)."""
