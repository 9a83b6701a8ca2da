"""The high-level (feedback writer) learner: offline strategic Q-learning + AWR.

``mlmt train-upper`` (pipelines/train_upper.py) fits the writer from logged snapshots only:

* dataset.py   logged writer turns -> transitions (s, a, r, s', done, mu(a|s), feedback ids)
* critic.py    Q(s, .) from the writer's state features: a Q head, or ToSCA's strategy-token
               logits (exported as an equivalent Q head); V head for IQL; the target head
* trunk.py     the writer LM as features + text policy; the adapter's target copy (logits)
* objective.py TD (DQN or IQL backup) + CQL / expectile terms; AWR / filtered-BC text loss
* learner.py   one optimiser step, its evaluation of Q, checkpoint state, export of the writer
* report.py    Q by strategy, importance-weighted value of the learned policy, preferences
* stats.py     one train-upper step as a typed record, and the ``upper/`` rows built from it

Left out: the optional token-level ILQL head (Q/V heads over the vocabulary, decoding with
logits + beta * (Q - V)). Why: (1) its policy only exists at decoding time, so every engine
that samples the writer (the hf logits processors *and* vLLM, which cannot run an extra
value head without a custom model class) would need an ILQL decoding path, while the
saved writer here is a plain LoRA adapter + Q head that collect and train-joint already
load; (2) the feedback's only reward arrives after the solver's refinement, one scalar per
~64 feedback tokens, and snapshots hold hundreds to thousands of decisions: token-level
credit from that is mostly variance, and the strategy-level Q already carries the
decision that matters; (3) AWR on the logged feedback tokens gives the text an offline,
advantage-weighted update without a second decoding-time model. The pieces it would need
(expectile_loss, cql_penalty, polyak_update) are in algos/qlearning.py.
"""
