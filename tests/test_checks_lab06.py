"""Lab 06's checks name the usual mistakes the first version let through or hid: a tile program without its tail
guard (TileLang's own bounds guards made it pass), integer division in phi's bytes per token (it read as an
off-by-one), and an exercise id given as a number (hint(6.1))."""

import pytest
import tilelang.language as T

from mhc_lab.course.checks import CheckFailed, check, get_exercise, hint
from mhc_lab.course.forward_lab import phi_bytes_per_token


def post_without_tail_guard(n: int, C: int, block_tokens: int):
    """The post kernel of exercise 6.1, right in every way but the guard `if t < tokens:`."""
    tokens = T.dynamic("tokens")

    @T.prim_func
    def post_kernel(x: T.Tensor((tokens, n, C), "float32"), f: T.Tensor((tokens, C), "float32"),
                    post: T.Tensor((tokens, n), "float32"), res: T.Tensor((tokens, n, n), "float32"),
                    out: T.Tensor((tokens, n, C), "float32")):
        with T.Kernel(T.ceildiv(tokens, block_tokens)) as b:
            lanes = T.alloc_local((n,), "float32")
            acc = T.alloc_local((1,), "float32")
            for k in T.serial(block_tokens):
                t = b * block_tokens + k
                for c in T.serial(C):
                    for j in T.serial(n):
                        lanes[j] = x[t, j, c]
                    for i in T.serial(n):
                        acc[0] = post[t, i] * f[t, c]
                        for j in T.serial(n):
                            acc[0] += res[t, i, j] * lanes[j]
                        out[t, i, c] = acc[0]

    return post_kernel


def layer_input_without_tail_guard(n: int, C: int, block_tokens: int):
    """Exercise 6.2's layer input without its tail guard."""
    tokens = T.dynamic("tokens")

    @T.prim_func
    def layer_input(x: T.Tensor((tokens, n, C), "float32"), pre: T.Tensor((tokens, n), "float32"),
                    y: T.Tensor((tokens, C), "float32")):
        with T.Kernel(T.ceildiv(tokens, block_tokens)) as b:
            acc = T.alloc_local((1,), "float32")
            for k in T.serial(block_tokens):
                t = b * block_tokens + k
                for c in T.serial(C):
                    acc[0] = 0.0
                    for j in T.serial(n):
                        acc[0] += pre[t, j] * x[t, j, c]
                    y[t, c] = acc[0]

    return layer_input


@pytest.mark.parametrize("exercise, answer", [("6.1", post_without_tail_guard),
                                              ("6.2", layer_input_without_tail_guard)])
def test_a_tile_program_without_its_tail_guard_fails_naming_the_guard(exercise, answer):
    with pytest.raises(CheckFailed) as failure:
        check(exercise, answer)
    message = str(failure.value)
    assert "tail guard is missing" in message and "if t < tokens:" in message, message
    assert "wrote past token 32" in message, message  # the case: 33 tokens, tiles of 4


def test_integer_division_in_phi_bytes_is_named_not_read_as_an_off_by_one():
    def floor_divided(n, C, tile_tokens):
        return 4 * (n * n + 2 * n) * n * C // tile_tokens

    with pytest.raises(CheckFailed) as failure:
        check("6.5", floor_divided)
    message = str(failure.value)
    assert "integer division" in message and "224,694.857" in message, message
    # int() of the right value is the same mistake
    with pytest.raises(CheckFailed, match="integer division"):
        check("6.5", lambda n, C, tile_tokens: int(phi_bytes_per_token(n, C, tile_tokens)))


def test_phi_bytes_that_are_off_by_more_than_rounding_are_not_called_integer_division():
    with pytest.raises(CheckFailed) as failure:
        check("6.5", lambda n, C, tile_tokens: phi_bytes_per_token(n, C, tile_tokens) - 1)
    assert "integer division" not in str(failure.value)


def test_hint_and_check_take_the_exercise_id_as_a_number(capsys):
    hint(6.1)
    hint(6.1, 3)
    out = capsys.readouterr().out
    assert out.count("for exercise 6.1:") == 4 and "hint('6.1', 2)" in out
    assert get_exercise(6.5).id == "6.5"
    check(6.5, lambda n, C, tile_tokens: 4 * (n * n + 2 * n) * n * C / tile_tokens)
    assert "Exercise 6.5" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [None, [6, 1], True])
def test_an_exercise_id_that_is_neither_string_nor_number_is_a_clear_error(bad):
    with pytest.raises(TypeError, match=r"exercise id: expected a string such as \"6.1\""):
        hint(bad)


def test_an_unknown_numeric_id_says_to_give_it_as_a_string():
    with pytest.raises(KeyError, match="no exercise '6.9'.*as a string"):
        hint(6.9)
