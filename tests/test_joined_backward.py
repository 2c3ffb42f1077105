"""The joined backward (kernel 2 of a site's pre backward with the previous site's post backward), C target:
against float64 formulas and against the two kernels it joins, on random inputs of awkward shapes."""

import pytest
import torch

from mhc_lab.kernels import nvcc_path


def _truth(o: dict, n: int, C: int) -> dict:
    """float64: site i's dx from kernel 1's outputs (projection, H_pre dy, the norm's 2 ds x, the post's dx),
    then the post backward of the site before with that dx as its upstream gradient."""
    tokens = o["x"].shape[0]
    proj = (o["dmix"] @ o["phi"]).view(tokens, n, C)
    g = proj + o["pre"][:, :, None] * o["dy"][:, None, :] + 2 * o["extra"][:, 3, None, None] * o["x"] + o["dx_post"]
    return {"dx_prev": torch.einsum("tij,tic->tjc", o["res_prev"], g),
            "df_prev": torch.einsum("ti,tic->tc", o["post_prev"], g),
            "dres": torch.einsum("tic,tjc->tij", g, o["x_prev"]),
            "dpost": torch.einsum("tic,tc->ti", g, o["f_prev"]),
            "dphi": o["dmix"].t() @ o["x"].reshape(tokens, n * C)}


@pytest.mark.parametrize("n,C,tokens", [(1, 5, 3), (2, 13, 7), (4, 24, 5), (4, 9, 1), (8, 3, 4)])
def test_joined_backward_matches_float64_and_the_two_kernels_it_joins(n, C, tokens):
    from mhc_lab.course.training_lab import joined_operands, joined_outputs

    o = joined_operands(n, C, tokens, seed=n * 100 + C)
    want, joined, apart = _truth(o, n, C), joined_outputs(o, True), joined_outputs(o, False)
    assert set(want) == set(joined) == set(apart)
    for name, w in want.items():
        scale = w.abs().max().item() or 1.0
        assert (joined[name].double() - w).abs().max().item() / scale < 2e-6, name
        assert (joined[name] - apart[name]).abs().max().item() / scale < 2e-6, name


def test_joined_backward_refuses_bad_input():
    from mhc_lab.kernels.joined_backward import joined_backward_program

    with pytest.raises(ValueError, match=r"the C target takes no tuning, got \['block_c'\]"):
        joined_backward_program(4, 64, block_c=32)
    with pytest.raises(ValueError, match=r"expected dtype in \('float32',\), got 'bfloat16'"):
        joined_backward_program(4, 64, "bfloat16", "c")
    with pytest.raises(ValueError, match=r"n = 9"):
        joined_backward_program(9, 64)


CUDA = torch.cuda.is_available()


def test_joined_kernel_for_sm90_meets_at_named_barriers_and_stores_in_rows():
    """The CUDA that TileLang generates for the joined kernel (no GPU or nvcc needed): the four lanes' dx GEMMs of
    kernel 2 (three products each), no TMA store of site i's dx (it never leaves the chip), two named barriers of
    the two consumer warpgroups per tile (before and after the joined epilogue), site p's dx_post tiles (one per
    lane) and df (one) stored as 16-byte vectors, and every one of the n^2 + n row sums written to coef_partial."""
    import re

    from mhc_lab.kernels.joined_backward import joined_backward_program
    from mhc_lab.kernels.source import generated_source, kernel_text

    n = 4
    src = kernel_text(generated_source(joined_backward_program(n, 4096, "bfloat16", "sm_90", splits=2), "sm_90"))
    assert "__launch_bounds__(384" in src and src.count("wgmma_ss<") == 3 * n
    assert "tma_store(dx_desc" not in src and "dx_prev_desc" not in src
    assert src.count("__sync_thread_partial(8, 256)") == 2
    stores = {name: len(re.findall(rf"\*\(uint4\*\)\({name} \+", src)) for name in ("dx_prev", "df_prev")}
    assert stores == {"dx_prev": n, "df_prev": 1}
    offsets = {int(k) for k in re.findall(r"\(int64_t\)20\)\) - \(int64_t\)(\d+)\)\] = ", src)}
    assert len(offsets) == n * n + n  # one store per (i, j) of dH_res and per i of dH_post


