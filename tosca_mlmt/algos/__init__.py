"""Pure RL math: advantage estimators, policy/value losses, Q-learning targets (registries)."""


def registrar(table: dict):
    """A ``@register(name)`` decorator that files functions into ``table`` (the estimator,
    loss and bootstrap registries are each such a table)."""

    def register(name: str):
        def deco(fn):
            table[name] = fn
            return fn

        return deco

    return register
