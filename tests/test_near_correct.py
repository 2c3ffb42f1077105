"""Near-correct answers are told they are close, and named mistakes are named as themselves, in labs 00-05.

Every exercise is fed the library's own answer (as a learner's copy) with a small slip: every number scaled by
1 + 3e-5, or the arithmetic done in float32 where float64 is expected. Either the answer still passes (the
exercise's tolerance allows it), or the message says it is close, shows two numbers that differ, and names no
usual mistake. The usual mistakes, made with the same slips on top, are still named as themselves."""

import re

import pytest
import torch

from mhc_lab.course.checks import CheckFailed, all_exercises, get_exercise, run_check

from test_checks import own_copy

EXERCISES = [e for e in all_exercises() if int(e.id.split(".")[0]) <= 5]
TILE_PROGRAMS = {"5.1", "5.2", "5.3"}  # the answer is a factory of tile programs: its outputs are slipped instead
SCALE = 1 + 3e-5


def test_labs_00_to_05_are_all_here():
    assert {e.id.split(".")[0] for e in EXERCISES} == {"0", "1", "2", "3", "4", "5"}


# ---- slips ----------------------------------------------------------------------------------------------------


def _map(value, tensor, number):
    """``value`` with every floating tensor passed through ``tensor`` and every number through ``number``."""
    if isinstance(value, torch.Tensor):
        return tensor(value) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        items = [_map(v, tensor, number) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _map(v, tensor, number) for k, v in value.items()}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return number(value)
    return value


def scaled(fn, factor=SCALE):
    """``fn`` with every number of its result multiplied by ``factor``."""
    def answer(*args, **kwargs):
        return _map(fn(*args, **kwargs), lambda t: t * factor, lambda v: v * factor)
    return answer


def in_float32(fn):
    """``fn`` computed in float32: float64 tensor inputs go in as float32, float64 results come back as float64
    (rounded to float32 on the way), numbers come back rounded to float32."""
    def answer(*args, **kwargs):
        dtypes = []

        def down(t):
            dtypes.append(t.dtype)
            return t.float() if t.dtype == torch.float64 else t

        args, kwargs = _map((args, kwargs), down, lambda v: v)
        out = fn(*args, **kwargs)
        wide = torch.float64 in dtypes
        return _map(out, lambda t: t.double() if wide and t.dtype == torch.float32 else t,
                    lambda v: float(torch.tensor(v, dtype=torch.float32)))
    return answer


@pytest.fixture
def tile_outputs_scaled(monkeypatch):
    """Lab 05's checks run the learner's compiled program: scale what it writes, the rows it was given only."""
    from mhc_lab.course.exercises import lab05

    compile_program = lab05.compile_learner_program

    class Scaled:
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, *tensors):
            self.kernel(*tensors)
            tensors[-1].mul_(SCALE)

        def __getattr__(self, name):
            return getattr(self.kernel, name)

    monkeypatch.setattr(lab05, "compile_learner_program", lambda *a, **k: Scaled(compile_program(*a, **k)))


# ---- the verdicts ---------------------------------------------------------------------------------------------


def _failure(id, answer) -> str | None:
    try:
        run_check(id, answer)
    except CheckFailed as failure:
        return str(failure)
    return None


def assert_reported_close(id, answer):
    message = _failure(id, answer)
    if message is None:
        return  # within the exercise's tolerance
    assert "usual mistake" not in message, f"exercise {id}: a near-correct answer got a named mistake: {message}"
    assert re.search(r"\bclose\b", message), f"exercise {id}: a near-correct answer not called close: {message}"
    for want, have in re.findall(r"expected (?:[^,=]+ = )?(-?[\d.e+-]+), got (-?[\d.e+-]+)", message):
        assert want != have, f"exercise {id}: the two numbers print alike: {message}"


@pytest.mark.parametrize("exercise", [e for e in EXERCISES if e.id not in TILE_PROGRAMS], ids=lambda e: e.id)
def test_a_correct_answer_scaled_slightly_is_reported_close(exercise):
    assert_reported_close(exercise.id, scaled(own_copy(exercise.library_function())))


@pytest.mark.parametrize("id", sorted(TILE_PROGRAMS))
def test_a_tile_program_whose_output_is_scaled_slightly_is_reported_close(id, tile_outputs_scaled):
    assert_reported_close(id, own_copy(get_exercise(id).library_function()))


FLOAT32_SLIP = [e for e in EXERCISES if e.id not in TILE_PROGRAMS and e.id != "1.5"]  # 1.5 runs a float64 model


