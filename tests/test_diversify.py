import math

import numpy as np

from crl_gym.experience.diversify import diversity_scores, is_recent, select_diverse


def test_scores_hand_computed():
    # λ = 0.5; candidates (sim, count, recent):
    #   a: 0.9, c=3, recent -> 0.9 - 0.5*ln(4) - 1 = 0.9 - 0.693147 - 1 = -0.793147
    #   b: 0.8, c=0, no     -> 0.8 - 0 - 0            =  0.8
    #   c: 0.7, c=1, no     -> 0.7 - 0.5*ln(2)        =  0.7 - 0.346574 = 0.353426
    s = diversity_scores(np.array([0.9, 0.8, 0.7]), np.array([3, 0, 1]),
                         np.array([True, False, False]), lam=0.5)
    np.testing.assert_allclose(s, [-0.7931472, 0.8, 0.3534264], atol=1e-6)
    assert math.isclose(s[2], 0.7 - 0.5 * math.log(2))


def test_recent_window():
    # now = 100, window = 10: last=95 is recent, last=85 is not, 0 means never retrieved
    assert is_recent(np.array([95.0, 85.0, 0.0, 90.5]), 100.0, 10.0).tolist() == [
        True, False, False, True]


def test_select_diverse_prefers_unused_entries():
    sim = np.array([0.90, 0.85, 0.50])
    # first entry retrieved 9 times and 1 s ago: 0.9 - 0.1*ln(10) - 1 = -0.330; second 0.85
    idx = select_diverse(sim, np.array([9, 0, 0]), np.array([99.0, 0, 0]),
                         k=2, now=100.0, lam=0.1, window=5.0)
    assert idx.tolist() == [1, 2]
    # with λ = 0 and nothing recent the order is by similarity; ties keep pool order
    idx = select_diverse(np.array([0.5, 0.5, 0.7]), np.zeros(3), np.zeros(3),
                         k=3, now=1.0, lam=0.0, window=5.0)
    assert idx.tolist() == [2, 0, 1]
