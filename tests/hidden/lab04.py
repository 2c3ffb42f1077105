"""Hidden checks for lab 04 (used by `mhc-lab grade`, never shown in a lab): one lane and thirty-two, widths of
one and 7168, one token, one-byte elements, one and fifty Sinkhorn iterations."""

from mhc_lab.measure import bytes_model, profiling
from mhc_lab.course.checks import call, expect_number
from mhc_lab.classroom.hidden_checks import hidden

SHAPES = [(1, 1), (1, 4096), (2, 7), (16, 7168), (32, 128)]


def _numbers(answer, reference, argument_sets, names, name):
    """Call the learner's function positionally, as the visible check does (its parameter names are the learner's)."""
    cases = []
    for args in argument_sets:
        case = ", ".join(f"{k}={v!r}" for k, v in zip(names, args))
        expect_number(call(answer, *args, case=case), reference(*args), case=case, name=name, rel=1e-9)
        cases.append(case)
    return cases


@hidden("4.1", "n = 1 to 32, C = 1 to 7168")
def _hc_elements(answer):
    return _numbers(answer, bytes_model.hc_forward_elements, SHAPES, ("n", "C"), "elements")


@hidden("4.2", "n = 1 to 32, C = 1 to 7168")
def _minimal_elements(answer):
    return _numbers(answer, bytes_model.minimal_site_forward_elements, SHAPES, ("n", "C"), "elements")


@hidden("4.3", "one token, one lane, slow and fast machines")
def _seconds(answer):
    sets = [(1, 4, 4096, 4800.0), (16384, 1, 7, 1.0), (3, 8, 2560, 25.6)]
    return _numbers(answer, bytes_model.memory_bound_seconds, sets, ("tokens", "n", "C", "bandwidth_gbs"), "seconds")


@hidden("4.4", "one lane, one-byte and eight-byte elements")
def _intensity(answer):
    sets = [(1, 4096, 2, 4), (16, 7, 1, 1), (4, 2560, 8, 8)]
    return _numbers(answer, bytes_model.res_apply_intensity, sets, ("n", "C", "stream_bytes", "coefficient_bytes"),
                    "FLOP per byte")


@hidden("4.5", "one, two and fifty iterations")
def _launches(answer):
    return _numbers(answer, profiling.sinkhorn_launches, [(1,), (2,), (50,)], ("iterations",), "launches")
