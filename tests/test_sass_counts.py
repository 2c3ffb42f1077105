"""python -m mhc_lab.bench sass-counts: static SASS of the two hot kernels, counted by class."""

import re

import pytest

from mhc_lab.bench import sass_counts
from mhc_lab.bench.ncu_summary import SASS_CLASSES
from mhc_lab.kernels._target import nvcc_path

LISTING = """
        code for sm_90a
                Function : some_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                /* 0x00000a00ff017b82 */
        /*0010*/                   R2UR UR4, R2 ;                                        /* 0x00000000020472ca */
        /*0020*/               @P0 HGMMA.64x32x16.F32.BF16 R40, gdesc[UR20].tnspB, R40 ; /* 0x40600000142879f0 */
        /*0030*/                   FFMA.FTZ R3, R4, R5, R3 ;                             /* 0x0000000504037223 */
        /*0040*/                   F2FP.BF16.F32.PACK_AB R6, R7, R8 ;                    /* 0x000000080706723e */
        /*0050*/              @!P1 LDS.64 R10, [R12+0x10] ;                               /* 0x0000100c0a0a1984 */
        /*0060*/                   UIADD3 UR5, UR5, 0x1, URZ ;                           /* 0x0000000105057890 */
        /*0070*/                   EXIT ;                                                /* 0x000000000000794d */
        ..........
"""


def test_count_takes_every_instruction_line_with_or_without_a_predicate():
    got = sass_counts.count(LISTING)
    assert got["instructions"] == 8 and got["HGMMA"] == 1 and got["R2UR"] == 1
    assert got["opcodes"]["LDS"] == 1 and got["opcodes"]["UIADD3"] == 1
    classes = got["classes"]
    assert list(classes) == list(SASS_CLASSES) and sum(classes.values()) == 8
    assert classes["arithmetic (FFMA, FMUL, FADD)"] == 1 and classes["bf16 conversions"] == 1
    assert classes["uniform registers (descriptors)"] == 2 and classes["shared loads"] == 1
    assert classes["wgmma"] == 1 and classes["addresses, barriers, control"] == 2  # LDC, EXIT


def test_count_refuses_what_is_not_a_sass_listing():
    with pytest.raises(ValueError, match="expected cuobjdump -sass output"):
        sass_counts.count("ptxas info: 0 bytes stack frame\n")


def test_table_sets_the_kernels_side_by_side():
    one = sass_counts.count(LISTING)
    lines = sass_counts.table({"a": one, "b": one}).splitlines()
    assert lines[0].split()[-2:] == ["a", "b"] and lines[1].split()[-2:] == ["8", "8"]
    assert len(lines) == 3 + 1 + len(SASS_CLASSES)


def test_command_refuses_a_kernel_it_does_not_have(capsys):
    with pytest.raises(SystemExit):
        sass_counts.main(["--kernels", "lanes,kernel3"])
    assert "--kernels: expected names among lanes, post_project, got 'lanes,kernel3'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected a kernel among lanes, post_project, got 'x'"):
        sass_counts.kernel_source("x")
    from mhc_lab.bench import main  # the suite's name in python -m mhc_lab.bench

    with pytest.raises(SystemExit):
        main(["sass-counts", "--kernels", ""])
    assert "--kernels: expected names among lanes, post_project, got ''" in capsys.readouterr().err


def test_missing_tools_are_named_with_where_to_get_them(monkeypatch, capsys):
    monkeypatch.setattr(sass_counts, "_tool", lambda name: None if name != "nvcc" else "/usr/bin/nvcc")
    with pytest.raises(RuntimeError, match="not found: cuobjdump, nvdisasm .*pip install nvidia-cuda-cuobjdump"):
        sass_counts.tools()
    assert sass_counts.main(["--kernels", "lanes"]) == 1
    assert "not found: cuobjdump, nvdisasm" in capsys.readouterr().err


def _have_tools() -> bool:
    try:
        sass_counts.tools()
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(nvcc_path() is None or not _have_tools(),
                    reason="needs nvcc, cuobjdump and nvdisasm (the test extras install the last two on Linux x86_64)")
