"""Calibrating a drafter's confidences (core/spec_calibration.py): the reliability table's ECE on known
data, and a miscalibrated synthetic drafter whose calibrated confidences match what verification sees."""
from __future__ import annotations

import numpy as np
import pytest

from pressroom.core.spec_calibration import ConfidenceCalibrator, ReliabilityTable


def test_the_table_bins_predictions_and_weighs_the_gaps():
    table = ReliabilityTable()
    for i in range(10):
        table.add(0.9, i < 6)  # says 0.9, 60% happen: a gap of 0.3 over 10 predictions
    for i in range(30):
        table.add(0.25, i < 6)  # says 0.25, 20% happen: 0.05 over 30
    assert table.total == 40
    assert table.ece == pytest.approx((10 * 0.3 + 30 * 0.05) / 40)
    assert [(r["bin"], r["n"], r["observed"]) for r in table.rows()] == [([0.2, 0.3], 30, 0.2), ([0.9, 1.0], 10, 0.6)]
    assert table.rows()[1]["predicted"] == pytest.approx(0.9)
    before = table.copy()
    table.add(1.0, True)  # 1.0 lands in the last bin
    assert table.since(before).rows() == [{"bin": [0.9, 1.0], "n": 1, "predicted": 1.0, "observed": 1.0}]
    assert ReliabilityTable.merged([before, before]).ece == pytest.approx(before.ece)
    assert ReliabilityTable().ece is None


def _verify(rng, says: list[float], truth) -> int:
    """Drafts accepted in a row, each with the chance `truth` gives its stated confidence."""
    accepted = 0
    for c in says:
        if rng.random() >= truth(c):
            break
        accepted += 1
    return accepted


@pytest.mark.parametrize("truth, raw_gap", [(lambda c: c * c, 0.1), (lambda c: 0.5 + 0.5 * c, 0.1)])
def test_calibrated_confidences_match_what_survives(truth, raw_gap):
    """An overconfident (c -> c^2) and an underconfident (c -> (1 + c) / 2) drafter: after it has learned
    from verification, the calibrated confidences of later drafts are within a few points of their
    acceptance, while the stated ones are far off."""
    rng = np.random.default_rng(0)
    k = 4
    calibrator = ConfidenceCalibrator(k)
    stated, calibrated = ReliabilityTable(), ReliabilityTable()
    for step in range(12000):
        says = rng.uniform(0.05, 1.0, size=k).tolist()
        accepted = _verify(rng, says, truth)
        if step >= 6000:  # judged on drafts it had not learned from yet
            planned = calibrator.calibrated(says)
            for j in range(min(accepted + 1, k)):
                stated.add(says[j], j < accepted)
                calibrated.add(planned[j], j < accepted)
        calibrator.observe(says, k, accepted)
    assert stated.ece > raw_gap
    assert calibrated.ece < 0.03


def test_an_unobserved_position_keeps_the_stated_confidence_and_decay_forgets():
    calibrator = ConfidenceCalibrator(2)
    assert calibrator.calibrated([0.8, 0.6]) == pytest.approx([0.8, 0.6])  # nothing learned: taken at its word
    for _ in range(400):
        calibrator.observe([0.8, 0.6], 2, 0)  # the first draft always rejected, the second never verified
    first, second = calibrator.calibrated([0.8, 0.6])
    assert first < 0.05 and second == pytest.approx(0.6)  # nothing says the second is wrong
    calibrator.decay(1e-6)
    assert calibrator.calibrated([0.8, 0.6])[0] > 0.7  # what it learned has faded
