"""Eq. 20 of mHC (arXiv 2512.24880): the recompute block size, against hand-worked values and brute force."""

import math

import pytest

from mhc_lab.reference.recompute import (
    approximate_block,
    memory_without_recompute,
    optimal_block,
    recompute_memory,
)


@pytest.mark.parametrize("layers, block, memory", [(30, 5, 54), (60, 6, 76), (12, 3, 34)])
def test_worked_values_for_four_lanes(layers, block, memory):
    # n = 4: 4 * ceil(30 / 5) + 6 * 5 = 24 + 30 = 54; 4 * 10 + 36 = 76; 4 * 4 + 18 = 34
    assert optimal_block(4, layers) == (block, memory)


def test_the_continuous_optimum_is_near_the_integer_one():
    assert math.isclose(approximate_block(4, 30), math.sqrt(20))
    assert math.isclose(approximate_block(4, 60), math.sqrt(40))
    for n in (1, 2, 4, 8):
        for layers in (2, 7, 30, 61, 120):
            block, _ = optimal_block(n, layers)
            assert abs(block - approximate_block(n, layers)) <= 0.5 * approximate_block(n, layers) + 1


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("layers", [1, 5, 30, 97])
def test_optimum_is_the_brute_force_minimum_and_beats_keeping_everything(n, layers):
    memories = [n * -(-layers // b) + (n + 2) * b for b in range(1, layers + 1)]
    block, memory = optimal_block(n, layers)
    assert memory == min(memories) and memories.index(memory) + 1 == block
    assert memory <= memory_without_recompute(n, layers) + n


@pytest.mark.parametrize("args", [(0, 30, 5), (4, 30, 0), (4, 30, 31), (4, 2.5, 1), (True, 30, 5)])
def test_bad_input_is_a_clear_error(args):
    with pytest.raises(ValueError, match="expected"):
        recompute_memory(*args)
