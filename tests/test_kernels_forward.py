"""Fused forward kernels (post, pre) against the float64 reference.

CPU: TileLang's C target, float32 lanes, every element checked on NaN-poisoned outputs, fresh random inputs
per case (never zeros), awkward sizes (T = 1, 7, 33; C = 40, 72, 200, none a multiple of the CUDA tiles).
CUDA: the same checks at bf16 tolerance when a GPU is present (skipped otherwise); the sm_90 build of every
CUDA kernel is checked on any machine with nvcc (skipped, saying so, without it).
"""

import math
import re

import pytest
import torch

from mhc_lab.kernels import nvcc_path
from mhc_lab.ops import PreOutputs, mhc_post_fused, mhc_pre_fused
from mhc_lab.reference import InputError, mhc_coefficients, mhc_post, mhc_pre

# Tolerances per (backend, quantity): max |got - want| <= atol + rtol |want|, every element.
# float32 on the CPU: the kernels accumulate in float32 in a different order than the float64 reference and
# divide by multiplying with a reciprocal; ~1e-7 relative is typical, 1e-5 leaves room for long dot products.
# bf16 on CUDA: outputs are rounded to bf16 (2^-8 relative), the projection uses phi split into two bf16 parts.
TOLERANCES = {
    ("cpu", "lanes"): (1e-5, 1e-5),  # (rtol, atol): layer input, next lanes
    ("cpu", "coefficients"): (1e-5, 1e-6),  # pre, post, res
    ("cuda", "lanes"): (8e-3, 8e-3),
    ("cuda", "coefficients"): (1e-3, 1e-4),
}

CPU_CASES = [(4, 40), (4, 72), (4, 200), (1, 72), (2, 40), (8, 40)]
TOKENS = (1, 7, 33)


def _inputs(tokens, n, C, *, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    x = torch.randn(tokens, n, C, generator=g)
    phi = torch.randn(m, n * C, generator=g) / math.sqrt(n * C)
    bias = torch.randn(m, generator=g) * 0.5
    alpha = torch.rand(3, generator=g) + 0.5
    f = torch.randn(tokens, C, generator=g)
    return (x.to(device=device, dtype=dtype), phi.to(device), bias.to(device), alpha.to(device),
            f.to(device=device, dtype=dtype))


def _poisoned_pre(tokens, n, C, dtype, device):
    nan = float("nan")
    return PreOutputs(
        torch.full((tokens, C), nan, dtype=dtype, device=device),
        torch.full((tokens, n), nan, device=device),
        torch.full((tokens, n, n), nan, device=device),
        torch.full((tokens, n), nan, device=device),
    )


def _assert_close(name, got, want, backend, kind):
    rtol, atol = TOLERANCES[(backend, kind)]
    got64 = got.double().cpu()
    want64 = want.double().cpu()
    assert not torch.isnan(got64).any(), f"{name}: {int(torch.isnan(got64).sum())} elements never written (NaN)"
    err = (got64 - want64).abs()
    bound = atol + rtol * want64.abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{name}: {int((err > bound).sum())} of {err.numel()} elements outside rtol {rtol}, atol {atol}; "
        f"worst at flat index {worst}: got {got64.flatten()[worst]:.6g}, want {want64.flatten()[worst]:.6g}"
    )


def _reference(x, phi, bias, alpha, f):
    x64 = x.double().cpu()
    pre, post, res = mhc_coefficients(x64, phi.double().cpu(), bias.double().cpu(), alpha.double().cpu())
    y = mhc_pre(x64, pre)
    out = mhc_post(x64, f.double().cpu(), post, res)
    return y, pre, post, res, out


