"""The kernels on the GPU a learner has: Ampere, Ada, Hopper, Blackwell, and the reference before sm_80.

- CPU, no GPU or nvcc: the targets of each architecture; which path every op takes for each compute capability
  (kernel_paths): the kernels at n = 1..8 on every GPU from sm_80 on, each op's programs within the shared memory
  of a block there (99 KB on sm_86, sm_89, sm_120); backend 'auto' follows the paths with one warning per reason,
  backend 'kernels' refuses a GPU it cannot serve by name, and no op reaches a Hopper program off Hopper (the
  capability mocked). The shared memory the dispatch counts on is what TileLang gives the programs, per
  architecture; on sm_90 the projection pass and kernel 1 are the programs of fixed Hopper tiles.
- nvcc, compile only: the build matrix, every kernel the dispatch can choose at n = 4 and the tiles that change
  with the architecture at n = 7, at a width no tile divides, built for sm_80, sm_86, sm_89, sm_90, sm_100 and
  sm_120, each within the shared memory of the GPUs that run it; kernel 1 at n = 5, 6, 7 for sm_90.
- CUDA (skipped without a GPU): kernel 2's portable program built for the GPU at hand against float64 sums of
  its operands at n = 1, 2, 4, 8, lowered as on sm_80 and as for the GPU itself; the projection pass and kernel 1
  in the tiles of a 99 KB GPU against float64; and whole sites forward and backward through the ops with the
  portable path forced, at bf16 tolerance of the float64 truth.
"""

import functools
import re
import subprocess
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from mhc_lab.kernels import nvcc_path
from mhc_lab.kernels._target import PORTABLE_LOWERING
from mhc_lab.reference import InputError

CUDA = torch.cuda.is_available()
CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
NAMES = {(7, 5): "Tesla T4", (8, 0): "A100-SXM4-40GB", (8, 6): "GeForce RTX 3090", (8, 9): "L4", (9, 0): "H200",
         (10, 0): "B200", (12, 0): "GeForce RTX 5090"}
# TileLang's lowering for sm_80 on a newer GPU: cp.async copies, mma.sync products, no warp specialisation (the
# CUDA source is the one an sm_80 build gets; tested below), so that a Hopper GPU runs what Ampere and Ada run
SM80_LOWERING = PORTABLE_LOWERING  # the lowering every portable program gets (kernels._target)


def _lanes(n=4, C=1024, dtype=torch.bfloat16):
    """Lanes on CUDA device 0 as the dispatch sees them (shape, dtype, device), without a GPU."""
    return SimpleNamespace(shape=(16, n, C), dtype=dtype, device=torch.device("cuda", 0))


def _gpu(monkeypatch, capability):
    """The dispatch sees a GPU of this compute capability (named as one such GPU), no warning given yet."""
    from mhc_lab.kernels.portability import shared_bytes_per_block
    from mhc_lab.ops import dispatch

    facts = (NAMES[capability], capability, shared_bytes_per_block(capability))
    monkeypatch.setattr(dispatch, "cuda_device_facts", lambda device: facts)
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_RESOLVED", {})
    return facts


# ------------------------------------------------------------------------------------- targets and dispatch


def test_targets_take_the_architectures_own_build_from_sm_90_on():
    from mhc_lab.kernels._target import canonical_target, device_target, is_hopper

    builds = {"sm_75": "sm_75", "sm_80": "sm_80", "sm_86": "sm_86", "sm_89": "sm_89", "sm_90": "sm_90a",
              "sm_90a": "sm_90a", "sm_100": "sm_100a", "sm_120": "sm_120a"}
    assert {t: canonical_target(t) for t in builds} == builds
    assert [device_target(c) for c in ((8, 6), (9, 0), (12, 0))] == ["sm_86", "sm_90a", "sm_120a"]
    assert [t for t in builds if is_hopper(t)] == ["sm_90", "sm_90a"]


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_each_op_takes_a_path_whose_programs_build_and_fit_there(capability, n):
    """From sm_80 on every op takes the kernels at every n: the Hopper programs on sm_90, elsewhere the portable
    ones, the chained sites unchained (the fused post + projection is a Hopper program), and each op's programs
    ask for no more shared memory per block than the GPU gives (99 KB on sm_86, sm_89, sm_120). Before sm_80
    every op of the site takes the reference, the reason said."""
    from mhc_lab.kernels.portability import OPS, shared_bytes_per_block, site_shared_bytes
    from mhc_lab.ops.dispatch import kernel_paths

    paths = kernel_paths(capability, n)
    assert tuple(paths) == OPS
    kinds = {path.split(":")[0] for path in paths.values()}
    hopper = capability[0] == 9
    if capability < (8, 0):
        assert kinds == {"reference"}, paths
        assert "made for sm_80 and later" in paths["pre forward"] and f"sm_{capability[0]}{capability[1]}" in \
            paths["pre forward"]
        assert len(set(paths.values())) == 1  # one site, one backend: every op says the same reason
        return
    limit = shared_bytes_per_block(capability)
    over = {op: need for op, need in site_shared_bytes(n, hopper, capability).items() if need is None or need > limit}
    assert over == {}, f"ops without programs that fit {limit // 1024} KB at n = {n}: {over}"
    if hopper:
        assert kinds == {"hopper"}, paths
    else:
        assert kinds == {"portable"} and paths["chained sites"].startswith("portable: unchained"), paths


