"""The peers benchmark (mhc_lab/bench/peers.py) hands each implementation our numbers in its own convention;
these tests check, on the CPU in float64, that the mapping makes each convention compute our site, and that its
gradients map back to ours. TileKernels' own torch references (tile_kernels/torch/mhc.py of the released wheel)
are composed and held to our reference; Liger-Kernel and TransformerEngine ship no torch reference, so their
conventions (phi's layout, the lanes' layout, which side H_res is applied from) are written out here from their
documentation."""

import importlib.util
import subprocess
import sys
import zipfile

import pytest
import torch

from mhc_lab.bench import peers
from mhc_lab.reference import mhc_coefficients, mhc_post, mhc_pre

SHAPES = [(5, 4, 24), (3, 2, 8), (7, 4, 40), (2, 8, 16)]  # tokens, n, C: awkward sizes, n = 2, 4, 8
TILEKERNELS = "tile-kernels==2.1.0"


def _numbers(tokens, n, C, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    x = torch.randn(tokens, n, C, generator=g, dtype=torch.float64)
    phi = torch.randn(m, n * C, generator=g, dtype=torch.float64) / (n * C) ** 0.5
    bias = torch.randn(m, generator=g, dtype=torch.float64) * 0.5
    alpha = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    up = torch.randn(tokens, n, C, generator=g, dtype=torch.float64)
    return (x, phi, bias, alpha), up


def _site(x, phi, bias, alpha, *, untransposed=False):
    kw = dict(iterations=peers.SINKHORN_ROUNDS, eps=peers.EPS, rms_eps=peers.EPS)
    pre, post, res = mhc_coefficients(x, phi, bias, alpha, **kw)
    if untransposed:  # out_i = sum_j H_res[i, j] x_j, where ours is sum_j H_res[j, i] x_j
        res = res.transpose(-1, -2)
    return mhc_post(x, mhc_pre(x, pre), post, res)


def _grads(fn, leaves, up):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, up)


def test_the_float64_site_is_the_reference_site():
    (x, phi, bias, alpha), up = _numbers(6, 4, 16)
    out, grads = peers.float64_site(x, phi, bias, alpha, up)
    want, want_grads = _grads(_site, (x, phi, bias, alpha), up)
    assert torch.equal(out, want.detach())
    assert all(torch.allclose(a, b) for a, b in zip(grads, want_grads))


@pytest.mark.parametrize("tokens,n,C", SHAPES)
def test_transformer_engine_layout_computes_our_site_and_its_gradients_map_back(tokens, n, C):
    numbers, up = _numbers(tokens, n, C)
    x_te, phi_te, alpha_te, beta = peers.te_operands(*numbers)
    assert x_te.shape == (tokens, 1, C, n) and phi_te.shape == numbers[1].shape and beta.shape == (1, n * n + 2 * n)
    # TE's logits: its lanes flattened [C, n] times its phi's rows; they must be ours exactly
    ours_logits = numbers[0].reshape(tokens, n * C) @ numbers[1].t()
    te_logits = x_te.reshape(tokens, C * n) @ phi_te.t()
    torch.testing.assert_close(te_logits, ours_logits, rtol=1e-12, atol=1e-12)
    inverse = torch.argsort(peers.lanes_last_columns(n, C))

    def te_site(x_te, phi_te, alpha_te, beta):  # TE's convention: out = f H_post + x H_res, lanes last
        out = _site(peers.te_to_ours(x_te), phi_te[:, inverse], beta.view(-1), alpha_te)
        return peers.te_from_ours(out)

    out, grads = _grads(te_site, (x_te, phi_te, alpha_te, beta), peers.te_from_ours(up))
    want, want_grads = _grads(_site, numbers, up)
    torch.testing.assert_close(peers.te_to_ours(out), want)
    for got, expected in zip(peers.te_grads_to_ours(grads), want_grads):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("tokens,n,C", SHAPES)