@pytest.mark.parametrize("n,C", CPU_CASES)
def test_cpu_pre_and_post_match_float64_reference(n, C):
    for seed, tokens in enumerate(TOKENS):
        x, phi, bias, alpha, f = _inputs(tokens, n, C, seed=seed + 10 * n + C)
        y_ref, pre_ref, post_ref, res_ref, _ = _reference(x, phi, bias, alpha, f)
        got = mhc_pre_fused(x, phi, bias, alpha, out=_poisoned_pre(tokens, n, C, torch.float32, "cpu"))
        _assert_close(f"layer_input n={n} C={C} T={tokens}", got.layer_input, y_ref, "cpu", "lanes")
        _assert_close(f"pre n={n} C={C} T={tokens}", got.pre, pre_ref, "cpu", "coefficients")
        _assert_close(f"post n={n} C={C} T={tokens}", got.post, post_ref, "cpu", "coefficients")
        _assert_close(f"res n={n} C={C} T={tokens}", got.res, res_ref, "cpu", "coefficients")
        # post on the kernel's own coefficients (float32), against float64 math on the same coefficients
        out = torch.full((tokens, n, C), float("nan"))
        mhc_post_fused(x, f, got.post, got.res, out=out)
        want = mhc_post(x.double(), f.double(), got.post.double(), got.res.double())
        _assert_close(f"post lanes n={n} C={C} T={tokens}", out, want, "cpu", "lanes")


def test_cpu_batched_leading_dims_and_bf16_lanes():
    x, phi, bias, alpha, f = _inputs(2 * 3, 4, 40, seed=7)
    xb = x.reshape(2, 3, 4, 40).bfloat16()
    got = mhc_pre_fused(xb, phi, bias, alpha)
    assert got.layer_input.shape == (2, 3, 40) and got.layer_input.dtype == torch.bfloat16
    assert got.res.shape == (2, 3, 4, 4) and got.post.dtype == torch.float32
    pre, post, res = mhc_coefficients(xb.double(), phi.double(), bias.double(), alpha.double())
    _assert_close("res (bf16 lanes)", got.res, res, "cpu", "coefficients")
    _assert_close("layer_input (bf16 lanes)", got.layer_input, mhc_pre(xb.double(), pre), "cuda", "lanes")
    out = mhc_post_fused(xb, f.reshape(2, 3, 40).bfloat16(), got.post, got.res)
    want = mhc_post(xb.double(), f.reshape(2, 3, 40).bfloat16().double(), got.post.double(), got.res.double())
    _assert_close("post lanes (bf16)", out, want, "cuda", "lanes")


def test_refusals_say_what_was_expected_and_given():
    x, phi, bias, alpha, f = _inputs(3, 9, 8, seed=1)
    with pytest.raises(InputError, match=r"n = 1\.\.8 lanes, got n = 9"):
        mhc_pre_fused(x, phi, bias, alpha)
    x17 = torch.randn(2, 17, 8)
    with pytest.raises(InputError, match=r"n = 1\.\.16 lanes, got n = 17"):
        mhc_post_fused(x17, torch.randn(2, 8), torch.rand(2, 17), torch.rand(2, 17, 17))
    x, phi, bias, alpha, f = _inputs(3, 4, 40, seed=2)
    with pytest.raises(InputError, match=r"phi: expected shape \(24, 160\), got shape \(24, 120\)"):
        mhc_pre_fused(x, phi[:, :120], bias, alpha)
    with pytest.raises(InputError, match=r"bias: expected dtype torch.float32, got .*float64"):
        mhc_pre_fused(x, phi, bias.double(), alpha)
    with pytest.raises(InputError, match=r"x: expected dtype in .* got .*float64"):
        mhc_pre_fused(x.double(), phi, bias, alpha)
    with pytest.raises(InputError, match=r"layer_output: expected shape \(3, 40\)"):
        mhc_post_fused(x, f[:, :20], torch.rand(3, 4), torch.rand(3, 4, 4))
    with pytest.raises(InputError, match=r"res: expected shape \(3, 4, 4\)"):
        mhc_post_fused(x, f, torch.rand(3, 4), torch.rand(3, 4, 3))
    with pytest.raises(InputError, match=r"out layer_input: expected shape \(3, 40\)"):
        mhc_pre_fused(x, phi, bias, alpha, out=_poisoned_pre(3, 4, 41, torch.float32, "cpu"))


# ---- CUDA: correctness on a GPU (skipped without one) -------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch")


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", [(4, 40, 7), (4, 200, 33), (4, 4096, 257), (4, 2560, 1), (2, 72, 33),
                                        (2, 72, 1), (8, 40, 7), (8, 40, 65), (1, 72, 7), (3, 72, 33), (6, 40, 7),
                                        (4, 1020, 33)])