def test_the_paths_of_the_common_gpus():
    """What the issue's learners get: the Hopper programs on an H200, the portable ones on an A100, a B200 and the
    99 KB GPUs (RTX 3090, L4, RTX 5090) at every n, n = 8 included (its projection pass takes 128 tokens in two
    stages there, 96 KB); the reference (with its reason) before sm_80, and where a GPU gives a block less shared
    memory than its architecture's programs are tiled for."""
    from mhc_lab.ops.dispatch import kernel_paths

    for n in range(1, 9):
        assert set(kernel_paths((9, 0), n).values()) == {"hopper"}, n
        for capability in ((8, 0), (8, 6), (8, 9), (10, 0), (12, 0)):
            assert {p.split(":")[0] for p in kernel_paths(capability, n).values()} == {"portable"}, (capability, n)
    assert kernel_paths((7, 5))["pre backward lanes"].startswith("reference: the kernels are made for sm_80")
    assert kernel_paths(None)["post forward"].startswith("reference: no CUDA GPU")
    why = "the pre's projection pass needs 96 KB of shared memory per block at n = 8, sm_86 gives 64 KB"
    assert set(kernel_paths((8, 6), 8, shared_bytes=64 * 1024).values()) == {f"reference: {why}"}


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_auto_takes_the_kernels_where_the_gpu_serves_else_warns_once(monkeypatch, capability, n):
    """Every GPU from sm_80 on serves (n = 8 on the 99 KB GPUs too); before sm_80 'auto' warns once, naming the
    GPU and its compute capability, and 'kernels' refuses it."""
    from mhc_lab.ops.dispatch import (
        cuda_programs,
        fused_projection_applies,
        kernel_paths,
        kernels_apply,
        resolve_backend,
    )

    name = _gpu(monkeypatch, capability)[0]
    x = _lanes(n=n)
    serves = capability >= (8, 0)
    assert kernel_paths(capability, n)["pre forward"].startswith("reference") is not serves
    assert kernels_apply(x)[0] is serves
    target = {(7, 5): "sm_75", (8, 0): "sm_80", (8, 6): "sm_86", (8, 9): "sm_89", (9, 0): "sm_90a",
              (10, 0): "sm_100a", (12, 0): "sm_120a"}[capability]
    assert cuda_programs(x) == (target, capability == (9, 0))
    assert fused_projection_applies("kernels", x) is (capability == (9, 0))  # unchained off Hopper
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = [resolve_backend("auto", x) for _ in range(3)]
    assert chosen == ["kernels" if serves else "reference"] * 3
    said = [str(w.message) for w in caught]
    if serves:
        assert said == [] and resolve_backend("kernels", x) == "kernels"
    else:
        capability_text = f"compute capability {capability[0]}.{capability[1]}"
        assert len(said) == 1 and name in said[0] and capability_text in said[0]  # once per process and reason
        with pytest.raises(InputError, match=rf"backend 'kernels': .*{name}.*{re.escape(capability_text)}"):
            resolve_backend("kernels", x)