@pytest.mark.parametrize("exercise", FLOAT32_SLIP, ids=lambda e: e.id)
def test_a_correct_answer_computed_in_float32_is_reported_close(exercise):
    assert_reported_close(exercise.id, in_float32(own_copy(exercise.library_function())))


def test_the_reported_cases_of_the_issue():
    # 1.4 in float32: close, not "you multiplied by W^T", and the two numbers printed differ
    message = _failure("1.4", in_float32(own_copy(get_exercise("1.4").library_function())))
    assert "close" in message and "Wᵀ" not in message, message
    # 2.5 with a LayerNorm eps of 1e-6 instead of 1e-5: close, not "your alpha_r is transposed"
    from mhc_lab.course.exercises import lab02
    import torch.nn.functional as F

    def eps_slip(x, static, w_m, w_r, w_beta, s_alpha, s_beta):
        return lab02._dyn(x, static, w_m, w_r, w_beta, s_alpha, s_beta,
                          norm=lambda v: F.layer_norm(v, (v.shape[-1],), eps=1e-6))

    message = _failure("2.5", eps_slip)
    assert "close" in message and "transposed" not in message and "usual mistake" not in message, message


# ---- named mistakes are named as themselves --------------------------------------------------------------------


# The first two usual mistakes of every exercise, and every mistake of counting elements instead of bytes.
NAMED = [(e, m) for e in EXERCISES for m in e.mistakes[:2]]
NAMED += [(e, m) for e in EXERCISES for m in e.mistakes[2:] if "elements, not bytes" in m.says]


@pytest.mark.parametrize("exercise, mistake", NAMED, ids=lambda v: getattr(v, "id", None) or v.says[:30])
def test_a_usual_mistake_is_named_as_itself(exercise, mistake):
    message = _failure(exercise.id, mistake.answer)
    assert message is not None and mistake.says in message, f"exercise {exercise.id}: {message}"
    assert message.count("usual mistake") == 1, message


ELEMENTS_FOR_BYTES = ("0.1", "0.3", "4.3", "4.4", "5.4")


@pytest.mark.parametrize("id", ELEMENTS_FOR_BYTES)
def test_elements_counted_instead_of_bytes_is_named_wherever_it_can_be_made(id):
    assert any("elements, not bytes" in m.says for m in get_exercise(id).mistakes), id


# ---- the rule itself, on made-up values ------------------------------------------------------------------------


def _says(fn) -> str:
    with pytest.raises(CheckFailed) as failure:
        fn()
    return str(failure.value)


def test_a_mistake_that_gives_the_expected_value_is_never_named():
    from mhc_lab.course.checks import assert_close

    expected = torch.tensor([0.155448, -2.0, 3.0], dtype=torch.float64)
    message = _says(lambda: assert_close(expected * SCALE, expected, case="c", mistakes={"the same": expected.clone()}))
    assert "usual mistake" not in message and "is close" in message, message


def test_the_nearest_mistake_is_named_only_when_ten_times_nearer_than_the_expected_value():
    from mhc_lab.course.checks import assert_close

    expected = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    a, b = expected + 0.5, expected + 0.6
    mistakes = {"mistake a": a, "mistake b": b}
    assert "usual mistake: mistake b" in _says(lambda: assert_close(b + 1e-7, expected, case="c", mistakes=mistakes))
    assert "usual mistake: mistake a" in _says(lambda: assert_close(a - 0.04, expected, case="c", mistakes=mistakes))
    # halfway between the right answer and a mistake: neither a slip nor the mistake, so nothing is named
    message = _says(lambda: assert_close(expected + 0.25, expected, case="c", mistakes=mistakes))
    assert "usual mistake" not in message and "close" not in message, message


def test_numbers_print_with_the_digits_that_tell_them_apart():
    from mhc_lab.course.checks import expect_number, pair

    assert pair(0.155448, 0.1554481) == ("0.1554480", "0.1554481")
    assert pair(1.88632, 1.88632 * (1 + 1e-9)) == ("1.886320000", "1.886320002")
    assert pair(8000, 2000) == ("8000", "2000") and pair(8000, 8000.24) == ("8000", "8000.2")
    message = _says(lambda: expect_number(1.88632 * SCALE, 1.88632, case="c", name="x"))
    assert "expected x = 1.88632, got 1.88638: close" in message, message
    assert "usual mistake: far" in _says(lambda: expect_number(4.0, 1.0, case="c", name="x", mistakes={"far": 4.0}))