def test_cuda_pre_and_post_match_float64_reference(n, C, tokens):
    """The pre (phi split, projection pass, coefficients spread over a warp where n is a power of two, one thread
    per token elsewhere, lane mix) and the post on NaN-poisoned outputs; C = 1020 is not a multiple of 8."""
    x, phi, bias, alpha, f = _inputs(tokens, n, C, dtype=torch.bfloat16, device="cuda", seed=tokens + C)
    y_ref, pre_ref, post_ref, res_ref, _ = _reference(x, phi, bias, alpha, f)
    got = mhc_pre_fused(x, phi, bias, alpha, out=_poisoned_pre(tokens, n, C, torch.bfloat16, "cuda"))
    torch.cuda.synchronize()
    _assert_close("layer_input", got.layer_input, y_ref, "cuda", "lanes")
    _assert_close("pre", got.pre, pre_ref, "cuda", "coefficients")
    _assert_close("post", got.post, post_ref, "cuda", "coefficients")
    _assert_close("res", got.res, res_ref, "cuda", "coefficients")
    out = torch.full((tokens, n, C), float("nan"), dtype=torch.bfloat16, device="cuda")
    mhc_post_fused(x, f, got.post, got.res, out=out)
    want = mhc_post(x.double().cpu(), f.double().cpu(), got.post.double().cpu(), got.res.double().cpu())
    _assert_close("post lanes", out, want, "cuda", "lanes")


@needs_cuda
@pytest.mark.parametrize("n,C,tokens", [(4, 4096, 257), (4, 200, 33), (2, 72, 7), (8, 40, 65), (3, 72, 7)])
def test_cuda_pre_projected_runs_the_apply_pass_on_given_partials(n, C, tokens):
    """run_pre_cuda with projected=True and one split (what a chained site's pre runs): the apply pass alone, on
    partial sums made here in float64 from the lanes as stored."""
    from mhc_lab.kernels.pre_cuda import run_pre_cuda

    x, phi, bias, alpha, f = _inputs(tokens, n, C, dtype=torch.bfloat16, device="cuda", seed=C + n)
    y_ref, pre_ref, post_ref, res_ref, _ = _reference(x, phi, bias, alpha, f)
    flat = x.double().cpu().reshape(tokens, n * C)
    partial = torch.cat([flat @ phi.double().cpu().t(), flat.pow(2).sum(-1, keepdim=True)], -1)[None].float().cuda()
    got = _poisoned_pre(tokens, n, C, torch.bfloat16, "cuda")
    run_pre_cuda(x, phi, bias, alpha, got.layer_input, got.pre, got.post, got.res, splits=1, partial=partial,
                 projected=True)
    torch.cuda.synchronize()
    _assert_close("layer_input", got.layer_input, y_ref, "cuda", "lanes")
    for name, a, b in (("pre", got.pre, pre_ref), ("post", got.post, post_ref), ("res", got.res, res_ref)):
        _assert_close(name, a, b, "cuda", "coefficients")


# ---- sm_90 build of the CUDA kernels, on any machine with nvcc ----------------------------------------------


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found on PATH or in /usr/local/cuda/bin: no CUDA build check")
def test_cuda_kernels_build_for_sm90():
    from mhc_lab.kernels.post import post_kernel
    from mhc_lab.kernels.pre_split import phi_split_kernel, project_kernel

    post = post_kernel(4, 4096, "bfloat16", "sm_90")
    assert "uint4" in post.get_kernel_source()  # 16-byte vector loads of the lanes
    assert phi_split_kernel(4, 4096, "sm_90") is not None
    project = project_kernel(4, 4096, "bfloat16", "sm_90").get_kernel_source()  # Hopper tensor cores, phi's
    assert "wgmma" in project and ", 64, 8, 16," not in project  # rows as the A operand: m64n128k16, not m64n8k16


# ---- post fused with the next site's projection (kernels/post_project.py) ----------------------------------


def _post_project_truth(x, f, post, res, phi, dtype):
    """float64: the next lanes, and the next pre's projections and squared norm of those lanes as stored."""
    out = mhc_post(x.double().cpu(), f.double().cpu(), post.double().cpu(), res.double().cpu())
    stored = out.to(dtype).double()
    flat = stored.reshape(out.shape[0], -1)
    return out, torch.cat([flat @ phi.double().cpu().t(), flat.pow(2).sum(-1, keepdim=True)], dim=-1)