def test_the_post_projections_sass_has_the_wgmma_its_source_issues():
    """End to end at n = 2, C = 64 (small, quick to build): each lane's product per column block is block_k / 16
    wgmma of depth 16 (its call site in the CUDA source, in a loop over them), so 2 x 64 / 16 = 8 HGMMA, each fed
    by descriptors moved into uniform registers."""
    from mhc_lab.kernels.post_project import cuda_tuning

    source = sass_counts.kernel_source("post_project", n=2, width=64)
    assert len(re.findall(r"wgmma_ss<", source)) == 2  # one call site per lane
    got = sass_counts.count(sass_counts.disassemble(source))
    assert got["HGMMA"] == 2 * cuda_tuning(2)["block_k"] // 16 == 8
    assert got["R2UR"] > 0 and got["instructions"] == sum(got["classes"].values())


GENERATED = '''#include <tl_templates/cuda/common.h>
extern "C" __global__ void __launch_bounds__(384, 1) first_kernel(float* __restrict__ x) {
  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];
  if (((int)threadIdx.x) < 128) {
    x[0] = 1.f;
  } else {
    if (((int)threadIdx.x) < 256) {
      x[1] = 2.f;
    }
  }
  if (((int)threadIdx.x) < 100) {
    x[2] = 3.f;
  }
}

extern "C" __global__ void __launch_bounds__(64, 1) second_kernel(float* __restrict__ y) {
  if (((int)threadIdx.x) < 32) {
    y[0] = 0.f;
  }
}
'''


def test_uniform_warp_branches_compare_a_warp_index_where_whole_warps_branch():
    from mhc_lab.kernels._target import uniform_warp_branches

    got = uniform_warp_branches(GENERATED)
    declaration = "const int mhc_warp = __shfl_sync(0xffffffff, ((int)threadIdx.x) >> 5, 0);"
    assert got.count(declaration) == 2  # once per kernel, first in its body
    for kernel in ("first_kernel(float* __restrict__ x) {\n  " + declaration,
                   "second_kernel(float* __restrict__ y) {\n  " + declaration):
        assert kernel in got
    assert "if (mhc_warp < 4) {" in got and "if (mhc_warp < 8) {" in got and "if (mhc_warp < 1) {" in got
    assert "if (((int)threadIdx.x) < 100) {" in got  # not whole warps: left as it is
    assert uniform_warp_branches("int main() { return 0; }") == "int main() { return 0; }"


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found on PATH or in /usr/local/cuda/bin: no CUDA build check")
def test_kernel2_built_with_uniform_branches_has_them_and_the_default_build_does_not():
    """The setting reaches compile_program's post-processing, and its builds are cached apart from the default
    ones (the nvcc flags, TileLang's cache key, differ)."""
    from mhc_lab.kernels._target import compile_program, cuda_flags, warp_uniform_branches
    from mhc_lab.kernels.pre_backward import pre_backward_lanes_program

    def build():
        program = pre_backward_lanes_program(4, 256, "bfloat16", "sm_90", post_grad=True, splits=2)
        return compile_program(program, "sm_90").get_kernel_source()

    default = build()
    with warp_uniform_branches():
        assert cuda_flags()[-1] == "-DMHC_LAB_UNIFORM_WARP_BRANCHES=1"
        uniform = build()
    assert "mhc_warp" not in default and "if (((int)threadIdx.x) < 128) {" in default
    assert "if (mhc_warp < 4) {" in uniform and "if (((int)threadIdx.x) < 128) {" not in uniform
    assert uniform.count("wgmma_ss<") == default.count("wgmma_ss<")
    if _have_tools():  # what the rewrite is for: the descriptors stay in uniform registers
        plain, made_uniform = (sass_counts.count(sass_counts.disassemble(s)) for s in (default, uniform))
        assert plain["HGMMA"] == made_uniform["HGMMA"] and made_uniform["R2UR"] < plain["R2UR"] / 2
