"""The joined backward (kernel 2 of a site's pre backward with the previous site's post backward), C target:
against float64 formulas and against the two kernels it joins, on random inputs of awkward shapes."""

import pytest
import torch

from mhc_lab.kernels._coefficients import mixes_width


def _operands(n: int, C: int, tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    m = mixes_width(n)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {"x": rand(tokens, n, C), "dy": rand(tokens, C), "pre": rand(tokens, n), "dmix": rand(tokens, m),
            "extra": rand(tokens, 4), "phi": rand(m, n * C) / (n * C) ** 0.5, "dx_post": rand(tokens, n, C),
            "x_prev": rand(tokens, n, C), "f_prev": rand(tokens, C), "post_prev": rand(tokens, n),
            "res_prev": torch.softmax(rand(tokens, n, n), -1)}


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


def _joined(o: dict, n: int, C: int) -> dict:
    from mhc_lab.kernels.joined_backward import coef_blocks, coefficients_from_partial, joined_backward_kernel

    f32 = {k: v.float().contiguous() for k, v in o.items()}
    tokens, m = o["x"].shape[0], mixes_width(n)
    out = {"dx_prev": torch.empty(tokens, n, C), "df_prev": torch.empty(tokens, C),
           "dphi": torch.empty(1, m, n * C), "coef": torch.empty(tokens, coef_blocks(C), n * n + n)}
    joined_backward_kernel(n, C)(*(f32[k] for k in ("x", "dy", "pre", "dmix", "extra", "phi", "dx_post", "x_prev",
                                                   "f_prev", "post_prev", "res_prev")), *out.values())
    dres, dpost = coefficients_from_partial(out["coef"], n)
    return {"dx_prev": out["dx_prev"], "df_prev": out["df_prev"], "dres": dres, "dpost": dpost,
            "dphi": out["dphi"][0]}


def _apart(o: dict, n: int, C: int) -> dict:
    """The two C-target kernels the joined one replaces: kernel 2 writes dx, the post backward reads it."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.post_backward import post_backward_kernel
    from mhc_lab.kernels.pre_backward import pre_backward_lanes_program

    f32 = {k: v.float().contiguous() for k, v in o.items()}
    tokens, m = o["x"].shape[0], mixes_width(n)
    dx, dphi = torch.empty(tokens, n, C), torch.empty(1, m, n * C)
    lanes = compile_program(pre_backward_lanes_program(n, C, "float32", "c", add_dx=True), "c")
    lanes(*(f32[k] for k in ("x", "dy", "pre", "dmix", "extra", "phi", "dx_post")), dx, dphi)
    dx_prev, df_prev = torch.empty(tokens, n, C), torch.empty(tokens, C)
    dpost, dres = torch.empty(tokens, n), torch.empty(tokens, n, n)
    post_backward_kernel(n, C, "float32", "c")(f32["x_prev"], f32["f_prev"], dx, f32["post_prev"], f32["res_prev"],
                                               dx_prev, df_prev, dpost, dres)
    return {"dx_prev": dx_prev, "df_prev": df_prev, "dres": dres, "dpost": dpost, "dphi": dphi[0]}


@pytest.mark.parametrize("n,C,tokens", [(1, 5, 3), (2, 13, 7), (4, 24, 5), (4, 9, 1), (8, 3, 4)])
def test_joined_backward_matches_float64_and_the_two_kernels_it_joins(n, C, tokens):
    o = _operands(n, C, tokens, seed=n * 100 + C)
    want, joined, apart = _truth(o, n, C), _joined(o, n, C), _apart(o, n, C)
    for name, w in want.items():
        scale = w.abs().max().item() or 1.0
        assert (joined[name].double() - w).abs().max().item() / scale < 2e-6, name
        assert (joined[name] - apart[name]).abs().max().item() / scale < 2e-6, name


def test_joined_backward_refuses_what_is_not_built():
    from mhc_lab.kernels.joined_backward import joined_backward_program

    with pytest.raises(ValueError, match=r"only the C target is built, got target 'sm_90'"):
        joined_backward_program(4, 64, "bfloat16", "sm_90")
    with pytest.raises(ValueError, match=r"expected dtype in \('float32',\), got 'bfloat16'"):
        joined_backward_program(4, 64, "bfloat16", "c")
    with pytest.raises(ValueError, match=r"n = 9"):
        joined_backward_program(9, 64)
