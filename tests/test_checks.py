"""Every exercise check passes its reference solution, fails its stub, and names each registered mistake."""

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


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_solution_passes(exercise, capsys):
    check(exercise.id, exercise.solution)
    assert f"Exercise {exercise.id} ({exercise.title}): passed" in capsys.readouterr().out


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_stub_fails_as_not_done(exercise):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"Exercise {exercise.id}: {exercise.title}")

    answer = stub
    if not callable(exercise.solution):  # predict-then-measure exercises take a value; their stub raises itself
        pytest.skip("value exercise: its stub is the raise in the notebook")
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
