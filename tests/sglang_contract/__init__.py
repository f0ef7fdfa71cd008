"""A stand-in for SGLang's HTTP API (``server.py``) and the fixtures that start it."""
