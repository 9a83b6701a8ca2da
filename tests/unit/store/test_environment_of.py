"""store.environment_of: the label of a manifest without a summary comes from its config as metrics.environment's."""

import pytest

from tosca_mlmt.store import environment_of


@pytest.mark.parametrize("config, want", [
    ({"task": {"name": "arith"}, "episode": {"rounds": 1}}, "honest"),
    ({"task": {"name": "arith"}, "episode": {"rounds": 1, "writer_sees": "tool"}}, "honest:tool"),
    ({"task": {"name": "arith"}, "episode": {"rounds": 1, "feedback": "tool"}}, "honest:tool"),
    ({"task": {"name": "mbpp"}, "episode": {"rounds": 1}}, "privileged:grading_tests"),
    ({"task": {"name": "mbpp"}, "episode": {"rounds": 1, "writer_sees": "tool"}}, "honest:tool"),
    ({"task": {"name": "mbpp"}, "episode": {"rounds": 0}}, "honest"),  # no feedback round: no writer read it
])
def test_the_config_labels_a_manifest_without_a_summary(config, want):
    assert environment_of({"config": config}) == want
    assert environment_of({"config": config, "summary": {"environment": "honest:tool"}}) == "honest:tool"
