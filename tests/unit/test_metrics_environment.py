"""metrics.environment: what the writer saw labels the episodes honest, honest:tool or privileged:<what>."""

import pytest

from factories import make_episodes
from tosca_mlmt.metrics import environment, summarize


def _feedback(episodes):
    return [t for ep in episodes for t in ep.turns if t.kind == "feedback"]


@pytest.mark.parametrize("info, want", [({}, "honest"), ({"writer_sees": "confidence"}, "honest"),
                                        ({"writer_sees": "tool"}, "honest:tool"), ({"feedback": "tool"}, "honest:tool"),
                                        ({"writer_sees": "verdict"}, "privileged:writer_sees_verdict"),
                                        ({"writer_sees": "tool", "feedback": "verdict"}, "privileged:verdict_feedback")])
def test_the_label_names_what_the_writer_saw(info, want):
    episodes = make_episodes(3)
    _feedback(episodes)[1].info.update(info)  # one episode of three is enough to label them all
    assert environment(episodes) == summarize(episodes)["environment"] == want


def test_the_verifiers_feedback_context_in_a_writer_state_is_privileged():
    """mbpp's verifier hands the writer the first failing grading test's error (feedback_context): a writer that
    read it knows what no honest system knows at test time, whatever else it saw."""
    episodes = make_episodes(3)
    episodes[2].turns[2].info["feedback_context"] = "AssertionError: assert f(3) == 9"
    assert environment(episodes) == "honest"  # on the last attempt, after the last feedback: no writer read it
    episodes[1].turns[0].info["feedback_context"] = "AssertionError: assert f(2) == 4"
    assert environment(episodes) == "privileged:grading_tests"
    _feedback(episodes[:1])[0].info["writer_sees"] = "tool"  # another episode's tool hides nothing here
    assert summarize(episodes)["environment"] == "privileged:grading_tests"
    _feedback(episodes[1:2])[-1].info["writer_sees"] = "tool"  # the public check took the grading error's place
    assert summarize(episodes)["environment"] == "honest:tool"
