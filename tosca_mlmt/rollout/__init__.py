"""Rollouts: the episode runner (``runner.py``) and the generation engines behind it
(``engines/``: the token-ids interface, HF and vLLM, the stop at the answer line;
``engines.make_engine`` picks one from ``engine.name``)."""