def test_auto_says_nothing_where_the_lanes_not_the_gpu_rule_the_kernels_out(monkeypatch):
    """float32 lanes, or n * C not a multiple of 8, take the reference without a warning on any GPU: the lanes
    decide that, not the GPU."""
    from mhc_lab.ops.dispatch import resolve_backend

    _gpu(monkeypatch, (8, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend("auto", _lanes(dtype=torch.float32)) == "reference"
        assert resolve_backend("auto", _lanes(n=1, C=1001)) == "reference"
    with pytest.raises(InputError, match="bfloat16 lanes, got torch.float32"):
        resolve_backend("kernels", _lanes(dtype=torch.float32))


def test_kernel_2_and_the_fused_projection_refuse_what_they_cannot_build():
    """Off Hopper the fused post + projection is refused before any build; kernel 2's portable tiles fit the
    99 KB every GPU from sm_80 on gives a block for every n and form the ops use (with the post's g where it
    has tiles; else a clear error)."""
    from mhc_lab.kernels._target import PORTABLE_SMEM_LIMIT
    from mhc_lab.kernels.post_project import post_project_program
    from mhc_lab.kernels.pre_backward_lanes import (
        portable_lane_tiling,
        portable_shared_bytes,
        pre_backward_lanes_program,
    )

    for target in ("sm_80", "sm_89", "sm_100", "sm_120"):
        with pytest.raises(ValueError, match="a Hopper program .* runs unchained"):
            post_project_program(4, 1024, "bfloat16", target)
    for n in range(1, 9):
        for add_dx, post_grad in ((False, False), (True, False), (False, True)):
            try:
                lanes, columns, stages = portable_lane_tiling(n, add_dx, post_grad)
            except ValueError as error:
                assert post_grad and n > 5 and "shared memory" in str(error)
                continue
            assert n % lanes == 0 and (lanes == n or not post_grad)
            assert portable_shared_bytes(n, lanes, columns, stages, add_dx, post_grad) <= PORTABLE_SMEM_LIMIT
    with pytest.raises(ValueError, match="n = 8 with g needs"):
        pre_backward_lanes_program(8, 64, "bfloat16", "sm_80", post_grad=True)


def _lowered(program, target, pass_configs=None):
    """(CUDA source, dynamic shared memory of its one kernel) as TileLang lowers the program (no nvcc)."""
    import tilelang
    import tvm

    from mhc_lab.kernels._target import canonical_target, code_generation, quiet_tilelang

    quiet_tilelang()
    t = {"kind": "cuda", "arch": canonical_target(target)}
    with code_generation(), tvm.target.Target(t), tvm.transform.PassContext(config=pass_configs or {}):
        artifact = tilelang.lower(program, target=t)
    [func] = artifact.device_mod.functions.values()
    return artifact.kernel_source, int(func.attrs.get("dyn_shared_memory_buf", 0))


def _normalised(source):
    """Generated CUDA with its unnamed shared buffers' declarations left out and the buffers renamed in order of
    first use (TileLang places them in an order that varies from run to run)."""
    source = re.sub(r"^\s*void\* v(?:_\d+)? = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ \d+\)\);\n", "", source,
                    flags=re.M)
    names = {}
    return re.sub(r"\bv(?:_\d+)?\b", lambda m: names.setdefault(m.group(0), f"V{len(names)}"), source)


@pytest.mark.parametrize("n,C,form", [(4, 1000, "none"), (4, 1000, "post_grad"), (2, 40, "add_dx")])
def test_portable_kernel_2_lowers_to_cp_async_and_mma_sync_in_the_shared_memory_counted(n, C, form):
    """For sm_80: no TMA, no warpgroup MMA, its products by mma.sync and its copies by cp.async, in exactly the
    shared memory portable_shared_bytes counts; the same program lowered for sm_90 as on sm_80 (SM80_LOWERING)
    gives the same CUDA, so the CUDA tests below run on a Hopper GPU what Ampere and Ada GPUs run."""
    from mhc_lab.kernels.pre_backward_lanes import (
        portable_lane_tiling,
        portable_shared_bytes,
        pre_backward_lanes_program,
    )

    flags = {"add_dx": form == "add_dx", "post_grad": form == "post_grad"}
    program = pre_backward_lanes_program(n, C, "bfloat16", "sm_80", splits=2, **flags)
    source, shared = _lowered(program, "sm_80")
    assert not re.search(r"wgmma|tma_|mbarrier|setmaxnreg", source)
    assert "mma" in source and "cp_async" in source
    assert shared == portable_shared_bytes(n, *portable_lane_tiling(n, **flags), **flags)
    if form == "none":
        forced = pre_backward_lanes_program(n, C, "bfloat16", "sm_90", splits=2, hopper=False, **flags)
        assert _normalised(_lowered(forced, "sm_90", SM80_LOWERING)[0]) == _normalised(source)


# Where the tiles of the projection pass and of kernel 1's fused program change with a block's shared memory, by
# architecture: {n: (tokens per CTA, stages)} of the projection pass, {n: columns} of kernel 1's fused program.
PROJECTION_TILES = {"sm_80": {4: (256, 3), 8: (128, 2)}, "sm_86": {4: (256, 2), 8: (128, 2)}}
KERNEL_1_COLUMNS = {"sm_80": {3: 128, 5: 64}, "sm_86": {3: 64, 5: 64, 7: 32}}


@pytest.mark.parametrize("arch", sorted(PROJECTION_TILES))
def test_the_shared_memory_the_dispatch_counts_is_what_tilelang_gives(arch):
    """site_shared_bytes's numbers against the programs TileLang lowers for sm_80 (163 KB a block) and sm_86
    (99 KB) where they are the largest and where their tiles change: the projection pass (256 tokens in three
    stages or two, 128 tokens in two at n = 8) and kernel 1's fused program (128, 64 or 32 columns), each within
    the block; and on sm_80 the programs counted as small, at n = 8."""
    from mhc_lab.kernels import pre_split
    from mhc_lab.kernels.portability import (
        SMALL_SHARED_BYTES,
        coefficients_shared_bytes,
        projection_shared_bytes,
        shared_bytes_per_block,
    )
    from mhc_lab.kernels.post import post_kernel_program
    from mhc_lab.kernels.post_backward import post_backward_program
    from mhc_lab.kernels.pre_backward_coefficients import coefficient_programs, fused_coefficients_program

    capability = (int(arch[3]), int(arch[4]))
    limit = shared_bytes_per_block(capability)
    for n, tiles in PROJECTION_TILES[arch].items():
        assert pre_split.projection_tiles(n, arch) == tiles, n
        lowered = _lowered(pre_split.project_program(n, 4096, "bfloat16", arch), arch)[1]
        assert lowered == projection_shared_bytes(n, capability) <= limit, ("projection", n, lowered)
    for n, columns in KERNEL_1_COLUMNS[arch].items():
        lowered = _lowered(fused_coefficients_program(n, 4096, "bfloat16", arch, splits=4), arch)[1]
        assert lowered == coefficients_shared_bytes(n, capability) == 2 * (n + 1) * 64 * columns * 2 <= limit, \
            ("kernel 1", n, lowered)
    if arch == "sm_80":
        small = [post_kernel_program(8, 4096, "bfloat16", arch), post_backward_program(8, 4096, "bfloat16", arch),
                 pre_split.coefficients_program(8, 4096, arch), pre_split.mix_program(8, 4096, "bfloat16", arch),
                 *coefficient_programs(8, 4096, "bfloat16", arch, splits=4)]
        assert max(_lowered(p, arch)[1] for p in small) <= SMALL_SHARED_BYTES


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_the_sm_90_projection_and_kernel_1_are_the_programs_of_fixed_hopper_tiles(monkeypatch, n):
    """On sm_90 (227 KB a block) the projection pass keeps 256 tokens per CTA in three stages, and kernel 1's
    fused program (run at n = 3; built here at the other n too) its max(32, min(128, 512 // n)) columns, a power
    of two at these n: each lowers to the CUDA of a build with those tiles fixed, in the shared memory they
    take."""
    from mhc_lab.kernels import pre_backward_coefficients, pre_split

    assert pre_split.projection_tiles(n, "sm_90") == (256, 3)
    rows, columns = pre_split.phi_tile_rows(n), max(32, min(128, 512 // n))
    assert columns & (columns - 1) == 0

    def programs():
        return {"projection": _lowered(pre_split.project_program(n, 4096, "bfloat16", "sm_90"), "sm_90"),
                "kernel 1": _lowered(pre_backward_coefficients.fused_coefficients_program(
                    n, 4096, "bfloat16", "sm_90", splits=4), "sm_90")}

    now = programs()
    assert now["projection"][1] == max(3 * (256 + rows) * 64 * 2, rows * 256 * 4)
    assert now["kernel 1"][1] == 2 * (n + 1) * 64 * columns * 2
    monkeypatch.setattr(pre_split, "projection_tiles", lambda n, target: (256, 3))
    monkeypatch.setattr(pre_backward_coefficients, "shared_memory_limit", lambda target: 1 << 30)
    fixed = programs()
    for name, (source, shared) in now.items():
        assert shared == fixed[name][1], name
        assert _normalised(source) == _normalised(fixed[name][0]), f"{name} at n = {n}: not the fixed tiles' CUDA"


def _tiles_of(monkeypatch, arch):
    """The projection pass and kernel 1 take the tiles of this architecture's block (its shared memory),
    whatever the target they are built for."""
    from mhc_lab.kernels import _target, pre_backward_coefficients, pre_split

    limit = _target.shared_memory_limit(arch)
    for module in (pre_split, pre_backward_coefficients):
        monkeypatch.setattr(module, "shared_memory_limit", lambda target: limit)


def test_the_99_kb_tiles_lowered_for_sm_90_as_on_sm_80_are_the_sm_86_programs(monkeypatch):
    """The projection pass and kernel 1's fused program in the tiles of an sm_86 block (n = 7: 128 tokens in two
    stages, 32 columns), built for sm_90 and lowered as on sm_80 (SM80_LOWERING), give the CUDA of the sm_86
    build: the CUDA test below runs on a Hopper GPU what the 99 KB GPUs run."""
    from mhc_lab.kernels import pre_split
    from mhc_lab.kernels.pre_backward_coefficients import fused_coefficients_program

    def programs(target):
        return [pre_split.project_program(7, 1000, "bfloat16", target),
                fused_coefficients_program(7, 1000, "bfloat16", target, splits=4)]

    on_sm_86 = [_lowered(p, "sm_86") for p in programs("sm_86")]
    _tiles_of(monkeypatch, "sm_86")
    on_sm_90 = [_lowered(p, "sm_90", SM80_LOWERING) for p in programs("sm_90")]
    # 2 stages x (128 tokens + 128 rows of phi) x 64 bf16; 2 stages x (7 lanes + dy) x 64 tokens x 32 bf16
    assert [shared for _, shared in on_sm_86] == [2 * 256 * 64 * 2, 2 * 8 * 64 * 32 * 2]
    for name, (source, shared), (want, want_shared) in zip(("projection", "kernel 1"), on_sm_90, on_sm_86):
        assert shared == want_shared and not re.search(r"wgmma|tma_|setmaxnreg", source), name
        assert _normalised(source) == _normalised(want), f"{name}: not the CUDA of the sm_86 build"


# ------------------------------------------------------------------------------------------- build matrix

BUILD_N, BUILD_C = 4, 1000  # a width that no tile (32 or 64 columns) divides, a multiple of 8 (16-byte rows)
# n not a power of two: kernel 1's fused program (32 columns on the 99 KB GPUs, 64 elsewhere) and the projection
# pass's tiles for its 128 rows of phi (128 tokens in two stages on the 99 KB GPUs, 256 in three elsewhere)
BUILD_ODD_N = 7
BUILD_ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"]
needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found (PATH, /usr/local/cuda/bin): the "
                                                           "compile-only checks build with it")


@functools.lru_cache(maxsize=None)
def _nvcc_archs() -> frozenset:
    """The real architectures this nvcc builds for ('sm_80', ...), from nvcc --list-gpu-code."""
    out = subprocess.run([nvcc_path(), "--list-gpu-code"], capture_output=True, text=True, check=True).stdout
    return frozenset(re.findall(r"sm_\d+", out))


def _site_programs(target: str) -> list:
    """(op, n, program) for every program the ops build for one site at BUILD_N, BUILD_C on this target: the
    Hopper ones on sm_90, the portable ones elsewhere (kernel 2 as a separate site and as a linked one takes it
    at n = 4); and at BUILD_ODD_N the two whose tiles follow a block's shared memory, the projection pass and
    kernel 1's fused program."""
    from mhc_lab.kernels import pre_split
    from mhc_lab.kernels._target import is_hopper
    from mhc_lab.kernels.post import post_kernel_program
    from mhc_lab.kernels.post_backward import post_backward_program
    from mhc_lab.kernels.post_project import post_project_program
    from mhc_lab.kernels.pre_backward_coefficients import coefficient_programs
    from mhc_lab.kernels.pre_backward_lanes import pre_backward_lanes_program

    n, C, odd = BUILD_N, BUILD_C, BUILD_ODD_N
    programs = [
        ("post forward", n, post_kernel_program(n, C, "bfloat16", target)),
        *(("pre forward", n, p) for p in (pre_split.phi_split_program(n, C, target),
                                          pre_split.project_program(n, C, "bfloat16", target),
                                          pre_split.coefficients_program(n, C, target),
                                          pre_split.mix_program(n, C, "bfloat16", target))),
        *(("post backward", n, post_backward_program(n, C, "bfloat16", target, lanes_grad=g)) for g in (True, False)),
        *(("pre backward coefficients", n, p) for p in coefficient_programs(n, C, "bfloat16", target, splits=4)),
        *(("pre backward lanes", n, pre_backward_lanes_program(n, C, "bfloat16", target, splits=2, post_grad=g))
          for g in (False, True)),
        ("pre forward", odd, pre_split.project_program(odd, C, "bfloat16", target)),
        *(("pre backward coefficients", odd, p) for p in coefficient_programs(odd, C, "bfloat16", target, splits=4)),
    ]
    if is_hopper(target):
        programs.append(("chained sites", n, post_project_program(n, C, "bfloat16", target, splits=1)))
    return programs


def _shared_at_launch(kernel) -> tuple[int, int]:
    """(dynamic, static) shared memory of a compiled one-kernel program at launch: the last launch argument its
    host code packs where the kernel declares dynamic shared memory, and its static shared arrays."""
    source, host = kernel.get_kernel_source(), kernel.get_host_source()
    static = sum(int(count) * {"uint64_t": 8, "float": 4, "int": 4}[kind]
                 for kind, count in re.findall(r"^\s*__shared__ __align__\(\d+\) (\w+) \w+\[(\d+)\];", source, re.M))
    if "extern __shared__" not in source:
        return 0, static
    [call] = re.findall(r"TVMFFIFunctionCall\(\w+_kernel_packed, \(TVMFFIAny\*\) stack_ffi_any, (\d+),", host)
    last = re.findall(rf"stack_ffi_any\)\[{int(call) - 1}\]\.v_int64\) = \(\(int64_t\)(\d+)\)", host)
    return int(last[-1]), static


@needs_nvcc
@pytest.mark.parametrize("arch", BUILD_ARCHS)
def test_build_matrix(arch):
    """Each program the dispatch can choose for a site builds with nvcc for this architecture (compile only),
    kernel_paths sends every op there to the kernels, and each program asks at launch for no more shared memory
    per block than the GPUs of that architecture give."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.portability import shared_bytes_per_block
    from mhc_lab.ops.dispatch import kernel_paths

    if arch not in _nvcc_archs():
        pytest.skip(f"this nvcc does not build for {arch}")
    capability = (int(arch[3:-1]), int(arch[-1]))
    limit = shared_bytes_per_block(capability)
    start, built = time.perf_counter(), []
    for op, n, program in _site_programs(arch):
        path = kernel_paths(capability, n)[op]
        assert not path.startswith("reference"), (op, n, path)
        kernel = compile_program(program, arch)
        source = kernel.get_kernel_source()
        if arch != "sm_90":  # nothing of the Hopper programs off Hopper
            assert "wgmma" not in source, (op, n)
        elif op in ("pre backward lanes", "chained sites"):
            assert "wait_wgmma" in source, (op, n)
        shared = sum(_shared_at_launch(kernel))
        assert shared <= limit, (op, n, shared, limit)
        built.append((op, n, shared))
    print(f"{arch}: {len(built)} programs in {time.perf_counter() - start:.0f} s, the most shared memory "
          f"{max(b[2] for b in built) // 1024} of {limit // 1024} KB")


@needs_nvcc
@pytest.mark.parametrize("n", [5, 6, 7])
def test_kernel_1_builds_for_sm_90_at_n_that_is_not_a_power_of_two(n):
    """Kernel 1 at n = 5, 6, 7 is its fused program, whose columns are a power of two (64 on sm_90) where
    512 // n is not (TileLang has no layout for 102, 85 or 73); it builds for sm_90 at a width of many tiles and
    takes the shared memory coefficients_shared_bytes counts."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.portability import coefficients_shared_bytes, shared_bytes_per_block
    from mhc_lab.kernels.pre_backward_coefficients import coefficient_programs

    [fused] = coefficient_programs(n, 1000, "bfloat16", "sm_90", splits=4)
    kernel = compile_program(fused, "sm_90")
    dynamic, static = _shared_at_launch(kernel)
    assert dynamic == coefficients_shared_bytes(n, (9, 0)) == 2 * (n + 1) * 64 * 64 * 2
    assert dynamic + static <= shared_bytes_per_block((9, 0))


# ------------------------------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU: the portable kernels' CUDA tests run only there")
PORTABLE_LANE_CASES = [(1, 1000, 129), (2, 40, 33), (4, 4096, 300), (4, 136, 1), (8, 8, 65)]


@needs_cuda
@pytest.mark.parametrize("extra", ["none", "add_dx", "post_grad"])
@pytest.mark.parametrize("n,C,tokens", PORTABLE_LANE_CASES)
def test_cuda_portable_lane_kernel_matches_float64(n, C, tokens, extra):
    """Kernel 2's portable program, lowered as for sm_80 (SM80_LOWERING: the CUDA Ampere and Ada GPUs run) and
    built for this GPU, against float64 sums of its operands: dx = dmix phi_j + H_pre[j] dy + 2 ds x_j (+ dx_post,
    or + sum_i H_res[i, j] g_i), dphi = dmix^T x; outputs poisoned first. The post's g only where the portable
    program has tiles for it (n <= 5)."""
    from test_backward import _kernel2_dx_truth, _lane_operands, _relmax, _site_inputs, _upstream

    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_lanes import dphi_from_partial, pre_backward_lanes_program
    from mhc_lab.kernels.pre_backward_operands import gemm_depth

    if extra == "post_grad" and n > 5:
        pytest.skip("the portable program has no tiles for the post's g past n = 5 (the ops hand g over at n = 4)")
    x, phi, _, _, _ = _site_inputs((tokens,), n, C, seed=tokens + 7, device="cuda")
    x = x.to(torch.bfloat16)
    dy, _, _, g = _upstream((tokens,), n, C, seed=11, device="cuda")
    dy, g = dy.to(torch.bfloat16), g.to(torch.bfloat16)
    res = torch.rand(tokens, n, n, device="cuda")
    dsplit, coef, dmix = _lane_operands(tokens, n, C, seed=tokens)
    phi32 = phi.float()
    want = _kernel2_dx_truth(x, dy, coef, dmix, phi32)
    want = want + {"none": 0, "add_dx": g.double(),
                   "post_grad": torch.einsum("tij,tic->tjc", res.double(), g.double())}[extra]
    more = {"none": [], "add_dx": [g], "post_grad": [g, res]}[extra]
    major, minor = torch.cuda.get_device_capability()
    target = f"sm_{major}{minor}"
    program = pre_backward_lanes_program(n, C, "bfloat16", target, splits=2, hopper=False, add_dx=extra == "add_dx",
                                         post_grad=extra == "post_grad")
    lanes = compile_program(program, target, pass_configs=SM80_LOWERING)
    dx = torch.full_like(x, float("nan"))
    partial = torch.full((2, 2 * gemm_depth(n), n * C), float("nan"), device="cuda")
    lanes(x, dy, dsplit, coef, phi32, *more, dx, partial)
    assert _relmax(dx, want) < 1e-2
    assert _relmax(dphi_from_partial(partial, n), dmix.cuda().t() @ x.double().reshape(tokens, n * C)) < 1e-4


TILE_CASES = [(3, 1000, 129), (5, 40, 33), (7, 1000, 70), (8, 136, 65)]


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", TILE_CASES)
def test_cuda_projection_and_kernel_1_in_the_tiles_of_99_kb_gpus_match_float64(monkeypatch, n, C, tokens):
    """The projection pass and (n not a power of two) kernel 1's fused program in the tiles of an sm_86 block
    (_tiles_of: fewer tokens or stages, narrower columns), lowered as on sm_80 and built for this GPU: what the
    99 KB GPUs run. The projection's partial sums against the float64 projection and sum of squares; kernel 1's
    dH_pre against float64, its bias and alpha gradients against the float64 truth of the same bf16 inputs, and
    every output against kernel 1 in this GPU's own tiles; outputs poisoned first."""
    from test_backward import _relmax, _site_inputs, _upstream

    from mhc_lab.kernels import pre_split
    from mhc_lab.kernels._coefficients import spread_fits
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_backward_coefficients import fused_coefficients_program
    from mhc_lab.kernels.pre_backward_operands import coef_width, gemm_depth
    from mhc_lab.reference import mhc_coefficients
    from mhc_lab.reference.backward import pre_backward

    major, minor = torch.cuda.get_device_capability()
    target = f"sm_{major}{minor}"
    x, phi, bias, alpha, _ = _site_inputs((tokens,), n, C, seed=tokens, device="cuda")
    x = x.to(torch.bfloat16)
    m, splits = n * n + 2 * n, pre_split.PROJECTION_SPLITS
    flat = x.double().reshape(tokens, n * C)
    fused = not spread_fits(n)
    if fused:
        own = compile_program(fused_coefficients_program(n, C, "bfloat16", target, splits=splits), target)
    sm_86_tiles = pre_split.projection_tiles(n, "sm_86")
    _tiles_of(monkeypatch, "sm_86")
    assert pre_split.projection_tiles(n, target) == sm_86_tiles

    hi = phi.to(torch.bfloat16)
    phi_hl = torch.zeros(pre_split.phi_rows(n), n * C, dtype=torch.bfloat16, device="cuda")
    phi_hl[:m], phi_hl[m : 2 * m] = hi, (phi - hi.double()).to(torch.bfloat16)
    project = compile_program(pre_split.project_program(n, C, "bfloat16", target), target, pass_configs=SM80_LOWERING)
    partial = torch.full((splits, tokens, m + 1), float("nan"), device="cuda")
    project(x.reshape(tokens, n * C), phi_hl, partial)
    sums = partial.double().sum(0)
    assert _relmax(sums[:, :m], flat @ phi.t()) < 1e-4
    assert _relmax(sums[:, m], flat.pow(2).sum(-1)) < 1e-5
    if not fused:
        return

    tiled = compile_program(fused_coefficients_program(n, C, "bfloat16", target, splits=splits), target,
                            pass_configs=SM80_LOWERING)
    dy, dpost, dres, _ = _upstream((tokens,), n, C, seed=5, device="cuda")
    dy = dy.to(torch.bfloat16)
    partial = torch.cat([flat @ phi.t(), flat.pow(2).sum(-1, keepdim=True)], -1).float()[None].repeat(splits, 1, 1)
    partial = partial / splits
    pre = mhc_coefficients(x.double(), phi, bias, alpha).pre.float().contiguous()
    outs = {}
    for name, kernel in (("99 KB tiles", tiled), ("own tiles", own)):
        dpre, dtok, dmix = (torch.full((tokens, k), float("nan"), device="cuda") for k in (n, m + 4, m))
        dsplit = torch.full((tokens, 3, 2 * gemm_depth(n)), float("nan"), dtype=torch.bfloat16, device="cuda")
        coef = torch.full((tokens, coef_width(n)), float("nan"), device="cuda")
        kernel(x, dy, partial, bias.float(), alpha.float(), dpost.float(), dres.float(), pre, dpre, dtok, dmix, dsplit,
               coef)
        outs[name] = [dpre, dtok[:, :m], dmix, dtok[:, m:], dsplit, coef]  # dtok: dlogit, then extra
    tiled_outs = outs["99 KB tiles"]
    assert _relmax(tiled_outs[0], torch.einsum("tc,tjc->tj", dy.double(), x.double())) < 1e-5
    want = pre_backward(*(t.double() for t in (x, phi, bias, alpha, dy, dpost, dres)))
    groups = {"pre": slice(0, n), "post": slice(n, 2 * n), "res": slice(2 * n, m)}
    for group, cols in groups.items():
        assert _relmax(tiled_outs[1][:, cols].double().sum(0), want.bias[cols]) < 1e-4, group
    assert _relmax(tiled_outs[3][:, :3].double().sum(0), want.alpha) < 1e-4
    for what, a, b in zip(("dpre", "dlogit", "dmix", "extra", "dsplit", "coef"), tiled_outs, outs["own tiles"]):
        if what in ("dlogit", "dmix"):
            for group, cols in groups.items():
                assert _relmax(a[:, cols], b[:, cols]) < 1e-4, (what, group)
        else:
            assert _relmax(a, b) < (1e-2 if what == "dsplit" else 1e-4), what


def _portable_path(monkeypatch):
    """The ops take the portable programs on this GPU (a Hopper GPU included): kernel 2's portable program,
    built for the GPU's own architecture, and the sites unchained."""
    from mhc_lab.ops import dispatch

    monkeypatch.setattr(dispatch, "hopper_programs", lambda capability: False)


# n = 6 at a width of many tiles: kernel 1's fused program in 64 columns (a power of two: TileLang has no layout
# for 85)
PORTABLE_SITE_CASES = [(1, 1000, 129), (2, 40, 33), (4, 4096, 300), (4, 136, 1), (8, 8, 65), (6, 1000, 70)]


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", PORTABLE_SITE_CASES)
def test_cuda_site_on_the_portable_path_matches_float64_and_repeats_bitwise(monkeypatch, n, C, tokens):
    """Separate and linked sites, forward and backward, through the ops on the portable path (kernel 2's portable
    program, seen built): the next lanes and each gradient within bf16 tolerance of the float64 truth, the
    linked site's gradients bit for bit from run to run."""
    from test_backward import (
        _assert_site_grads_close,
        _assert_site_grads_repeat,
        _cuda_site_case,
        _cuda_site_grads,
        _site,
    )

    from mhc_lab.kernels import pre_backward
    from mhc_lab.ops.dispatch import cuda_programs, kernel_paths

    _portable_path(monkeypatch)
    built = []
    real = pre_backward.pre_backward_kernels

    def spy(*args, **kwargs):
        built.append(kwargs.get("hopper"))
        return real(*args, **kwargs)

    monkeypatch.setattr(pre_backward, "pre_backward_kernels", spy)
    x, phi, bias, alpha, weight, g, want = _cuda_site_case(n, C, tokens)
    assert not cuda_programs(x)[1]
    assert {p.split(":")[0] for p in kernel_paths(torch.cuda.get_device_capability(), n).values()} == {"portable"}
    for linked in (False, True):
        out = _site("kernels", x, phi.float(), bias.float(), alpha.float(), weight, linked)
        truth = _site("reference", x.double(), phi, bias, alpha, weight, linked)
        assert float((out.double() - truth).norm() / truth.norm()) < 2e-2, linked
    runs = [_cuda_site_grads(x, phi, bias, alpha, weight, g, linked) for linked in (False, True, True)]
    assert built and set(built) == {False}
    for site, got in (("separate", runs[0]), ("linked", runs[1])):
        _assert_site_grads_close(got, want, site)
    _assert_site_grads_repeat(runs[1], runs[2])


@needs_cuda
@pytest.mark.parametrize("n,C", [(4, 4096), (2, 40)])
def test_cuda_chained_sites_on_the_portable_path_run_unchained(monkeypatch, n, C):
    """On the portable path a stack of sites runs unchained (no partial handed on), to the same lanes as the
    reference within bf16 tolerance; a linked post asked for the next projection all the same gives it by the
    post kernel and the projection pass, against the float64 projection of the lanes it wrote."""
    from test_backward import _site_inputs

    from mhc_lab.ops import mhc_site_chained
    from mhc_lab.ops.dispatch import partial_splits
    from mhc_lab.ops.site_ops import post_forward_linked, pre_forward

    _portable_path(monkeypatch)
    x, phi, bias, alpha, f = _site_inputs((64,), n, C, seed=5, device="cuda")
    x, f = x.to(torch.bfloat16), f.to(torch.bfloat16)
    phi, bias, alpha = phi.float(), bias.float(), alpha.float()
    out, partial = mhc_site_chained(x, phi, bias, alpha, torch.tanh, next_phi=phi, backend="kernels")
    assert partial is None
    want, _ = mhc_site_chained(x, phi, bias, alpha, torch.tanh, next_phi=phi, backend="reference")
    assert float((out.double() - want.double()).norm() / want.double().norm()) < 2e-2
    _, post, res, _, _, link = pre_forward(x, phi, bias, alpha, "kernels")
    lanes, partial = post_forward_linked(x, link, f, post, res, "kernels", phi)
    assert partial.shape[0] == partial_splits("kernels", x, chained=True)
    flat = lanes.double().reshape(64, n * C)
    got = partial.double().sum(0)
    for name, a, b in (("projection", got[:, :-1], flat @ phi.double().t()),
                       ("sum of squares", got[:, -1], flat.pow(2).sum(-1))):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4, name