def test_liger_convention_computes_our_site_up_to_sinkhorns_order(tokens, n, C):
    numbers, up = _numbers(tokens, n, C)
    x, phi_t, b, a_pre, a_post, a_res = peers.liger_operands(*numbers)
    assert phi_t.shape == (n * C, n * n + 2 * n) and phi_t.dtype == torch.bfloat16 and a_pre.dim() == 0

    def liger_site(x, phi_t, b, a_pre, a_post, a_res):  # Liger: phi [nC, m], H_res applied untransposed
        return _site(x, phi_t.t(), b, torch.stack([a_pre, a_post, a_res]), untransposed=True)

    leaves = (x, phi_t.double(), b, a_pre, a_post, a_res)
    out, grads = _grads(liger_site, leaves, up)
    # the same numbers in our convention (phi as Liger keeps it, in bf16)
    same_phi = (numbers[0], phi_t.t().double()[torch.argsort(peers.rows_for_untransposed_res(n))], numbers[2],
                numbers[3])
    want, want_grads = _grads(_site, same_phi, up)
    # Sinkhorn normalises rows first; on the transposed logits that is our columns first: after 20 rounds the two
    # differ by the rounds' residual error, small but not zero
    difference = float((out - want).detach().norm() / want.detach().norm())
    assert 0 < difference < 1e-3, difference
    for got, expected in zip(peers.liger_grads_to_ours(grads), want_grads):
        assert float((got.double() - expected).norm() / expected.norm()) < 1e-2
    # without the permutation, the convention would compute a different site (at n = 2 a doubly stochastic
    # matrix is symmetric, so only wider lanes tell the two apart)
    if n > 2:
        unpermuted = liger_site(x, numbers[1].t(), numbers[2], *numbers[3]).detach()
        assert float((unpermuted - want.detach()).norm() / want.detach().norm()) > 10 * difference


@pytest.fixture(scope="module")
def tilekernels_reference(tmp_path_factory):
    """tile_kernels/torch/mhc.py of the released wheel (it needs Python >= 3.12 to install, so it is read from the
    wheel and loaded alone: plain torch)."""
    folder = tmp_path_factory.mktemp("tilekernels")
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                              "--python-version", "3.12", "-d", str(folder), TILEKERNELS],
                             capture_output=True, text=True, timeout=300)
    wheels = list(folder.glob("tile_kernels-*.whl"))
    if fetched.returncode or not wheels:
        pytest.skip(f"could not fetch {TILEKERNELS} from the package index: {fetched.stderr[-300:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        path = folder / "tilekernels_torch_mhc.py"
        path.write_bytes(wheel.read("tile_kernels/torch/mhc.py"))
    spec = importlib.util.spec_from_file_location("tilekernels_torch_mhc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tokens,n,C", SHAPES)
def test_tilekernels_references_composed_compute_our_site(tilekernels_reference, tokens, n, C):
    ref = tilekernels_reference
    numbers, _ = _numbers(tokens, n, C)
    x, phi, bias, alpha = numbers
    xb = x.bfloat16()  # its references take bf16 lanes and float32 weights, and round the layer input to bf16
    r = xb.unsqueeze(0)
    mixes = ref.mhc_pre_norm_fn_ref(r, phi.float(), None, peers.EPS)
    pre, post, comb = ref.mhc_pre_split_mixes_ref(mixes, alpha.float(), bias.float(), n, 2.0, peers.EPS)
    res = ref.sinkhorn_normalize_ref(comb, repeat=peers.SINKHORN_ROUNDS, eps=peers.EPS)
    y = ref.mhc_pre_apply_mix_ref(r.float(), pre)
    out = ref.mhc_post_ref(y, r, post, res).squeeze(0)
    want = _site(xb.double(), phi.float().double(), bias.float().double(), alpha.float().double())
    err = float((out.double() - want).norm() / want.norm())
    assert err < 1e-2, err  # bf16 output and layer input: a few bf16 roundings
    # H_res applied from the other side would not agree (at n > 2: a 2 x 2 doubly stochastic matrix is symmetric)
    if n == 2:
        return
    swapped = ref.mhc_post_ref(y, r, post, res.transpose(-1, -2).contiguous()).squeeze(0)
    assert float((swapped.double() - want).norm() / want.norm()) > 10 * err
