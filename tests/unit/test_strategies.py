import numpy as np
import pytest

from tosca_mlmt.strategies import behaviour_distribution, sample_strategies


def test_uniform_without_q_values():
    p = behaviour_distribution(None, 6, "auto")
    np.testing.assert_allclose(p, np.full((1, 6), 1 / 6))


def test_softmax_matches_direct_formula():
    q = np.array([[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]])
    p = behaviour_distribution(q, 3, "softmax", temperature=0.5)
    ref = np.exp(q / 0.5) / np.exp(q / 0.5).sum(1, keepdims=True)
    np.testing.assert_allclose(p, ref, rtol=1e-12)
    # auto mixes epsilon of uniform exploration into the softmax once Q-values exist
    np.testing.assert_allclose(behaviour_distribution(q, 3, "auto", temperature=0.5, epsilon=0.3),
                               0.1 + 0.7 * ref)


def test_epsilon_greedy_and_greedy():
    q = np.array([[0.1, 0.9, 0.3]])
    p = behaviour_distribution(q, 3, "epsilon_greedy", epsilon=0.3)
    np.testing.assert_allclose(p, [[0.1, 0.8, 0.1]])
    np.testing.assert_allclose(behaviour_distribution(q, 3, "greedy"), [[0, 1, 0]])


def test_sampling_frequencies_and_logged_probabilities():
    probs = np.array([[0.7, 0.2, 0.1]])
    a, pa = sample_strategies(probs, 20000, np.random.default_rng(0))
    freq = np.bincount(a, minlength=3) / len(a)
    np.testing.assert_allclose(freq, probs[0], atol=0.015)
    np.testing.assert_allclose(pa, probs[0][a])


def test_q_head_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 actions"):
        behaviour_distribution(np.zeros((1, 3)), 6, "softmax")
