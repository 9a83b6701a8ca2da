"""Rollouts: the episode runner (``runner.py``: batched turns, or ``continuous.py``'s continuous
episodes), the turns both play (``turns.py``), and the generation engines behind them
(``engines/``: the token-ids interface, HF and vLLM, the stop at the answer line;
``engines.make_engine`` picks one from ``engine.name``)."""
