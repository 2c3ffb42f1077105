"""Every exercise check passes the library's function for it (called under another code object, as a learner's own
would be), fails the library function itself, fails its stub, and names each registered mistake."""

import types

import pytest

from mhc_lab.course.checks import (
    CheckFailed,
    ExerciseIncomplete,
    all_exercises,
    check,
    hint,
    run_check,
)

EXERCISES = all_exercises()


def test_some_exercises_are_registered():
    assert len(EXERCISES) >= 3


def own_copy(fn):
    """``fn`` rebuilt from a copy of its code: it computes the same, as a learner's own function would, and is
    not the library's code."""
    inner = getattr(fn, "__wrapped__", fn)
    code = inner.__code__.replace(co_name=inner.__code__.co_name + "_own")
    copy = types.FunctionType(code, inner.__globals__, inner.__name__, inner.__defaults__, inner.__closure__)
    copy.__kwdefaults__ = inner.__kwdefaults__
    return copy


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_library_equation_passes(exercise, capsys):
    check(exercise.id, own_copy(exercise.library_function()))
    assert f"Exercise {exercise.id} ({exercise.title}): passed" in capsys.readouterr().out


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_calling_the_library_function_itself_fails(exercise):
    library = exercise.library_function()

    def calls_the_library(*args, **kwargs):
        return library(*args, **kwargs)

    for answer in (library, calls_the_library):
        with pytest.raises(CheckFailed, match=f"calls `{exercise.library}`, the library's own answer"):
            run_check(exercise.id, answer)


def test_registry_holds_no_answers():
    from mhc_lab.course.checks import Exercise

    assert "solution" not in Exercise.__dataclass_fields__
    for exercise in EXERCISES:
        assert isinstance(exercise.library, str) and callable(exercise.library_function()), exercise.id


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_stub_fails_as_not_done(exercise):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"Exercise {exercise.id}: {exercise.title}")

    answer = stub
    with pytest.raises(ExerciseIncomplete, match=f"Exercise {exercise.id}"):
        run_check(exercise.id, answer)


@pytest.mark.parametrize(
    "exercise, mistake",
    [(e, m) for e in EXERCISES for m in e.mistakes],
    ids=lambda v: getattr(v, "id", None) or getattr(v, "says", "")[:30],
)
def test_mistake_is_named(exercise, mistake):
    with pytest.raises(CheckFailed) as failure:
        run_check(exercise.id, mistake.answer)
    assert mistake.says in str(failure.value), f"message was: {failure.value}"


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_every_exercise_has_hints(exercise, capsys):
    assert exercise.hints, f"exercise {exercise.id} has no hints"
    hint(exercise.id, level=99)
    out = capsys.readouterr().out
    assert out.count("Hint ") == len(exercise.hints)


def test_unknown_exercise_is_a_clear_error():
    with pytest.raises(KeyError, match="no exercise '9.9'"):
        check("9.9", lambda: None)


# ---- lab 03, exercise 3.5: the two eps mistakes are told apart -------------------------------------------------


def _coefficients_with(**knobs):
    from mhc_lab.course.exercises import lab03

    def answer(x, phi, bias, alpha, iterations=20, eps=1e-6):
        return lab03._coefficients(x, phi, bias, alpha, iterations, eps, **knobs)

    return answer


def test_lab03_rmsnorm_eps_is_the_reference_value():
    import inspect

    from mhc_lab.course.exercises import lab03
    from mhc_lab.reference import mhc_coefficients

    assert lab03.RMS_EPS == inspect.signature(mhc_coefficients).parameters["rms_eps"].default == 1e-6


def test_lab03_rms_norm_default_eps_is_named_as_the_rmsnorm_eps():
    # a learner who calls F.rms_norm(flat, (n * C,)) without eps=1e-6 gets torch.finfo(dtype).eps
    with pytest.raises(CheckFailed) as failure:
        run_check("3.5", _coefficients_with(rms_eps=None))
    message = str(failure.value)
    assert "your RMSNorm eps is 2.22e-16" in message and "expected 1e-6" in message, message
    assert "F.rms_norm" in message
    assert "H_pre without" not in message, message


def test_lab03_other_rmsnorm_eps_is_named_with_its_value():
    with pytest.raises(CheckFailed) as failure:
        run_check("3.5", _coefficients_with(rms_eps=1e-5))
    message = str(failure.value)
    assert "your RMSNorm eps is 1e-5" in message and "expected 1e-6" in message, message
    assert "H_pre without" not in message, message


def test_lab03_missing_pre_eps_is_named_as_the_pre_eps():
    with pytest.raises(CheckFailed) as failure:
        run_check("3.5", _coefficients_with(pre_eps=False))
    message = str(failure.value)
    assert "H_pre without its + eps" in message, message
    assert "RMSNorm eps" not in message, message


