"""Lab 05 exercises: tile programs in TileLang, run on the CPU through its C target, and counting their bytes.

The learner writes a factory (tile sizes in, tile program out); the checker compiles it for target "c", runs it
on random inputs of awkward shapes (row counts that are not multiples of the tile, a width of 1), with the
output poisoned with NaN and guard rows after every tensor, and compares with a float64 reference.
"""

from __future__ import annotations


import tilelang.language as T
import torch

from mhc_lab.bench.tilelang import fraction_of_copy_roof
from mhc_lab.course.checks import CheckFailed, Mistake, assert_close, call, expect_number, randn, register
from mhc_lab.course.tile_checks import compile_learner_program
from mhc_lab.kernels.rmsnorm import rmsnorm_bytes, rmsnorm_reference
from mhc_lab.kernels.source import lines_matching

# (C, block_rows, row counts) compiled once per C and block_rows; the first configuration reveals every mistake.
_CONFIGS = [(33, 4, (9, 7, 1)), (1, 3, (5,)), (5, 2, (16, 3))]
_TAIL = ("This looks like the usual mistake: forgetting the tail. When N is not a multiple of block_rows the "
         "last tile hangs over the end")


def _extra_rows(N: int, block_rows: int) -> int:
    """Guard rows after every tensor: room for a grid of N instances of block_rows rows (a wrong grid)."""
    return N * block_rows + block_rows + 8


def _rows(N: int, C: int, block_rows: int, seed: int) -> torch.Tensor:
    """Random [N, C] float32 rows: a view of a taller tensor, so reading past row N reads numbers, not chaos."""
    return randn(N + _extra_rows(N, block_rows), C, seed=seed, dtype=torch.float32)[:N]


def _run(kernel, inputs: list[torch.Tensor], out_cols: int | None, N: int, block_rows: int, case: str):
    """``kernel(*inputs, out)`` with out poisoned (NaN) and followed by NaN guard rows; returns (out, whether
    anything was written past row N - 1)."""
    extra = _extra_rows(N, block_rows)
    storage = torch.full((N + extra,) if out_cols is None else (N + extra, out_cols), float("nan"))
    out = storage[:N]
    try:
        kernel(*inputs, out)
    except Exception as error:
        last = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        raise CheckFailed(f"{case}: running your compiled program failed: {type(error).__name__}: {last}") from None
    return out, not torch.isnan(storage[N:]).all().item()


