"""Every lab's setup() fixes PyTorch's CPU threads for timing, and lab 04's timing figures say what they measured."""

import pytest
import torch

from mhc_lab.bench import memory_wall
from mhc_lab.course import checks
from mhc_lab.course import setup as course_setup


@pytest.fixture
def threads_restored():
    before, variant = torch.get_num_threads(), checks.variant()
    yield
    torch.set_num_threads(before)
    checks.set_variant(**variant)


def test_setup_pins_one_thread_and_records_it(threads_restored):
    torch.set_num_threads(2)
    cfg = course_setup.setup("small", "cpu", 0, quiet=True)
    assert course_setup.TIMING_THREADS == 1
    assert torch.get_num_threads() == 1 and cfg.threads == 1
    assert "set_num_threads(TIMING_THREADS)" in course_setup.setup.__doc__  # the docstring says what and why
    assert "busy" in course_setup.setup.__doc__


def test_lane_sweep_records_where_it_was_timed_and_its_title_states_the_measurement(threads_restored):
    torch.set_num_threads(1)
    sweep = memory_wall.lane_sweep(8, 4, (1, 2), "cpu", rounds=2, calls=1)
    assert all(r["where"] == "CPU, 1 thread" and (r["rounds"], r["calls"]) == (2, 1) for r in sweep)
    assert sweep[0]["residual_s"] == sweep[1]["residual_s"]  # one lane whatever n: timed once
    title = memory_wall.lane_sweep_figure(sweep).layout.title.text
    assert title.startswith("Time per forward call, n lanes")
    assert "CPU, 1 thread" in title and "8 tokens, C = 4" in title
    assert "median of 2 rounds, each the fastest of 1 calls from cold caches" in title
    assert "cost far more" not in title  # a measurement, not a conclusion the learner's numbers may contradict


def test_timing_label_counts_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert memory_wall.timing_label("cpu") == "CPU, 1 thread"
        torch.set_num_threads(2)
        assert memory_wall.timing_label("cpu") == "CPU, 2 threads"
    finally:
        torch.set_num_threads(before)


def test_comparison_figure_names_where_the_live_rows_were_timed():
    rows = [{"C": 8, "layer": layer, "mode": "eager", "pass": "forward", "median_s": s, "label": layer}
            for layer, s in (("residual", 1e-5), ("hc", 1e-4))]
    fig = memory_wall.comparison_figure(rows, None, where="CPU, 1 thread")
    assert fig.data[0].name == "this machine (live, CPU, 1 thread, C = 8)"
    assert "?" not in fig.layout.title.text and "Time per forward call" in fig.layout.title.text
