"""The low-level (solver) learner: PPO with the context-dependency bonus.

``mlmt train-lower`` (pipelines/train_lower.py) runs one ``LowerLearner.update`` per iteration:

* trajectory.py  logged episodes -> one token sequence per episode, turn spans, feedback spans
* scoring.py     the solver's forwards: training, and the sharded no-grad scoring before an update
                 (old / reference / no-feedback log-probs, values, critic features) as typed records
* objective.py   token rewards (SCoRe, KL penalty), the bonus on refine tokens, one micro-batch's loss
* archer.py      ArCHer's utterance-level critic: features, TD targets, its loss
* learner.py     orchestration: score -> rewards -> registered estimator -> bonus -> epochs; checkpoints
* stats.py       the per-iteration statistics, and the typed records of an update and an iteration

The RL maths itself (estimators, policy losses, the bonus) lives in algos/ as pure functions.
"""
