"""Lab 05's tile programs (copy, residual add, per-row sum of squares, fused RMSNorm): the C target against
float64 references on awkward shapes with poisoned outputs, the CUDA programs built for sm_90 (nvcc, no GPU
needed), what their generated code reads and writes, their byte counts, and the benchmark's CPU path."""

import json
import os
import shutil

import pytest
import torch

from mhc_lab.bench import tilelang as bench_tilelang
from mhc_lab.course.checks import TOLERANCE
from mhc_lab.kernels import elementwise, rmsnorm, source

# Row counts that are not multiples of the tile, widths of 1 and odd widths; block_rows 4 (default) and 3.
ROWS = (1, 7, 33)
WIDTHS = (1, 33, 130)
GEN = torch.Generator().manual_seed(0)
HAS_NVCC = bool(shutil.which("nvcc")) or os.path.exists("/usr/local/cuda/bin/nvcc")


def _randn(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=GEN, dtype=torch.float32).to(device=device, dtype=dtype)


def _close(got, expected, dtype):
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double().cpu(), expected.double().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("C", WIDTHS)
@pytest.mark.parametrize("block_rows", (None, 3))
def test_c_target_matches_float64_references(C, block_rows):
    copy = elementwise.copy_kernel(C, block_rows)
    add = elementwise.residual_add_kernel(C, block_rows)
    sumsq = rmsnorm.row_sum_of_squares_kernel(C, block_rows)
    norm = rmsnorm.rmsnorm_kernel(C, block_rows, 1e-6)
    for N in ROWS:
        x, f, w = _randn(N, C), _randn(N, C), _randn(C)
        out = torch.full((N, C), float("nan"))
        copy(x, out)
        assert torch.equal(out, x)
        out.fill_(float("nan"))
        add(x, f, out)
        _close(out, x.double() + f.double(), torch.float32)
        sums = torch.full((N,), float("nan"))
        sumsq(x, sums)
        _close(sums, x.double().pow(2).sum(-1), torch.float32)
        out.fill_(float("nan"))
        norm(x, w, out)
        _close(out, rmsnorm.rmsnorm_reference(x, w), torch.float32)


def test_rmsnorm_eps_and_tiny_rows():
    """eps is honoured (a large one changes y) and an all-zero row gives zeros, not NaN."""
    x, w = _randn(5, 33) * 1e-3, _randn(33)
    x[2] = 0.0
    for eps in (1e-6, 0.5):
        y = rmsnorm.rmsnorm(x, w, eps)
        _close(y, rmsnorm.rmsnorm_reference(x, w, eps), torch.float32)
        assert torch.equal(y[2], torch.zeros(33))


def test_wrappers_compute_on_cpu_and_refuse_bad_input():
    x, f, w = _randn(9, 33), _randn(9, 33), _randn(33)
    _close(elementwise.residual_add(x, f), x.double() + f.double(), torch.float32)
    _close(rmsnorm.row_sum_of_squares(x), x.double().pow(2).sum(-1), torch.float32)
    _close(rmsnorm.rmsnorm(x, w), rmsnorm.rmsnorm_reference(x, w), torch.float32)
    assert torch.equal(elementwise.copy(x), x)
    assert rmsnorm.rmsnorm(x[:0], w).shape == (0, 33)
    with pytest.raises(ValueError, match=r"expected dtype in \('float32',\), got torch.bfloat16"):
        rmsnorm.rmsnorm(x.bfloat16(), w.bfloat16())
    with pytest.raises(ValueError, match=r"expected a 2-D tensor \[rows, C\]"):
        rmsnorm.rmsnorm(x[0], w)
    with pytest.raises(ValueError, match=r"expected w of shape \(33,\)"):
        rmsnorm.rmsnorm(x, w[:5])
    with pytest.raises(ValueError, match="contiguous"):
        elementwise.residual_add(x.t(), f.t())
    with pytest.raises(ValueError, match="expected f like x"):
        elementwise.residual_add(x, f[:3])
    with pytest.raises(ValueError, match="positive width"):
        rmsnorm.rmsnorm_program(0)
    with pytest.raises(ValueError, match="target"):
        rmsnorm.rmsnorm_program(8, target="tpu")


def test_eager_rmsnorm_is_the_same_function():
    x, w = _randn(7, 33), _randn(33)
    _close(rmsnorm.rmsnorm_eager(x, w), rmsnorm.rmsnorm_reference(x, w), torch.float32)
    xb, wb = x.bfloat16(), w.bfloat16()
    _close(rmsnorm.rmsnorm_eager(xb, wb), rmsnorm.rmsnorm_reference(xb, wb), torch.bfloat16)


@pytest.mark.parametrize("N, C", [(8192, 4096), (7, 33), (1, 1)])
def test_byte_counts(N, C):
    bf16 = rmsnorm.rmsnorm_bytes(N, C)
    assert bf16["fused"] == 4 * N * C + 2 * C
    assert bf16["eager"] == 36 * N * C + 24 * N + 2 * C
    assert len(bf16["eager_passes"]) == 8
    f32 = rmsnorm.rmsnorm_bytes(N, C, "float32")
    assert f32["eager"] == 28 * N * C + 24 * N + 4 * C and len(f32["eager_passes"]) == 6
    assert elementwise.residual_add_bytes(N, C)["total"] == 6 * N * C
    assert elementwise.copy_bytes(N, C, 4)["total"] == 8 * N * C


def test_generated_c_reads_x_once_and_writes_only_y():
    src = source.generated_source(rmsnorm.rmsnorm_program(33), "c")
    assert source.global_accesses(src) == {"read": ["w", "x"], "written": ["y"]}
    assert len(source.lines_matching(src, r"\bx\[")) == 1
    assert source.lines_matching(src, r"sqrtf")