def test_joined_kernel_refuses_what_it_cannot_join():
    from mhc_lab.kernels.pre_backward import pre_backward_lanes_program

    with pytest.raises(ValueError, match=r"joined needs add_dx, stage_dx and two consumer warpgroups of all n lanes "
                                         r"\(n = 4\); got add_dx = False"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", joined=True)
    with pytest.raises(ValueError, match=r"consumer_groups = 1, lane_group = 4, n = 4"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=True, joined=True, consumer_groups=1)
    with pytest.raises(ValueError, match=r"lane_group = 2, n = 2"):
        pre_backward_lanes_program(2, 4096, "bfloat16", "sm_90", add_dx=True, joined=True)
    with pytest.raises(ValueError, match=r"joined_leave_out takes parts of the joined kernel's epilogue"):
        pre_backward_lanes_program(4, 4096, "bfloat16", "sm_90", add_dx=True, joined_leave_out=("row_sums",))


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU: the CUDA joined kernel runs only there")
@pytest.mark.parametrize("C,tokens", [(4096, 300), (136, 1), (200, 65)])
def test_cuda_joined_kernel_gives_what_the_two_kernels_give_apart(C, tokens):
    """On random operands (kernel 1's real outputs for site i, random lanes, f and coefficients for site p): the
    joined kernel against kernel 2 with dx_post followed by the post backward. Site i's dx is rounded to bf16 on
    both paths, so dx_prev and df_prev agree to bf16 rounding; the row sums differ in their order of addition."""
    from mhc_lab.course.bench_training import sweep_pre_backward

    row = sweep_pre_backward(tokens, C, lambda fn: 1.0, [{"joined": True}], log=lambda *a: None)["lanes"][0]
    assert "error" not in row, row.get("error")
    assert row["rel_dx_prev"] < 1e-2 and row["rel_df_prev"] < 1e-2, row
    assert row["rel_dres"] < 1e-4 and row["rel_dpost"] < 1e-4 and row["rel_dphi"] < 1e-6, row


def test_joined_sites_run_under_torch_compile():
    """boundary_forward and joined_backward are custom ops with fake implementations: torch.compile around a
    joined chain gives the eager chain's output and gradient (C target, float32)."""
    from mhc_lab.ops import training

    torch.manual_seed(0)
    n, C = 4, 8
    layers = [torch.nn.Sequential(torch.nn.Linear(C, C), torch.nn.Tanh()) for _ in range(3)]
    connections = [training.MHCConnection(n, C, backend="kernels") for _ in layers]
    x = torch.randn(2, 3, n, C, generator=torch.Generator().manual_seed(4))
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))

    def run(h):
        return training.run_sites(h, connections, layers)

    results = []
    with training.join_sites_backward(True):
        for fn in (run, torch.compile(run)):
            leaf = x.clone().requires_grad_()
            out = fn(leaf)
            results.append((out.detach(), torch.autograd.grad(out, leaf, upstream)[0]))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found: the sm_90 build check needs it")
def test_joined_kernel_builds_for_sm90_within_a_ctas_shared_memory():
    """nvcc builds the joined kernel for sm_90; the shared memory its launch asks for fits one CTA (two stages,
    a copy of the lanes' dx buffer per stage), and lanes_shared_bytes bounds it from above."""
    import re

    from mhc_lab.kernels._target import compile_program, shared_per_cta
    from mhc_lab.kernels.joined_backward import joined_backward_program
    from mhc_lab.kernels.pre_backward import lane_stages, lanes_shared_bytes

    kernel = compile_program(joined_backward_program(4, 4096, "bfloat16", "sm_90", splits=2), "sm_90")
    # the launch's integer arguments: grid and block sizes, and the dynamic shared memory (the only one > 64 KB)
    launch = [int(v) for v in re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\)", kernel.get_host_source())]
    asked = [v for v in launch if v > 65536]
    stages = lane_stages(4, 4, 64, 32, True, joined=True)
    assert stages == 2 and asked
    assert max(asked) <= lanes_shared_bytes(4, 4, 64, 32, stages, True, joined=True) <= shared_per_cta(1)
