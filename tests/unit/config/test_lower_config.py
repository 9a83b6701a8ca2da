"""The lower section's knobs checked at load (config/lower.py)."""

import pytest


@pytest.mark.parametrize("field,bad", [("strategy_temperature", 0.0), ("strategy_temperature", -0.5),
                                       ("strategy_epsilon", 1.5), ("strategy_epsilon", -0.2)])
def test_lower_strategy_knobs_are_validated_at_load(field, bad):
    from tosca_mlmt.config import load_config
    from tosca_mlmt.errors import ConfigError

    with pytest.raises(ConfigError, match=f"lower.{field}"):
        load_config(overrides={f"lower.{field}": bad})


@pytest.mark.parametrize("overrides,field", [
    ({"lower.old_logprobs": "behaviour"}, "lower.old_logprobs"),
    ({"lower.bonus.scorer": "engine"}, "lower.bonus.scorer"),
    ({"solver_sampling.temperature": 0.0}, "lower.logprob_temperature")])
def test_sampling_logprob_temperature_refuses_what_only_raw_logprobs_can_serve(overrides, field):
    from tosca_mlmt.config import load_config
    from tosca_mlmt.errors import ConfigError

    load_config(overrides={"lower.logprob_temperature": "raw", **overrides})  # raw serves them all
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides={"lower.logprob_temperature": "sampling", **overrides})


@pytest.mark.parametrize("overrides,why", [
    ({"episode.rounds": 2}, "episode.rounds=1"),
    ({"solver_sampling.temperature": 0.0}, "temperature > 0"),
    ({"lower.train_refine": False}, "train_refine=false"),
])
def test_refine_groups_refuse_what_cannot_branch_or_train_them(overrides, why):
    from tosca_mlmt.config import load_config
    from tosca_mlmt.errors import ConfigError

    with pytest.raises(ConfigError, match="lower.refine_samples") as e:
        load_config(overrides={"lower.refine_samples": 4, **overrides})
    assert why in str(e.value)
    assert load_config(overrides={"lower.refine_samples": 4}).lower.refine_samples == 4
    load_config(overrides={"lower.refine_samples": 1, **overrides})  # one refine: nothing to refuse
