"""The reference math against independent float64 implementations (explicit loops, numpy), gradcheck, and
the properties the course relies on: n = 1 is the residual, Sinkhorn outputs are doubly stochastic."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mhc_lab.reference import (
    HyperConnection,
    InputError,
    ManifoldHyperConnection,
    amax_gain,
    collapse_lanes,
    composite_gain,
    composite_product,
    expand_lanes,
    hc_apply,
    hc_dynamic_coefficients,
    hc_static_init,
    mhc_coefficients,
    mhc_pre,
    mhc_post,
    residual_step,
    sinkhorn,
)

LANES = [1, 2, 4, 8]
WIDTHS = [1, 7, 33]


def rng(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=rng(seed), dtype=torch.float64) * scale


# ---- residual and lanes -----------------------------------------------------------------------------------


def test_residual_step_is_identity_plus_layer():
    x = randn(3, 5, seed=0)
    w = randn(5, 5, seed=1)
    out = residual_step(x, lambda h: torch.tanh(h @ w))
    assert torch.allclose(out, x + torch.tanh(x @ w), rtol=0, atol=0)


def test_residual_step_rejects_a_layer_that_changes_shape():
    with pytest.raises(InputError, match=r"expected an output of the input's shape \(3, 5\), got \(3, 4\)"):
        residual_step(randn(3, 5, seed=0), lambda h: h[:, :4])


@pytest.mark.parametrize("n", LANES)
def test_expand_then_collapse_is_n_times(n):
    h = randn(2, 3, 7, seed=n)
    x = expand_lanes(h, n)
    assert x.shape == (2, 3, n, 7)
    for j in range(n):
        assert torch.equal(x[..., j, :], h)
    assert torch.allclose(collapse_lanes(x), n * h)


# ---- Hyper-Connections ------------------------------------------------------------------------------------


def hc_loops(x, layer, alpha_m, alpha_r, beta):
    """HC Eqs. 2-5 with explicit loops over lanes, one token at a time."""
    *batch, n, C = x.shape
    xf = x.reshape(-1, n, C)
    am = alpha_m.expand(*batch, n).reshape(-1, n)
    ar = alpha_r.expand(*batch, n, n).reshape(-1, n, n)
    be = beta.expand(*batch, n).reshape(-1, n)
    out = torch.empty_like(xf)
    for t in range(xf.shape[0]):
        h0 = sum(am[t, i] * xf[t, i] for i in range(n))
        y = layer(h0)
        for j in range(n):
            out[t, j] = be[t, j] * y + sum(ar[t, i, j] * xf[t, i] for i in range(n))
    return out.reshape(x.shape)


@pytest.mark.parametrize("n", LANES)
@pytest.mark.parametrize("C", WIDTHS)
def test_hc_apply_matches_loops(n, C):
    x = randn(2, 3, n, C, seed=10 * n + C)
    w = randn(C, C, seed=1)
    layer = lambda h: torch.tanh(h @ w)  # noqa: E731
    coeffs = (randn(2, 3, n, seed=2), randn(2, 3, n, n, seed=3), randn(2, 3, n, seed=4))
    assert torch.allclose(hc_apply(x, layer, *coeffs), hc_loops(x, layer, *coeffs), atol=1e-12)
    static = (randn(n, seed=5), randn(n, n, seed=6), randn(n, seed=7))  # broadcast over the batch
    assert torch.allclose(hc_apply(x, layer, *static), hc_loops(x, layer, *static), atol=1e-12)


@pytest.mark.parametrize("n", LANES)
def test_hc_static_init_is_eq_14(n):
    for k in range(2 * n + 1):
        alpha_m, alpha_r, beta = hc_static_init(n, k)
        assert torch.equal(alpha_m, F.one_hot(torch.tensor(k % n), n).float())
        assert torch.equal(alpha_r, torch.eye(n)) and torch.equal(beta, torch.ones(n))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("n", LANES)
def test_fresh_hc_is_a_pre_norm_residual_on_lane_k(n, dynamic):
    C, k = 6, 5
    hc = HyperConnection(n, C, layer_index=k, dynamic=dynamic).double()
    x = randn(4, n, C, seed=n)
    w = randn(C, C, seed=9)
    layer = lambda h: F.rms_norm(h, (C,)) @ w  # noqa: E731  a pre-norm layer
    out = hc(x, layer)
    expected = x + layer(x[:, k % n]).unsqueeze(1)  # every lane j: x_j + F(x_{k mod n})
    assert torch.allclose(out, expected, atol=1e-12)


def test_hc_with_one_lane_equals_residual_step():
    C = 5
    hc = HyperConnection(1, C, dynamic=True).double()
    h = randn(3, C, seed=0)
    w = randn(C, C, seed=1)
    layer = lambda v: torch.tanh(v @ w)  # noqa: E731
    out = hc(expand_lanes(h, 1), layer)
    assert torch.allclose(collapse_lanes(out), residual_step(h, layer), atol=1e-12)


@pytest.mark.parametrize("n", LANES)
def test_hc_dynamic_coefficients_match_the_formula(n):
    C = 7
    x = randn(3, n, C, seed=n)
    static = (randn(n, seed=1), randn(n, n, seed=2), randn(n, seed=3))
    w_m, w_r, w_beta = randn(C, seed=4), randn(C, n, seed=5), randn(C, seed=6)
    am, ar, be = hc_dynamic_coefficients(x, static, w_m, w_r, w_beta, 0.3, 0.7)
    for t in range(3):
        for i in range(n):
            row = x[t, i]
            bar = (row - row.mean()) / torch.sqrt(row.var(unbiased=False) + 1e-5)
            assert math.isclose(am[t, i], 0.3 * math.tanh(bar @ w_m) + static[0][i], abs_tol=1e-12)
            assert math.isclose(be[t, i], 0.7 * math.tanh(bar @ w_beta) + static[2][i], abs_tol=1e-12)
            for j in range(n):
                assert math.isclose(ar[t, i, j], 0.3 * math.tanh(bar @ w_r[:, j]) + static[1][i, j], abs_tol=1e-12)


def test_hc_gradients_by_gradcheck():
    n, C = 3, 4
    x = randn(2, n, C, seed=0).requires_grad_()
    w = randn(C, C, seed=1)
    static = tuple(t.requires_grad_() for t in (randn(n, seed=2), randn(n, n, seed=3), randn(n, seed=4)))
    w_m, w_r, w_beta = (t.requires_grad_() for t in (randn(C, seed=5), randn(C, n, seed=6), randn(C, seed=7)))

    def f(x, am0, ar0, b0, w_m, w_r, w_beta):
        coeffs = hc_dynamic_coefficients(x, (am0, ar0, b0), w_m, w_r, w_beta, 0.5, 0.5)
        return hc_apply(x, lambda h: torch.tanh(h @ w), *coeffs)

    assert torch.autograd.gradcheck(f, (x, *static, w_m, w_r, w_beta))


# ---- Sinkhorn ---------------------------------------------------------------------------------------------


def sinkhorn_numpy(logits, variant, iterations, eps=1e-6):
    """Independent numpy float64 version of each variant, one matrix at a time."""
    out = []
    for m in logits.reshape(-1, *logits.shape[-2:]):
        m = np.asarray(m, dtype=np.float64)
        if variant == "paper" or variant == "log_domain":
            a = np.exp(m - m.max())
            for _ in range(iterations):
                a = a / a.sum(axis=0, keepdims=True)
                a = a / a.sum(axis=1, keepdims=True)
            out.append(a)
        else:
            a = np.exp(m - m.max(axis=1, keepdims=True))
            a = a / a.sum(axis=1, keepdims=True) + eps
            a = a / (a.sum(axis=0, keepdims=True) + eps)
            for _ in range(iterations - 1):
                a = a / (a.sum(axis=1, keepdims=True) + eps)
                a = a / (a.sum(axis=0, keepdims=True) + eps)
            out.append(a.T)
    return np.stack(out).reshape(logits.shape)


@pytest.mark.parametrize("variant", ["paper", "deepseek_v4", "log_domain"])
@pytest.mark.parametrize("n", LANES)
@pytest.mark.parametrize("iterations", [1, 3, 20])
def test_sinkhorn_matches_numpy(variant, n, iterations):
    logits = randn(5, n, n, seed=n + iterations, scale=2.0)
    got = sinkhorn(logits, variant, iterations)
    expected = sinkhorn_numpy(logits.numpy(), variant, iterations)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("variant", ["paper", "deepseek_v4", "log_domain"])
@pytest.mark.parametrize("n", LANES)
def test_sinkhorn_is_doubly_stochastic_for_moderate_logits(variant, n):
    h = sinkhorn(randn(2000, n, n, seed=n).float(), variant, 20)
    assert (h >= 0).all()
    row_error = (h.sum(-1) - 1).abs().max().item()  # rows of H_res are exact: the last normalisation
    column_error = (h.sum(-2) - 1).abs().max().item()
    assert row_error < 1e-5, row_error
    assert column_error < 5e-3, column_error  # 20 iterations on N(0, 1) logits (paper-notes: ~1.7e-3 worst)


@pytest.mark.parametrize("scale", [30.0, 1e3, 1e6])
def test_extreme_logits_stay_finite_and_exact_on_rows(scale):
    logits = randn(500, 4, 4, seed=1, scale=scale).float()
    for variant in ("deepseek_v4", "log_domain"):
        h = sinkhorn(logits, variant, 20)
        assert torch.isfinite(h).all() and (h >= 0).all(), variant
        assert (h.sum(-1) - 1).abs().max() < 1e-5, variant
    with pytest.raises(InputError, match="underflowed.*Use variant='log_domain'"):
        sinkhorn(logits, "paper", 20)


@pytest.mark.parametrize("scale", [10.0, 100.0, 1000.0])
def test_log_domain_converges_to_doubly_stochastic_for_extreme_logits(scale):
    logits = randn(200, 4, 4, seed=2, scale=scale)
    h = sinkhorn(logits, "log_domain", 5000)
    assert (h.sum(-1) - 1).abs().max() < 1e-9
    assert (h.sum(-2) - 1).abs().max() < 1e-2


def test_near_identity_bias_gives_known_values():
    logits = torch.full((4, 4), -8.0, dtype=torch.float64)
    logits.fill_diagonal_(0.0)
    h = sinkhorn(logits, "paper", 20)
    assert abs(h[0, 0].item() - 0.99899) < 1e-5 and abs(h[0, 1].item() - 3.35e-4) < 1e-6
    assert torch.allclose(sinkhorn(torch.zeros(4, 4), "paper"), torch.full((4, 4), 0.25))


@pytest.mark.parametrize(
    "logits, message",
    [
        (torch.zeros(3, 4), r"expected square matrices of shape \[..., n, n\], got shape \(3, 4\)"),
        (torch.zeros(4, 4, dtype=torch.long), "expected a floating-point tensor"),
        (torch.tensor([[0.0, float("nan")], [0.0, 0.0]]), "expected no NaN"),
    ],
)
def test_sinkhorn_bad_input(logits, message):
    with pytest.raises(InputError, match=message):
        sinkhorn(logits)


def test_sinkhorn_bad_variant_and_iterations():
    with pytest.raises(InputError, match="expected one of"):
        sinkhorn(torch.zeros(2, 2), "bogus")
    with pytest.raises(InputError, match="iterations: expected a positive int, got 0"):
        sinkhorn(torch.zeros(2, 2), "paper", 0)


# ---- mHC ----------------------------------------------------------------------------------------------------


def mhc_coefficients_loops(x, phi, bias, alpha, variant, iterations=20, eps=1e-6, rms_eps=1e-6):
    """Eqs. 14-19 token by token: matmul first, then the norm as a per-token scalar (the reordered form)."""
    *batch, n, C = x.shape
    xf = x.reshape(-1, n * C)
    pre, post, res = [], [], []
    for row in xf:
        mixes = phi @ row  # Eq. 14, before the norm
        r = torch.sqrt((row**2).mean() + rms_eps)  # Eq. 15 (with the RMSNorm eps)
        logits = torch.stack([alpha[0]] * n + [alpha[1]] * n + [alpha[2]] * n * n) * mixes / r + bias  # Eq. 16
        p = torch.sigmoid(logits[:n]) + (eps if variant == "deepseek_v4" else 0.0)
        q = 2 * torch.sigmoid(logits[n : 2 * n])
        h = sinkhorn_numpy(logits[2 * n :].reshape(1, n, n).numpy(), variant, iterations, eps)[0]
        pre.append(p), post.append(q), res.append(torch.from_numpy(h))
    return (torch.stack(pre).reshape(*batch, n), torch.stack(post).reshape(*batch, n),
            torch.stack(res).reshape(*batch, n, n))


@pytest.mark.parametrize("variant", ["deepseek_v4", "paper", "log_domain"])
@pytest.mark.parametrize("n", LANES)
def test_mhc_coefficients_match_loops(variant, n):
    C = 5
    x = randn(2, 3, n, C, seed=n)
    k = n * n + 2 * n
    phi, bias, alpha = randn(k, n * C, seed=1, scale=0.5), randn(k, seed=2), randn(3, seed=3)
    got = mhc_coefficients(x, phi, bias, alpha, variant=variant)
    expected = mhc_coefficients_loops(x, phi, bias, alpha, variant)
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("n", LANES)
@pytest.mark.parametrize("C", WIDTHS)
def test_mhc_pre_and_post_match_loops(n, C):
    x = randn(3, n, C, seed=n * C)
    pre, post, res = randn(3, n, seed=1), randn(3, n, seed=2), randn(3, n, n, seed=3)
    f = randn(3, C, seed=4)
    y = mhc_pre(x, pre)
    out = mhc_post(x, f, post, res)
    for t in range(3):
        assert torch.allclose(y[t], sum(pre[t, j] * x[t, j] for j in range(n)), atol=1e-12)
        for i in range(n):
            lane = sum(res[t, i, j] * x[t, j] for j in range(n)) + post[t, i] * f[t]
            assert torch.allclose(out[t, i], lane, atol=1e-12)


def test_mhc_with_one_lane_and_unit_coefficients_is_the_residual():
    h = randn(4, 6, seed=0)
    w = randn(6, 6, seed=1)
    layer = lambda v: torch.tanh(v @ w)  # noqa: E731
    x = expand_lanes(h, 1)
    ones = torch.ones(4, 1, dtype=torch.float64)
    out = mhc_post(x, layer(mhc_pre(x, ones)), ones, ones.unsqueeze(-1))
    assert torch.allclose(collapse_lanes(out), residual_step(h, layer), atol=1e-14)
    # and the paper's Sinkhorn of a 1 x 1 matrix is exactly 1
    assert torch.equal(sinkhorn(randn(4, 1, 1, seed=2), "paper"), torch.ones(4, 1, 1, dtype=torch.float64))


@pytest.mark.parametrize("variant", ["deepseek_v4", "paper", "log_domain"])
def test_mhc_gradients_by_gradcheck(variant):
    n, C = 2, 3
    k = n * n + 2 * n
    x = randn(2, n, C, seed=0).requires_grad_()
    phi, bias, alpha = (t.requires_grad_() for t in (randn(k, n * C, seed=1), randn(k, seed=2), randn(3, seed=3)))
    f = randn(2, C, seed=4)

    def site(x, phi, bias, alpha):
        c = mhc_coefficients(x, phi, bias, alpha, variant=variant, iterations=5)
        return mhc_post(x, torch.tanh(mhc_pre(x, c.pre)) + f, c.post, c.res)

    assert torch.autograd.gradcheck(site, (x, phi, bias, alpha))


@pytest.mark.parametrize("n", LANES)
def test_fresh_mhc_site_is_near_identity(n):
    site = ManifoldHyperConnection(n, 8)
    c = site.coefficients(torch.randn(5, n, 8, generator=rng(0)))
    assert torch.allclose(c.post, torch.ones(5, n))
    assert torch.allclose(c.pre, torch.full((5, n), 0.5 + 1e-6))
    # off-diagonal logits -8: each off-diagonal entry is about e^-8, the diagonal 1 - (n - 1) e^-8
    assert (c.res - torch.eye(n)).abs().max() < 1.2 * (n - 1) * math.exp(-8) + 1e-6


def test_mhc_coefficients_bad_input_says_what_was_expected():
    x = torch.randn(3, 4, 8)
    with pytest.raises(InputError, match=r"phi: expected shape \(24, 32\), got shape \(24, 8\)"):
        mhc_coefficients(x, torch.zeros(24, 8), torch.zeros(24), torch.zeros(3))
    with pytest.raises(InputError, match=r"expected a residual stream of shape \[..., n, C\]"):
        mhc_coefficients(torch.randn(8), torch.zeros(24, 32), torch.zeros(24), torch.zeros(3))
    with pytest.raises(InputError, match="expected a floating-point tensor"):
        mhc_pre(torch.ones(3, 4, 8, dtype=torch.long), torch.ones(3, 4))
    with pytest.raises(InputError, match=r"res: expected shape \[\.\.\., 4, 4\], got shape \(3, 4, 3\)"):
        mhc_post(x, torch.randn(3, 8), torch.randn(3, 4), torch.randn(3, 4, 3))
    with pytest.raises(InputError, match="expected n = 2 lanes"):
        ManifoldHyperConnection(2, 8).coefficients(x)


def test_transposed_lanes_are_named_not_phi():
    """Lanes passed as [..., C, n]: phi's rows (n^2+2n) fit x's last dim, so the error names x, not phi."""
    x = torch.randn(3, 4, 8)
    phi, bias, alpha = torch.zeros(24, 32), torch.zeros(24), torch.zeros(3)
    message = (r"^x: expected lanes \[\.\.\., n, C\] with n = 4 \(phi has n\^2\+2n = 24 rows\); got \[\.\.\., C, n\]\? "
               r"x has shape \(3, 8, 4\)")
    with pytest.raises(InputError, match=message):
        mhc_coefficients(x.transpose(-2, -1), phi, bias, alpha)
    with pytest.raises(InputError, match=r"x\.transpose\(-2, -1\)"):
        mhc_coefficients(x.transpose(-2, -1).contiguous(), phi, bias, alpha)
    # phi that fits neither layout is still phi's error; lanes that fit are untouched; n == C cannot be told apart
    with pytest.raises(InputError, match=r"^phi: expected shape \(24, 32\), got shape \(24, 8\)"):
        mhc_coefficients(x, torch.zeros(24, 8), bias, alpha)
    with pytest.raises(InputError, match=r"^phi: expected shape \(80, 32\)"):
        mhc_coefficients(x.transpose(-2, -1), torch.zeros(24, 16), bias, alpha)
    assert mhc_coefficients(x, phi, bias, alpha).res.shape == (3, 4, 4)
    square = torch.randn(2, 3, 3)
    assert mhc_coefficients(square.transpose(-2, -1), torch.zeros(15, 9), torch.zeros(15), alpha).pre.shape == (2, 3)
    # a site module knows its n: lanes whose last dim is n look swapped
    with pytest.raises(InputError, match=r"expected n = 4 lanes in dim -2 .*got shape \(3, 8, 4\).*lanes \[\.\.\., C, n\]\?"):
        ManifoldHyperConnection(4, 8).coefficients(x.transpose(-2, -1))


# ---- Amax gain ----------------------------------------------------------------------------------------------


def test_amax_gain_rows_forward_columns_backward():
    h = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    gain = amax_gain(h)
    assert gain.forward.item() == 3.0 and gain.backward.item() == 2.25


def test_composite_product_applies_layers_in_order():
    layers = [randn(3, 3, seed=k) for k in range(4)]
    products = composite_product(layers)
    assert torch.allclose(products[-1], layers[3] @ layers[2] @ layers[1] @ layers[0])
    assert torch.allclose(products[0], layers[0])


def test_composite_gain_of_doubly_stochastic_layers_is_one():
    perms = [torch.eye(4)[torch.randperm(4, generator=rng(k))] for k in range(6)]
    mixes = [0.3 * perms[k] + 0.7 * perms[(k + 1) % 6] for k in range(6)]
    gain = composite_gain(mixes * 5)
    assert torch.allclose(gain.forward, torch.ones(30)) and torch.allclose(gain.backward, torch.ones(30))


def test_composite_gain_of_unconstrained_layers_grows():
    layers = [torch.eye(4, dtype=torch.float64) + randn(4, 4, seed=k, scale=0.2) for k in range(64)]
    gain = composite_gain(layers)
    assert gain.forward[-1] > 4 * gain.forward[0]