@pytest.mark.parametrize("C, dtype", [(33, "bfloat16"), (1000, "float32"), (7168, "bfloat16")])
def test_cuda_programs_lower_for_sm90(C, dtype):
    """Generating CUDA needs no GPU and no nvcc: every program lowers at awkward widths and both dtypes."""
    for program in (rmsnorm.rmsnorm_program(C, dtype=dtype, target="sm_90"),
                    elementwise.residual_add_program(C, dtype=dtype, target="sm_90")):
        src = source.generated_source(program, "sm_90")
        assert "__global__" in src


def test_generated_cuda_rmsnorm_is_one_pass():
    src = source.generated_source(rmsnorm.rmsnorm_program(4096, dtype="bfloat16", target="sm_90"), "sm_90")
    assert source.global_accesses(src) == {"read": ["w", "x"], "written": ["y"]}
    assert source.lines_matching(src, r"\*\(uint4\*\)\(x \+"), "x should be loaded in 16-byte vectors"
    assert source.lines_matching(src, r"\*\(uint4\*\)\(y \+.*\) ="), "y should be stored in 16-byte vectors"
    assert source.lines_matching(src, r"AllReduce"), "the row sum should be reduced across the block"
    assert "__launch_bounds__(128" in src


@pytest.mark.skipif(not HAS_NVCC, reason="nvcc not found (neither on PATH nor in /usr/local/cuda/bin): "
                                                "the sm_90 build check needs the CUDA toolkit")
@pytest.mark.parametrize("build", [
    lambda: rmsnorm.rmsnorm_kernel(4096, dtype="bfloat16", target="sm_90"),
    lambda: rmsnorm.rmsnorm_kernel(1000, dtype="bfloat16", target="sm_90"),
    lambda: rmsnorm.row_sum_of_squares_kernel(4096, dtype="bfloat16", target="sm_90"),
    lambda: elementwise.residual_add_kernel(4096, dtype="bfloat16", target="sm_90"),
    lambda: elementwise.residual_add_kernel(33, dtype="float32", target="sm_90"),
    lambda: elementwise.copy_kernel(4096, dtype="bfloat16", target="sm_90"),
], ids=["rmsnorm-4096-bf16", "rmsnorm-1000-bf16", "sumsq-4096-bf16", "add-4096-bf16", "add-33-f32", "copy-4096"])
def test_cuda_kernels_build_for_sm90(build):
    assert build() is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the GPU run is checked on the H200")
@pytest.mark.parametrize("C", (33, 1000, 4096))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_cuda_kernels_match_references(C, dtype):
    for N in ROWS + (4097,):
        x, f, w = (_randn(N, C, dtype=dtype, device="cuda"), _randn(N, C, dtype=dtype, device="cuda"),
                   _randn(C, dtype=dtype, device="cuda"))
        _close(rmsnorm.rmsnorm(x, w), rmsnorm.rmsnorm_reference(x, w), dtype)
        _close(rmsnorm.row_sum_of_squares(x), x.double().pow(2).sum(-1), torch.float32 if dtype == torch.float32
               else torch.bfloat16)
        assert torch.equal(elementwise.residual_add(x, f), x + f)
        assert torch.equal(elementwise.copy(x), x)


@pytest.mark.parametrize("augmented", (False, True), ids=("s = s + ...", "s += ..."))
def test_python_accumulator_is_named_without_the_ir(augmented, capfd):
    """Exercise 5.2 with a running sum in a Python variable: TVM's error (an IR dump) or its compile error becomes
    one message that names the local buffer, with no chained traceback and nothing of TVM's on stderr."""
    from mhc_lab.course.checks import CheckFailed, run_check
    from mhc_lab.course.exercises.lab05 import _sumsq_python_variable

    with pytest.raises(CheckFailed) as failure:
        run_check("5.2", _sumsq_python_variable(augmented))
    message = str(failure.value)
    assert message.startswith("C=33, block_rows=4: ")
    assert "a Python accumulator" in message
    assert 'total = T.alloc_local((1,), "float32"); total[0] = 0.0' in message and "total[0] += ..." in message
    for dump in ("Frame", "T.Buffer", "T.int32", "Immutable", "InternalError", "\n"):
        assert dump not in message, f"{dump!r} in the message: {message}"
    assert failure.value.__cause__ is None and failure.value.__suppress_context__
    captured = capfd.readouterr()
    assert "Warning" not in captured.err and "TVMScript" not in captured.err, captured.err


def test_python_accumulator_is_in_a_hint(capsys):
    from mhc_lab.course.checks import hint

    hint("5.2", 1)
    out = capsys.readouterr().out
    assert "Not in a Python variable (s = 0.0, then s = s + ... in the loop)" in out
    assert "total[0] += ..." in out


def test_bench_cpu_path_writes_a_recording(tmp_path, capsys):
    assert bench_tilelang.main(["--device", "cpu", "--repeat", "1", "--quick", "--out", str(tmp_path)]) == 0
    recorded = json.loads((tmp_path / "tilelang_cpu.json").read_text())
    rows = recorded["results"]["rows"]
    assert {(r["kernel"], r["impl"]) for r in rows} >= {("rmsnorm", "tilelang"), ("rmsnorm", "eager (8 kernels)"),
                                                       ("residual_add", "tilelang"), ("copy", "torch copy_")}
    assert all(v["ok"] for v in recorded["results"]["variants"])
    assert "rmsnorm" in capsys.readouterr().out