@pytest.mark.parametrize("n,C,tokens", [(4, 37, 5), (1, 9, 3), (2, 24, 7), (8, 5, 2), (4, 8, 1)])
def test_cpu_post_project_matches_float64(n, C, tokens):
    from mhc_lab.kernels.post_project import post_project_kernel

    x, phi, _, _, f = _inputs(tokens, n, C, seed=C)
    g = torch.Generator().manual_seed(tokens)
    post, res = torch.rand(tokens, n, generator=g) * 2, torch.rand(tokens, n, n, generator=g)
    want_out, want_partial = _post_project_truth(x, f, post, res, phi, torch.float32)
    out = torch.full((tokens, n, C), float("nan"))
    partial = torch.full((1, tokens, n * n + 2 * n + 1), float("nan"))
    post_project_kernel(n, C, "float32", "c")(x, f, post, res, phi, out, partial)
    _assert_close("next lanes", out, want_out, "cpu", "lanes")
    scale = want_partial.abs().amax(-1, keepdim=True)  # relative to each token's largest projection
    _assert_close("partial", partial[0] / scale, want_partial / scale, "cpu", "coefficients")


def test_post_project_refuses_what_it_cannot_run():
    from mhc_lab.kernels.post_project import post_project_program

    with pytest.raises(ValueError, match="C must be a multiple of 8, got C = 100"):
        post_project_program(4, 100, "bfloat16", "sm_90")
    with pytest.raises(ValueError, match=r"expected 1 <= n <= 8 lanes, got n = 9"):
        post_project_program(9, 64, "float32", "c")
    with pytest.raises(ValueError, match="expected dtype in \\('bfloat16',\\), got 'float16'"):
        post_project_program(4, 64, "float16", "sm_90")


@pytest.mark.parametrize("n", range(1, 9))
def test_post_project_tiles_fit_in_shared_memory(n):
    from mhc_lab.kernels._target import SMEM_LIMIT
    from mhc_lab.kernels.post_project import cuda_tiles, shared_bytes

    tiles = cuda_tiles(n)
    assert shared_bytes(n, tiles["block_m"], tiles["block_k"], tiles["stages"]) <= SMEM_LIMIT


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found on PATH or in /usr/local/cuda/bin: no CUDA build check")
@pytest.mark.parametrize("n,C", [(4, 4096), (2, 200), (8, 40)])
def test_post_project_builds_for_sm90(n, C):
    from mhc_lab.kernels.post_project import post_project_kernel

    src = post_project_kernel(n, C, "bfloat16", "sm_90").get_kernel_source()
    assert "wgmma" in src  # the projection on the tensor cores, phi's rows as the 64-row A operand
    assert ", 64, 32, 16, false, false" in src and ", 64, 8, 16," not in src  # m64n32k16, not m64n8k16
    assert "tma_store" not in src  # the new lanes leave from the registers,
    if C % 64 == 0:
        assert "*(uint2*)(out + " in src  # 8 bytes at a time where no column block is cut short
    # the mix reads each lane's value once (bound to a name), not once for every output lane
    assert all(re.search(rf"float4? x{j} = ", src) for j in range(n))
    if C == 4096:  # the n lane tiles and f: one 8-byte shared load each per 4 elements
        assert len(re.findall(r"= \*\(uint2\*\)\(\(\(bfloat16_t\*\)", src)) == n + 1


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found on PATH or in /usr/local/cuda/bin: no CUDA build check")
@pytest.mark.parametrize("n,C", [(4, 4096), (2, 200)])
def test_post_project_waits_once_for_its_products(n, C):
    """The n lanes' products issued without a wait each, one wait per column block, and phi's stages released
    after it (their mbarrier arrives follow the wait in the generated code)."""
    from mhc_lab.kernels.post_project import post_project_kernel

    once = post_project_kernel(n, C, "bfloat16", "sm_90").get_kernel_source()
    assert once.count("wait_wgmma<0>") == 1 and once.count("wgmma_ss<") == n
    loop_tail = once[once.index("wait_wgmma<0>"):]
    assert loop_tail.index(".arrive()") < loop_tail.index("}")  # the releases right after the wait, in the loop


@needs_cuda
@pytest.mark.parametrize("n,C,tokens,splits", [
    (4, 4096, 257, 1), (4, 40, 7, 1), (4, 200, 33, 1), (2, 72, 1, 1), (8, 40, 65, 1), (1, 72, 7, 1), (3, 72, 7, 1),
    (4, 200, 33, 4), (4, 4096, 65, 2), (2, 72, 33, 4)])
