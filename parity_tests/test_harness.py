"""The measures refuse what would make a comparison vacuous: empty inputs, different lengths, other tensors.

A parity check over an empty curve (a run that logged nothing) or over the common prefix of a truncated
run would pass whatever the loops compute. Mutant caught: the old `curve_rel_diff` returned 0.0 for
empty inputs and broadcast a length-1 curve against any other (both tests below failed on it).
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.harness import ParityTable, abs_diff, curve_rel_diff, tree_rel_diff


@pytest.mark.parametrize("measure", [curve_rel_diff, abs_diff])
def test_curve_measures_refuse_empty_inputs(measure):
    with pytest.raises(ValueError, match="nothing to compare"):
        measure([], [])
    with pytest.raises(ValueError, match="nothing to compare"):
        measure([1.0], [])


@pytest.mark.parametrize("measure", [curve_rel_diff, abs_diff])
def test_curve_measures_refuse_different_lengths(measure):
    with pytest.raises(ValueError, match="different shapes"):
        measure([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="different shapes"):
        measure([1.0], [1.0, 5.0])  # would broadcast
    assert measure([1.0, 2.0], [1.0, 2.5]) > 0


def test_tree_rel_diff_refuses_empty_trees_and_other_tensors():
    a = {"w": np.ones((2, 2)), "b": np.zeros(2)}
    with pytest.raises(ValueError, match="nothing to compare"):
        tree_rel_diff({}, {})
    with pytest.raises(ValueError, match="different tensors"):
        tree_rel_diff(a, {"w": np.ones((2, 2))})
    with pytest.raises(ValueError, match="shapes"):
        tree_rel_diff(a, {"w": np.ones((2, 3)), "b": np.zeros(2)})
    assert tree_rel_diff(a, {"w": 2 * np.ones((2, 2)), "b": np.zeros(2)})[0] == pytest.approx(0.5)


def test_a_check_fails_on_nan_and_above_tolerance_and_refuses_unknown_kinds():
    table = ParityTable()
    table.check("ok", 1.0, 1.0, "equal is within")
    with pytest.raises(AssertionError):
        table.check("nan", float("nan"), 1.0, "NaN fails")
    with pytest.raises(AssertionError):
        table.check("above", 2.0, 1.0, "above fails")
    with pytest.raises(ValueError):
        table.check("kind", 0.0, 1.0, "unknown kind", kind="other")
    assert [c.passed for c in table.checks] == [True, False, False]