def _tail_checks(out: torch.Tensor, wrote_past_end: bool, N: int, block_rows: int, case: str):
    """Name the tail mistakes: writing past the end, a grid of N // block_rows, one row per instance."""
    if wrote_past_end:
        raise CheckFailed(f"{case}: your program wrote past row {N - 1}, the last row of the output. {_TAIL}: "
                          "guard the rows with `if r < N:` before touching memory.")
    missing = torch.isnan(out.reshape(N, -1)).all(dim=1)
    if not missing.any():
        return
    unwritten = missing.nonzero().flatten().tolist()
    floor_rows = list(range(N // block_rows * block_rows, N))
    instances = -(-N // block_rows)
    if unwritten == floor_rows:
        which = f"row {N - 1} was" if len(floor_rows) == 1 else f"rows {floor_rows[0]}..{N - 1} were"
        raise CheckFailed(f"{case}: {which} never written (still NaN). "
                          f"{_TAIL}: the grid needs ceil(N / block_rows) instances, T.ceildiv(N, block_rows), "
                          "not N // block_rows.")
    if unwritten == list(range(block_rows, N)) and instances > 1:
        raise CheckFailed(f"{case}: only rows 0..{block_rows - 1} were written: every instance wrote the same "
                          "first rows. This looks like the usual mistake: forgetting the tile's offset. Instance "
                          "b owns rows r = b * block_rows + i, for i in T.serial(block_rows).")
    if unwritten == list(range(instances, N)):
        raise CheckFailed(f"{case}: only rows 0..{instances - 1} were written. This looks like the usual mistake: "
                          "one row per instance. Instance b owns block_rows rows, b * block_rows + i for i in "
                          "T.serial(block_rows).")
    raise CheckFailed(f"{case}: {len(unwritten)} of {N} rows of the output were never written (still NaN), the "
                      f"first is row {unwritten[0]}. Every row r < N must be written by exactly one instance.")


# ---- 5.1 the tiled residual add ---------------------------------------------------------------------------


def _add_no_offset(C: int, block_rows: int):
    N = T.dynamic("N")

    @T.prim_func
    def residual_add(x: T.Tensor((N, C), "float32"), f: T.Tensor((N, C), "float32"),
                     out: T.Tensor((N, C), "float32")):
        with T.Kernel(T.ceildiv(N, block_rows)) as b:
            for i in T.serial(block_rows):
                if i < N:
                    for c in T.serial(C):
                        out[i, c] = x[i, c] + f[i, c]

    return residual_add


def _add_floor_grid(C: int, block_rows: int):
    N = T.dynamic("N")

    @T.prim_func
    def residual_add(x: T.Tensor((N, C), "float32"), f: T.Tensor((N, C), "float32"),
                     out: T.Tensor((N, C), "float32")):
        with T.Kernel(N // block_rows) as b:
            for i in T.serial(block_rows):
                for c in T.serial(C):
                    out[b * block_rows + i, c] = x[b * block_rows + i, c] + f[b * block_rows + i, c]

    return residual_add


def _add_one_row_per_tile(C: int, block_rows: int):
    N = T.dynamic("N")

    @T.prim_func
    def residual_add(x: T.Tensor((N, C), "float32"), f: T.Tensor((N, C), "float32"),
                     out: T.Tensor((N, C), "float32")):
        with T.Kernel(T.ceildiv(N, block_rows)) as b:
            for c in T.serial(C):
                out[b, c] = x[b, c] + f[b, c]

    return residual_add


@register(
    "5.1", "a tiled residual add",
    hints=[
        "Instance b owns rows b * block_rows ... b * block_rows + block_rows - 1. Loop over them with "
        "T.serial(block_rows), and over the columns with T.serial(C).",
        "The grid is T.ceildiv(N, block_rows) instances, so the last tile can reach past row N - 1: compute "
        "r = b * block_rows + i and wrap the body in `if r < N:`.",
        "for i in T.serial(block_rows): r = b * block_rows + i; if r < N: for c in T.serial(C): "
        "out[r, c] = x[r, c] + f[r, c]",
    ],
    library="mhc_lab.kernels.elementwise.residual_add_program",
    mistakes=[
        Mistake(_add_no_offset, "b * block_rows + i"),
        Mistake(_add_floor_grid, "T.ceildiv(N, block_rows)"),
        Mistake(_add_one_row_per_tile, "one row per instance"),
    ],
)
def _check_residual_add(answer):
    cases = []
    for C, block_rows, row_counts in _CONFIGS:
        kernel = compile_learner_program(answer, (C, block_rows), f"C={C}, block_rows={block_rows}")
        for k, N in enumerate(row_counts):
            case = f"N={N}, C={C}, block_rows={block_rows}"
            x, f = _rows(N, C, block_rows, seed=100 + k), _rows(N, C, block_rows, seed=200 + k)
            out, past = _run(kernel, [x, f], C, N, block_rows, case)
            _tail_checks(out, past, N, block_rows, case)
            assert_close(out, (x.double() + f.double()).float(), case=case, name="out")
            cases.append(case)
    return cases


# ---- 5.2 the per-row sum of squares ------------------------------------------------------------------------


def _sumsq_no_reset(C: int, block_rows: int):
    N = T.dynamic("N")

    @T.prim_func
    def row_sum_of_squares(x: T.Tensor((N, C), "float32"), out: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, block_rows)) as b:
            total = T.alloc_local((1,), "float32")
            total[0] = 0.0
            for i in T.serial(block_rows):
                r = b * block_rows + i
                if r < N:
                    for c in T.serial(C):
                        total[0] += x[r, c] * x[r, c]
                    out[r] = total[0]

    return row_sum_of_squares


def _sumsq_mean(C: int, block_rows: int):
    N = T.dynamic("N")

    @T.prim_func
    def row_sum_of_squares(x: T.Tensor((N, C), "float32"), out: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, block_rows)) as b:
            total = T.alloc_local((1,), "float32")
            for i in T.serial(block_rows):
                r = b * block_rows + i
                if r < N:
                    total[0] = 0.0
                    for c in T.serial(C):
                        total[0] += x[r, c] * x[r, c]
                    out[r] = total[0] / C

    return row_sum_of_squares


def _sumsq_plain(C: int, block_rows: int):
    N = T.dynamic("N")

    @T.prim_func
    def row_sum_of_squares(x: T.Tensor((N, C), "float32"), out: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, block_rows)) as b:
            total = T.alloc_local((1,), "float32")
            for i in T.serial(block_rows):
                r = b * block_rows + i
                if r < N:
                    total[0] = 0.0
                    for c in T.serial(C):
                        total[0] += x[r, c]
                    out[r] = total[0]

    return row_sum_of_squares


def _sumsq_python_variable(augmented: bool):
    """A running sum in a Python variable, s = 0.0 and s = s + ... (or s += ...), instead of the register total."""

    def factory(C: int, block_rows: int):
        N = T.dynamic("N")

        @T.prim_func
        def row_sum_of_squares(x: T.Tensor((N, C), "float32"), out: T.Tensor((N,), "float32")):
            with T.Kernel(T.ceildiv(N, block_rows)) as b:
                for i in T.serial(block_rows):
                    r = b * block_rows + i
                    if r < N:
                        s = 0.0
                        for c in T.serial(C):
                            if augmented:
                                s += x[r, c] * x[r, c]
                            else:
                                s = s + x[r, c] * x[r, c]
                        out[r] = s

        return row_sum_of_squares

    factory.__name__ = "row_sum_of_squares_python_" + ("augmented" if augmented else "sum")
    return factory


@register(
    "5.2", "a per-row sum of squares",
    hints=[
        "A reduction keeps a running sum in a register (total, allocated with T.alloc_local) and adds one "
        "x[r, c] * x[r, c] per column; the result goes to out[r] once, at the end of the row. Not in a Python "
        "variable (s = 0.0, then s = s + ... in the loop): in a tile program a Python name is bound once to an "
        "expression and cannot be updated by a loop; use total[0] = 0.0 and total[0] += ... instead.",
        "Start every row from zero: set total[0] = 0.0 inside the loop over the rows, not once per instance. "
        "And guard the rows with `if r < N:` as in 5.1.",
        "for i in T.serial(block_rows): r = b * block_rows + i; if r < N: total[0] = 0.0; "
        "for c in T.serial(C): total[0] += x[r, c] * x[r, c]; then out[r] = total[0]",
    ],
    library="mhc_lab.kernels.rmsnorm.row_sum_of_squares_program",
    mistakes=[
        Mistake(_sumsq_no_reset, "not reset"),
        Mistake(_sumsq_mean, "divided by C"),
        Mistake(_sumsq_plain, "not their squares"),
        Mistake(_sumsq_python_variable(augmented=False), "a Python accumulator"),
        Mistake(_sumsq_python_variable(augmented=True), "T.alloc_local((1,), \"float32\")"),
    ],
)
def _check_sum_of_squares(answer):
    cases = []
    for C, block_rows, row_counts in _CONFIGS:
        kernel = compile_learner_program(answer, (C, block_rows), f"C={C}, block_rows={block_rows}")
        for k, N in enumerate(row_counts):
            case = f"N={N}, C={C}, block_rows={block_rows}"
            x = _rows(N, C, block_rows, seed=300 + k)
            out, past = _run(kernel, [x], None, N, block_rows, case)
            _tail_checks(out, past, N, block_rows, case)
            squares = x.double().pow(2)
            expected = squares.sum(dim=1)
            tiles = [squares[s : s + block_rows].sum(dim=1).cumsum(0) for s in range(0, N, block_rows)]
            mistakes = {
                "the running sum is not reset for each row, so each row adds to the rows before it in its tile; "
                "set total[0] = 0.0 at the start of every row.": torch.cat(tiles),
                "the sum was divided by C; this kernel returns the plain sum (the mean comes in 5.3).":
                    expected / C,
                "you summed the values, not their squares: add x[r, c] * x[r, c].": x.double().sum(dim=1),
            }
            assert_close(out, expected.float(), case=case, name="out", mistakes=mistakes)
            cases.append(case)
    return cases


# ---- 5.3 the fused RMSNorm -------------------------------------------------------------------------------


def _rms_variant(kind: str):
    def factory(C: int, block_rows: int, eps: float):
        N = T.dynamic("N")
        eps_used = 0.0 if kind == "no_eps" else eps

        @T.prim_func
        def rmsnorm(x: T.Tensor((N, C), "float32"), w: T.Tensor((C,), "float32"), y: T.Tensor((N, C), "float32")):
            with T.Kernel(T.ceildiv(N, block_rows)) as b:
                row = T.alloc_local((C,), "float32")
                total = T.alloc_local((1,), "float32")
                for i in T.serial(block_rows):
                    r = b * block_rows + i
                    if r < N:
                        total[0] = 0.0
                        for c in T.serial(C):
                            row[c] = x[r, c]
                            total[0] += row[c] * row[c]
                        if kind == "sum":
                            scale = T.rsqrt(total[0] + eps_used)
                        elif kind == "sqrt":
                            scale = T.sqrt(total[0] / C + eps_used)
                        else:
                            scale = T.rsqrt(total[0] / C + eps_used)
                        for c in T.serial(C):
                            if kind == "no_weight":
                                y[r, c] = row[c] * scale
                            elif kind == "two_reads":
                                y[r, c] = x[r, c] * scale * w[c]
                            else:
                                y[r, c] = row[c] * scale * w[c]

        return rmsnorm

    factory.__name__ = f"rmsnorm_{kind}"
    return factory


_RMS_CONFIGS = [(33, 4, 0.5, (7, 1, 9)), (1, 3, 1e-6, (5,)), (64, 2, 1e-6, (3,))]


@register(
    "5.3", "the fused RMSNorm",
    hints=[
        "Two loops over the columns of row r: the first copies x[r, c] into row[c] and adds row[c] * row[c] to "
        "total[0]; the second writes y[r, c]. Only the first touches x.",
        "scale = T.rsqrt(total[0] / C + eps): the mean divides by C, and eps goes inside the square root. "
        "Then y[r, c] = row[c] * scale * w[c].",
        "total[0] = 0.0; for c in T.serial(C): row[c] = x[r, c]; total[0] += row[c] * row[c]; then "
        "scale = T.rsqrt(total[0] / C + eps); for c in T.serial(C): y[r, c] = row[c] * scale * w[c]",
    ],
    library="mhc_lab.kernels.rmsnorm.rmsnorm_program",
    mistakes=[
        Mistake(_rms_variant("no_eps"), "forgetting eps"),
        Mistake(_rms_variant("sum"), "sum of squares, not their mean"),
        Mistake(_rms_variant("sqrt"), "multiplied by the RMS"),
        Mistake(_rms_variant("no_weight"), "the weight w"),
        Mistake(_rms_variant("two_reads"), "reads x twice"),
    ],
)
def _check_rmsnorm(answer):
    cases = []
    for C, block_rows, eps, row_counts in _RMS_CONFIGS:
        kernel = compile_learner_program(answer, (C, block_rows, eps), f"C={C}, block_rows={block_rows}, eps={eps:g}")
        x_reads = len(lines_matching(kernel.get_kernel_source(), r"\bx\["))
        if x_reads > 1:
            raise CheckFailed(f"C={C}: your program reads x in {x_reads} places. This looks like the usual "
                              "mistake: it reads x twice (once for the sum, once for y), two passes over memory "
                              "where one will do. Compute y from the local copy row[c].")
        for k, N in enumerate(row_counts):
            case = f"N={N}, C={C}, block_rows={block_rows}, eps={eps:g}"
            x = _rows(N, C, block_rows, seed=400 + k)
            x.mul_(0.5 if eps > 0.1 else 1.0)  # rows of mean square ~ 0.25: an eps of 0.5 changes y a lot
            w = randn(C, seed=500 + k, dtype=torch.float32)
            y, past = _run(kernel, [x, w], C, N, block_rows, case)
            _tail_checks(y, past, N, block_rows, case)
            x64, w64 = x.double(), w.double()
            ms = x64.pow(2).mean(dim=1, keepdim=True)
            mistakes = {
                "forgetting eps. It goes inside the root, rsqrt(mean + eps): it keeps a row of zeros finite "
                "and sets how much small rows are scaled up.": x64 * torch.rsqrt(ms) * w64,
                "you used the sum of squares, not their mean: divide total[0] by C.":
                    x64 * torch.rsqrt(ms * C + eps) * w64,
                "you multiplied by the RMS instead of dividing by it: use T.rsqrt, not T.sqrt.":
                    x64 * torch.sqrt(ms + eps) * w64,
                "you left out the weight w; multiply by w[c].": x64 * torch.rsqrt(ms + eps),
            }
            assert_close(y, rmsnorm_reference(x, w, eps).float(), case=case, name="y", mistakes=mistakes)
            cases.append(case)
    return cases


# ---- 5.4 counting the bytes ------------------------------------------------------------------------------


def _eager_all_bf16(N, C):
    """The eager passes counted as if every intermediate were bf16 (2 bytes)."""
    return 18 * N * C + 12 * N + 2 * C


# Each usual mistake: what the check says, and the {"fused", "eager"} bytes it gives.
_BYTES_MISTAKES = {
    "you counted 4 bytes per element; x, w and y are bf16, 2 bytes each.":
        lambda N, C: {"fused": 2 * N * C * 4 + C * 4, "eager": rmsnorm_bytes(N, C)["eager"]},
    "you left out the weight w: C more elements read (small, but counted).":
        lambda N, C: {"fused": 2 * N * C * 2, "eager": rmsnorm_bytes(N, C)["eager"]},
    "you counted the eager intermediates at 2 bytes; after x.to(float32) they are float32, 4 bytes per element, "
    "until h.to(dtype) casts back.":
        lambda N, C: {"fused": rmsnorm_bytes(N, C)["fused"], "eager": _eager_all_bf16(N, C)},
    "you left out the two casts (x.to(float32) and h.to(dtype)): each is a pass of its own that reads and writes "
    "the whole tensor.": lambda N, C: {"fused": rmsnorm_bytes(N, C)["fused"],
                                       "eager": rmsnorm_bytes(N, C)["eager"] - 2 * (N * C * 2 + N * C * 4)},
    "you counted elements, not bytes: a bf16 element is 2 bytes, a float32 one 4.":
        lambda N, C: {"fused": 2 * N * C + C, "eager": 11 * N * C + 6 * N + C},
    "you counted only the reads; the kernel also writes y (N * C elements).":
        lambda N, C: {"fused": 2 * N * C + 2 * C, "eager": rmsnorm_bytes(N, C)["eager"]},
}


def _get_number(got, key: str, case: str):
    if not isinstance(got, dict) or key not in got:
        kind = type(got).__name__
        raise CheckFailed(f"{case}: expected a dict with keys 'fused' and 'eager', got {kind}"
                          + (f" with keys {sorted(got)}" if isinstance(got, dict) else ""))
    return got[key]


@register(
    "5.4", "bytes of the fused and the eager RMSNorm",
    hints=[
        "Fused: x is read once and y written once (N * C elements each, 2 bytes in bf16), and w is read once "
        "(C elements).",
        "Eager: add up the table, pass by pass: each pass reads its inputs and writes its output. Everything "
        "after the upcast is float32 (4 bytes), until the downcast back to bf16.",
        "eager = 36 N C + 24 N + 2 C bytes in bf16; fused = 4 N C + 2 C.",
    ],
    library="mhc_lab.kernels.rmsnorm.rmsnorm_bytes",
    mistakes=[Mistake(fn, says) for says, fn in _BYTES_MISTAKES.items()],
)
def _check_bytes(answer):
    cases = []
    for N, C in [(8192, 4096), (7, 33), (1, 1), (16384, 7168)]:
        case = f"N={N}, C={C}, bfloat16"
        got = call(answer, N, C, case=case)
        want = rmsnorm_bytes(N, C)
        wrong = {says: fn(N, C) for says, fn in _BYTES_MISTAKES.items()}
        for key in ("fused", "eager"):
            expect_number(_get_number(got, key, case), want[key], case=case, name=f"{key} bytes",
                          mistakes={says: w[key] for says, w in wrong.items()})
        cases.append(case)
    return cases


# ---- 5.5 a fraction of the copy roof ---------------------------------------------------------------------


_FRACTION_MISTAKES = {
    "you divided by 2**30 (GiB); the course uses GB = 1e9 bytes.":
        lambda nbytes, seconds, copy_gbs: nbytes / seconds / 2**30 / copy_gbs,
    "you returned a percent; return the fraction (0.8, not 80).":
        lambda nbytes, seconds, copy_gbs: 100 * nbytes / seconds / 1e9 / copy_gbs,
    "your ratio is upside down: the kernel's GB/s over the copy's GB/s.":
        lambda nbytes, seconds, copy_gbs: copy_gbs * 1e9 * seconds / nbytes,
}


@register(
    "5.5", "fraction of the copy bandwidth",
    hints=[
        "The kernel's bandwidth is nbytes / seconds, in bytes per second; the copy bandwidth is in GB/s.",
        "Put both in the same unit (GB = 1e9 bytes, as in lab 00) and divide: a fraction, 1.0 means as fast as "
        "a copy.",
        "nbytes / seconds / 1e9 / copy_gbs",
    ],
    library="mhc_lab.bench.tilelang.fraction_of_copy_roof",
    mistakes=[Mistake(fn, says) for says, fn in _FRACTION_MISTAKES.items()],
)
def _check_fraction(answer):
    cases = []
    for nbytes, seconds, copy_gbs in [(268_443_648, 75e-6, 4274.0), (1.2e9, 0.45e-3, 4274.0),
                                      (4e6, 1e-3, 20.0), (123_456_789, 0.5, 1.0)]:
        case = f"nbytes={nbytes:g}, seconds={seconds:g}, copy_gbs={copy_gbs:g}"
        got = call(answer, nbytes, seconds, copy_gbs, case=case)
        expect_number(got, fraction_of_copy_roof(nbytes, seconds, copy_gbs), case=case, name="fraction",
                      mistakes={says: fn(nbytes, seconds, copy_gbs) for says, fn in _FRACTION_MISTAKES.items()})
        cases.append(case)
    return cases
