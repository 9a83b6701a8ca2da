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


@pytest.mark.parametrize("summary, config, want", [
    # an mbpp collect written before metrics.environment knew of feedback_context: its summary says honest
    ("honest", {"task": {"name": "mbpp"}, "episode": {"rounds": 1}}, "privileged:grading_tests"),
    ("honest", {"task": {"name": "mbpp"}, "episode": {"rounds": 1, "feedback": "tool"}}, "honest"),
    ("honest", {"task": {"name": "mbpp"}, "episode": {"rounds": 0}}, "honest"),
    ("honest", {"task": {"name": "arith"}, "episode": {"rounds": 1}}, "honest"),
    ("privileged:writer_sees_verdict", {"task": {"name": "mbpp"}, "episode": {"rounds": 1}},
     "privileged:writer_sees_verdict"),
])
def test_an_honest_summary_of_a_writer_that_read_the_grading_tests_is_corrected(summary, config, want):
    assert environment_of({"config": config, "summary": {"environment": summary}}) == want