def test_cuda_post_project_matches_float64(n, C, tokens, splits):
    from mhc_lab.kernels.post_project import post_project_kernel
    from mhc_lab.kernels.pre_split import phi_rows, phi_split_kernel

    x, phi, _, _, f = _inputs(tokens, n, C, dtype=torch.bfloat16, device="cuda", seed=C)
    g = torch.Generator().manual_seed(tokens)
    post, res = (torch.rand(tokens, n, generator=g) * 2).cuda(), torch.rand(tokens, n, n, generator=g).cuda()
    want_out, _ = _post_project_truth(x, f, post, res, phi, torch.bfloat16)
    phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device="cuda")
    phi_split_kernel(n, C, "cuda")(phi, phi_hl)
    out = torch.full_like(x, float("nan"))
    partial = torch.full((splits, tokens, n * n + 2 * n + 1), float("nan"), device="cuda")
    post_project_kernel(n, C, "bfloat16", "cuda", splits=splits)(x, f, post, res, phi_hl, out, partial)
    _assert_close("next lanes", out, want_out, "cuda", "lanes")
    got = partial.sum(0).double().cpu()
    # against the projection of the lanes as the kernel stored them (a bf16 rounding of the next lanes apart)
    _, of_stored = _post_project_truth(out.double(), torch.zeros_like(f), torch.zeros_like(post),
                                       torch.eye(n, device="cuda").expand(tokens, n, n), phi, torch.float64)
    scale = of_stored.abs().amax(-1, keepdim=True)
    _assert_close("partial", got / scale, of_stored / scale, "cuda", "coefficients")


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found on PATH or in /usr/local/cuda/bin: no CUDA build check")
@pytest.mark.parametrize("n,C", [(4, 4096), (2, 200), (8, 40), (1, 72), (3, 72), (6, 40), (4, 1020)])
def test_split_apply_kernels_build_for_sm90(n, C):
    from mhc_lab.kernels._coefficients import spread_fits, spread_layout
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.pre_split import coefficients_program, mix_program

    coefficients = compile_program(coefficients_program(n, C, "sm_90"), "sm_90").get_kernel_source()
    if spread_fits(n):
        assert "comb[" not in coefficients  # a token over n R threads, its line sums by warp shuffles:
        layout = spread_layout(n)  # log2 n shuffles per row held for the softmax's max and sum and each row step,
        row_bits, slot_bits = len(layout.row_bits), len(layout.slot_bits)  # log2 R per column step (t = 20)
        assert coefficients.count("__shfl_xor_sync") == (2 + 19) * layout.entries * row_bits + 20 * slot_bits
    else:
        assert "comb[" in coefficients and "__shfl" not in coefficients  # the Sinkhorn matrix in one thread
    mix = compile_program(mix_program(n, C, "bfloat16", "sm_90"), "sm_90").get_kernel_source()
    if C % 8 == 0:
        assert "uint4" in mix  # 16-byte loads of the lanes


@pytest.mark.parametrize("n,C,tokens", [(4, 37, 5), (1, 9, 3), (8, 5, 2), (2, 24, 7), (3, 10, 4)])
def test_cpu_split_apply_kernels_match_float64(n, C, tokens):
    """The apply pass as two programs on the C target: coefficients from split partial sums, then the lane mix."""
    from mhc_lab.kernels.pre_split import apply_kernel

    x, phi, bias, alpha, f = _inputs(tokens, n, C, seed=C + tokens)
    y_ref, pre_ref, post_ref, res_ref, _ = _reference(x, phi, bias, alpha, f)
    flat = x.double().reshape(tokens, n * C)
    projection = torch.cat([flat @ phi.double().t(), flat.pow(2).sum(-1, keepdim=True)], -1)
    partial = torch.stack([projection * 0.25, projection * 0.75]).float()  # two splits that sum to it
    got = _poisoned_pre(tokens, n, C, torch.float32, "cpu")
    apply_kernel(n, C, "float32", "c", splits=2)(x, partial, bias, alpha, got.layer_input, got.pre, got.post,
                                                 got.res)
    _assert_close("layer input", got.layer_input, y_ref, "cpu", "lanes")
    for name, a, b in (("pre", got.pre, pre_ref), ("post", got.post, post_ref), ("res", got.res, res_ref)):
        _assert_close(name, a, b, "cpu", "coefficients")