def test_lab03_an_unrecognised_small_error_names_no_eps_mistake():
    # wrong by 1e-7 everywhere: near both eps mistakes, but not ten times nearer to either than to the answer
    from mhc_lab.reference import mhc_coefficients

    def off(x, phi, bias, alpha, iterations=20, eps=1e-6):
        pre, post, res = mhc_coefficients(x, phi, bias, alpha, iterations=iterations, eps=eps)
        return pre + 3e-7, post, res

    with pytest.raises(CheckFailed) as failure:
        run_check("3.5", off)
    assert "usual mistake" not in str(failure.value), str(failure.value)


# ---- lab 04: a wrong prediction is told what is wrong, not given the count's breakdown -----------------------


def _failure(id, answer):
    with pytest.raises(CheckFailed) as failure:
        run_check(id, answer)
    return str(failure.value)


def test_lab04_message_gives_direction_ratio_and_missing_part_not_the_breakdown():
    from mhc_lab.measure import bytes_model

    right = bytes_model.hc_forward_elements(4, 2560)
    message = _failure("4.1", lambda n, C: (8 * n + 2) * C)  # the coefficients left out
    assert message.startswith("n=4, C=2560: your prediction, 87,040 elements per token, is too low: 0.999x the count.")
    assert "the part proportional to C (the lanes' traffic) is right" in message
    assert "the part that does not grow with C (the coefficients H_pre, H_post, H_res) is missing" in message
    # neither the count nor its breakdown by operation
    assert f"{right:,}" not in message and str(right) not in message
    assert "reads nC" not in message and "writes" not in message.split("usual mistake")[0]
    for operation in ("compute H_pre", "apply H_pre", "residual merge: reads"):
        assert operation not in message


def test_lab04_unrecognised_wrong_count_says_which_part_and_how_much():
    from mhc_lab.measure import bytes_model

    message = _failure("4.1", lambda n, C: bytes_model.hc_forward_elements(n, C) + n * C)  # one nC too many
    assert "is too high: 1.12x the count" in message
    assert "the lanes' traffic) is too high (1.12x the count's)" in message
    assert "(the coefficients H_pre, H_post, H_res) is right" in message
    assert "usual mistake" not in message

    message = _failure("4.2", lambda n, C: bytes_model.minimal_site_forward_elements(n, C) + 7)
    assert "too high" in message and "the part that does not grow with C" in message and "is too high (" in message
    assert str(bytes_model.minimal_site_forward_elements(4, 4096)) not in message


def test_lab04_time_and_intensity_messages():
    from mhc_lab.measure import bytes_model

    message = _failure("4.3", lambda t, n, C, bw: 2 * bytes_model.memory_bound_seconds(t, n, C, bw))
    assert "is too high: 2x the count" in message and "(the lanes, bf16) is too high (2x" in message
    message = _failure("4.4", lambda n, C, s, c: 0.5)
    assert "is too low: 0.25x the count" in message and "too few FLOPs counted, or too many bytes" in message


def test_lab04_launch_message_splits_first_iteration_from_the_loop_and_lists_no_operations():
    message = _failure("4.5", lambda t: 6 * t + 3)
    assert message.startswith("t=20: your prediction, 123 launches, is too high: 1.02x the count")
    assert "the count for t = 1 (the check, the start and the first pass) is too high (1.29x" in message
    assert "what each further iteration adds is right" in message
    assert "121" not in message  # the measured count
    for name in ("softmax", "div", "sum", "isnan"):
        assert name not in message, message


def test_lab04_not_a_number_and_not_a_line():
    assert "expected elements per token to be a number, got str" in _failure("4.1", lambda n, C: "many")
    assert "your prediction is nan" in _failure("4.5", lambda t: float("nan"))
    assert "does not grow in a straight line with C" in _failure("4.1", lambda n, C: n * C * C)


# ---- what a failing check shows ----------------------------------------------------------------------------------


def test_a_failing_check_shows_its_message_alone():
    # IPython shows an exception with _render_traceback_ as the lines it returns: here the message, no checker code
    with pytest.raises(CheckFailed) as failure:
        run_check("0.1", lambda numel, dtype: 2 * numel)
    lines = failure.value._render_traceback_()
    assert len(lines) == 1 and lines[0].endswith(f"CheckFailed\x1b[0m: {failure.value}"), lines
    with pytest.raises(ExerciseIncomplete) as failure:
        run_check("0.1", lambda numel, dtype: (_ for _ in ()).throw(NotImplementedError("Exercise 0.1: bytes")))
    assert len(failure.value._render_traceback_()) == 1


def test_a_check_whose_answer_raised_shows_the_answer_traceback_from_the_learner_code_on():
    def broken(numel, dtype):
        return numel / 0

    with pytest.raises(CheckFailed) as failure:
        run_check("0.1", broken)
    text = "\n".join(failure.value._render_traceback_())
    assert "return numel / 0" in text and "ZeroDivisionError" in text, text
    assert "mhc_lab/course/checks.py" not in text and "mhc_lab/course/exercises" not in text, text
    assert text.endswith(str(failure.value)), text