def test_bf16_pairs_convert_with_a_shift_and_a_mask_to_the_same_floats():
    """The identity behind mhc_bf16x2_to_float2: a bf16 value is the top half of its float32, so the low half of a
    pair is the float32 of (bits << 16) and the high half that of (bits & 0xffff0000). Checked for every bf16 bit
    pattern (infinities, NaNs, subnormals, both signs) against torch's conversion, bit for bit."""
    every = torch.arange(1 << 16, dtype=torch.int32)
    pairs = every | (every.flip(0) << 16)  # each pattern once as the low half and once as the high half
    low = (pairs << 16).view(torch.float32)
    high = (pairs & -65536).view(torch.float32)  # -65536 == 0xffff0000 as int32
    as_bf16 = every.to(torch.int16).view(torch.bfloat16).float()
    assert torch.equal(low.view(torch.int32), as_bf16.view(torch.int32))
    assert torch.equal(high.view(torch.int32), as_bf16.flip(0).view(torch.int32))


def test_generated_cuda_converts_bf16_pairs_with_our_helper_and_nothing_else_changes():
    from mhc_lab.kernels._target import BF16X2_TO_FLOAT2, two_instruction_bf16_pairs

    code = ('#include <tl_templates/cuda/common.h>\n\nextern "C" __global__ void k(bfloat16_t* x) {\n'
            "  float2 a = __bfloat1622float2((reinterpret_cast<__nv_bfloat162*>(&v))[0]);\n"
            "  float2 b = __bfloat1622float2((reinterpret_cast<__nv_bfloat162*>(&w))[0]);\n}\n")
    out = two_instruction_bf16_pairs(code)
    assert "__bfloat1622float2" not in out and out.count("mhc_bf16x2_to_float2((reinterpret_cast") == 2
    assert out.index(BF16X2_TO_FLOAT2.strip()) < out.index('extern "C" __global__') < out.index("= mhc_bf16x2")
    assert out.startswith("#include <tl_templates/cuda/common.h>\n\n")
    assert two_instruction_bf16_pairs(out) == out  # nothing left to change
    plain = code.replace("__bfloat1622float2", "f")
    assert two_instruction_bf16_pairs(plain) == plain


def test_code_generation_chains_and_restores_a_cuda_postproc_registered_before():
    import tvm_ffi

    from mhc_lab.kernels._target import code_generation

    name = "tilelang_callback_cuda_postproc"
    before = tvm_ffi.get_global_func(name, allow_missing=True)
    seen = []

    def theirs(code, target):
        seen.append(code)
        return code.replace("A(", "__bfloat1622float2(")

    tvm_ffi.register_global_func(name, f=theirs, override=True)
    try:
        with code_generation():  # theirs first, then ours (the helper's definition and its one call)
            assert tvm_ffi.get_global_func(name)("__global__ k() { A((x)); }", None).count("mhc_bf16x2_to_float2") == 2
        assert seen and tvm_ffi.get_global_func(name)("A(", None) == "__bfloat1622float2("  # theirs again
        tvm_ffi.remove_global_func(name)
        with code_generation():
            assert tvm_ffi.get_global_func(name, allow_missing=True) is not None
        assert tvm_ffi.get_global_func(name, allow_missing=True) is None  # none before, none after
    finally:
        if before is not None:
            tvm_ffi.register_global_func(name, f=before, override=True)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found on PATH or in /usr/local/cuda/bin: no CUDA build check")
def test_cuda_builds_convert_bf16_pairs_with_our_helper():
    """Every CUDA build (here kernel 2 of the pre backward and the post + projection for sm_90) converts its bf16
    pairs with mhc_bf16x2_to_float2, the source it was built from and the one generated_source shows alike."""
    from mhc_lab.kernels.post_project import post_project_kernel
    from mhc_lab.kernels.pre_backward_lanes import pre_backward_lanes_program
    from mhc_lab.kernels.source import generated_source

    for src in (post_project_kernel(4, 4096, "bfloat16", "sm_90").get_kernel_source(),
                generated_source(pre_backward_lanes_program(2, 40, "bfloat16", "sm_90", post_grad=True), "sm_90")):
        assert "__bfloat1622float2" not in src and src.count("= mhc_bf16x2_to_float2((") >= 2
