"""Bad and extreme input at every entry point, each case a clear error or a documented behaviour.

- mhc_lab.reference, called directly, checks values: NaN or inf is an InputError naming the input the caller
  passed (x, phi, bias, alpha; "logits" only for the Sinkhorn, whose input is the logits).
- mhc_lab.ops checks no values, on any backend: NaN and inf propagate to the outputs, identically on the
  reference backend and the kernels (TileLang's C target here), and no value is read back to the host.
- The RMS norm: float32 lanes from |x| = 1e-30 to 1e30 against a float64 reference written out here; the
  kernels' documented range (their sum of x^2 is float32).
- The exported compiled kernels check every call's tensors (count, dtype, device, contiguity, sizes, and the
  same number of tokens in every tensor).
- Unknown keywords, integer tensors and tensors on the wrong device are errors that name the argument.
"""

import contextlib
import math

import pytest
import torch

from mhc_lab import ops
from mhc_lab.kernels import CheckedKernel, nvcc_path, post_kernel, pre_kernel_c
from mhc_lab.reference import (
    InputError,
    ManifoldHyperConnection,
    hc_apply,
    mhc_coefficients,
    mhc_post,
    mhc_pre,
    sinkhorn,
)
from mhc_lab.reference.backward import post_backward, pre_backward
from mhc_lab.reference.validate import skipping_value_checks

SHAPES = [(1, 5), (2, 7), (4, 13), (8, 3)]  # (n, C): every n the kernels take, widths not multiples of 8
VARIANTS = ("deepseek_v4", "paper", "log_domain")
BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
COUNTS = {"nan": "got 1 NaN, 0 \\+inf and 0 -inf", "+inf": "got 0 NaN, 1 \\+inf and 0 -inf",
          "-inf": "got 0 NaN, 0 \\+inf and 1 -inf"}


def _site(tokens, n, C, *, seed=0, dtype=torch.float32):
    """Random x [tokens, n, C], phi, bias, alpha and a layer output f (never zeros), in dtype."""
    g = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    x = torch.randn(tokens, n, C, generator=g, dtype=torch.float64)
    phi = torch.randn(m, n * C, generator=g, dtype=torch.float64) / math.sqrt(n * C)
    bias = torch.randn(m, generator=g, dtype=torch.float64) * 0.5
    alpha = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    f = torch.randn(tokens, C, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (x, phi, bias, alpha, f)]


def _truth(x, phi, bias, alpha, iterations=20, eps=1e-6, rms_eps=1e-6):
    """(y, pre, post, res) of one site in float64, written out here apart from mhc_lab (DeepSeek-V4 convention:
    the norm as the plain mean of squares, which float64 holds for any float32 input)."""
    x, phi, bias, alpha = (t.double() for t in (x, phi, bias, alpha))
    *batch, n, C = x.shape
    flat = x.reshape(*batch, n * C)
    mix = flat / torch.sqrt((flat * flat).sum(-1, keepdim=True) / (n * C) + rms_eps) @ phi.t()
    pre = 1 / (1 + torch.exp(-(alpha[0] * mix[..., :n] + bias[:n]))) + eps
    post = 2 / (1 + torch.exp(-(alpha[1] * mix[..., n:2 * n] + bias[n:2 * n])))
    logits = (alpha[2] * mix[..., 2 * n:] + bias[2 * n:]).reshape(*batch, n, n)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    comb = e / e.sum(-1, keepdim=True) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    res = comb.transpose(-1, -2)
    return torch.einsum("...j,...jc->...c", pre, x), pre, post, res


def _assert_close(name, got, want, tol):
    """Every element within tol of the float64 value, relative to the largest |value| (at least 1)."""
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), f"{name}: {int((~torch.isfinite(got)).sum())} non-finite entries"
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1.0))
    assert err <= tol, f"{name}: error {err:.3g} > {tol:g}"


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


@contextlib.contextmanager
def _host_reads(monkeypatch):
    """Counts every read of a tensor's value back to the host (bool, item, float, int, tolist) in the block."""
    count = []
    for name in ("__bool__", "item", "__float__", "__int__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield count
    monkeypatch.undo()


def _c_target():
    """Skip, saying why, where TileLang's C target cannot build a kernel here."""
    try:
        post_kernel(1, 5, "float32", "c")
    except Exception as error:  # no C compiler, or TileLang missing
        pytest.skip(f"TileLang's C target is unavailable here ({type(error).__name__}: {error})")


# ---- 1. NaN or inf in the inputs: the reference names the input the caller passed --------------------------


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("n,C", SHAPES)
def test_non_finite_lanes_are_named_x_not_logits(n, C, bad):
    x, phi, bias, alpha, _ = _site(5, n, C)
    x = _with(x, (2, n - 1, C - 1), BAD[bad])
    where = f"the first at index \\(2, {n - 1}, {C - 1}\\)"
    with pytest.raises(InputError, match=f"^x: expected no NaN or inf entries.*{COUNTS[bad]}, {where}"):
        mhc_coefficients(x, phi, bias, alpha)
    with pytest.raises(InputError, match=f"^x: expected no NaN or inf entries.*{COUNTS[bad]}"):
        ManifoldHyperConnection(n, C).coefficients(x)


@pytest.mark.parametrize("name", ["phi", "bias", "alpha"])
@pytest.mark.parametrize("bad", BAD)
def test_non_finite_parameters_are_named(name, bad):
    args = dict(zip(("x", "phi", "bias", "alpha"), _site(3, 4, 13)[:4]))
    args[name] = _with(args[name], (0,) * args[name].dim(), BAD[bad])  # phi's row 0 feeds only H_pre
    with pytest.raises(InputError, match=f"^{name}: expected no NaN or inf entries.*{COUNTS[bad]}"):
        mhc_coefficients(**args)


def test_logits_that_overflow_from_finite_inputs_are_explained():
    x, phi, bias, alpha, _ = _site(3, 2, 7)
    with pytest.raises(InputError, match="^mhc_coefficients: the logits .* overflowed to inf from finite x, phi"):
        mhc_coefficients(x, phi * 1e37, bias, alpha * 1e3)
    with pytest.raises(InputError, match="rms_eps: expected a number >= 0, got -1.0"):
        mhc_coefficients(x, phi, bias, alpha, rms_eps=-1.0)


def test_the_reference_reads_one_value_back_and_none_when_told_to_skip(monkeypatch):
    x, phi, bias, alpha, _ = _site(5, 4, 13)
    with _host_reads(monkeypatch) as reads:
        mhc_coefficients(x, phi, bias, alpha)
    assert len(reads) == 1  # one check for x, phi, bias and alpha together
    with _host_reads(monkeypatch) as reads, skipping_value_checks():
        co = mhc_coefficients(_with(x, (1, 0, 0), float("nan")), phi, bias, alpha)
    assert not reads
    assert torch.isnan(co.res[1]).all() and torch.isfinite(co.res[[0, 2, 3, 4]]).all()


# ---- 2. non-finite logits into sinkhorn -------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_sinkhorn_refuses_non_finite_logits(variant, bad, n):
    logits = _with(torch.randn(3, n, n, generator=torch.Generator().manual_seed(n)), (1, 0, n - 1), BAD[bad])
    with pytest.raises(InputError, match=f"^logits: expected no NaN or inf entries.*{COUNTS[bad]}, the first at "
                                         f"index \\(1, 0, {n - 1}\\)"):
        sinkhorn(logits, variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sinkhorn_refuses_a_row_of_minus_inf(variant):
    logits = torch.zeros(2, 4, 4)
    logits[0, 1, :] = float("-inf")  # no softmax, no normalisation: never a silent NaN
    with pytest.raises(InputError, match="^logits: expected no NaN or inf entries.*got 0 NaN, 0 \\+inf and 4 -inf"):
        sinkhorn(logits, variant)


def test_sinkhorn_without_value_checks_propagates_and_still_refuses_underflow():
    logits = _with(torch.randn(3, 4, 4), (1, 2, 2), float("inf"))
    with skipping_value_checks():
        h = sinkhorn(logits)
        assert torch.isnan(h[1]).any() and torch.isfinite(h[[0, 2]]).all()
        with pytest.raises(InputError, match="sinkhorn_paper: exp\\(logits\\) underflowed"):
            sinkhorn(torch.randn(50, 4, 4, generator=torch.Generator().manual_seed(1)) * 1e3, "paper")


# ---- 3. one NaN policy for the ops: no value checks, on every backend ---------------------------------------


def _nonfinite(*tensors):
    return [~torch.isfinite(t) for t in tensors]


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("n,C", SHAPES)
def test_ops_propagate_non_finite_lanes_alike_on_both_backends(n, C, bad):
    _c_target()
    x, phi, bias, alpha, f = _site(5, n, C)
    x = _with(x, (2, 0, C - 1), BAD[bad])
    got = {b: ops.mhc_pre(x, phi, bias, alpha, backend=b) for b in ("reference", "kernels")}
    masks = {b: _nonfinite(*outs) for b, outs in got.items()}
    for name, ref_mask, kernel_mask in zip(("y", "post", "res"), masks["reference"], masks["kernels"]):
        assert torch.equal(ref_mask, kernel_mask), name
        assert ref_mask[2].all() and not ref_mask[[0, 1, 3, 4]].any(), name  # the token with the bad value
    want = _truth(x[[0, 1, 3, 4]], phi, bias, alpha)
    for b, (y, post, res) in got.items():
        for name, a, w in (("y", y, want[0]), ("post", post, want[2]), ("res", res, want[3])):
            _assert_close(f"{b} {name}", a[[0, 1, 3, 4]], w, 1e-5)
    post, res = got["reference"][1].nan_to_num(), got["reference"][2].nan_to_num()
    nexts = {b: ops.mhc_post(x, f, post, res, backend=b) for b in ("reference", "kernels")}
    assert torch.equal(*(_nonfinite(t)[0] for t in nexts.values()))
    assert _nonfinite(nexts["reference"])[0][[0, 1, 3, 4]].sum() == 0


def test_ops_site_forward_and_backward_propagate_nan_alike_and_read_nothing_back(monkeypatch):
    _c_target()
    n, C = 4, 13
    x, phi, bias, alpha, _ = _site(6, n, C)
    x = _with(x, (3, 1, 5), float("nan"))
    layer = torch.nn.Linear(C, C)
    grads = {}
    for backend in ("reference", "kernels"):
        leaves = [t.clone().requires_grad_() for t in (x, phi, bias, alpha)]
        with _host_reads(monkeypatch) as reads:
            out = ops.mhc_site(*leaves, layer, backend=backend)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        assert not reads, f"{backend}: {len(reads)} values read back to the host"
        grads[backend] = [out] + [t.grad for t in leaves]
    for name, a, b in zip(("out", "dx", "dphi", "dbias", "dalpha"), grads["reference"], grads["kernels"]):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
    out, dx = grads["reference"][:2]
    assert torch.isnan(out[3]).all() and not torch.isnan(out[[0, 1, 2, 4, 5]]).any()
    assert torch.isnan(dx[3]).all() and not torch.isnan(dx[[0, 1, 2, 4, 5]]).any()
    assert all(torch.isnan(g).all() for g in grads["kernels"][2:])  # summed over the tokens


@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_modules_propagate_nan_without_raising(backend):
    _c_target()
    n, C = 2, 7
    stream = ops.MHCResidualStream([torch.nn.Linear(C, C) for _ in range(2)], n, C, backend=backend)
    h = _with(torch.randn(4, C), (1, 3), float("nan"))
    out = stream(h)
    out.sum().backward()
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2, 3]]).any()
    connection = ops.MHCConnection(n, C, backend=backend)
    x = _with(torch.randn(4, n, C), (0, 1, 0), float("inf"))
    assert not torch.isfinite(connection(x, torch.tanh)[0]).any()


# ---- 4. the RMS norm cannot overflow ------------------------------------------------------------------------

SCALES = [1e-30, 1e-3, 1e19, 1e30]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("n,C", SHAPES)
def test_reference_coefficients_in_float32_from_tiny_to_huge_lanes(n, C, scale):
    x, phi, bias, alpha, _ = _site(7, n, C, seed=n)
    x = x * scale
    y, pre, post, res = _truth(x, phi, bias, alpha)
    co = mhc_coefficients(x, phi, bias, alpha)
    for name, got, want in (("pre", co.pre, pre), ("post", co.post, post), ("res", co.res, res)):
        _assert_close(name, got, want, 2e-6)
    y_ops, post_ops, res_ops = ops.mhc_pre(x, phi, bias, alpha, backend="reference")
    for name, got, want in (("y", y_ops, y), ("post", post_ops, post), ("res", res_ops, res)):
        _assert_close(f"ops {name}", got, want, 2e-6)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("n,C", SHAPES)
def test_reference_backward_in_float32_from_tiny_to_huge_lanes(n, C, scale):
    x, phi, bias, alpha, _ = _site(7, n, C, seed=n)
    x = x * scale
    g = torch.Generator().manual_seed(3)
    dy, dpost, dres = torch.randn(7, C, generator=g), torch.randn(7, n, generator=g), torch.randn(7, n, n, generator=g)
    leaves = [t.double().requires_grad_() for t in (x, phi, bias, alpha)]
    y, _, post, res = _truth(*leaves)
    want = torch.autograd.grad((y, post, res), leaves, (dy.double(), dpost.double(), dres.double()))
    got = pre_backward(x, phi, bias, alpha, dy, dpost, dres)
    for name, a, w in zip(("dx", "dphi", "dbias", "dalpha"), got, want):
        err = float((a.double() - w).abs().max() / w.abs().max())
        assert torch.isfinite(a).all() and err < 1e-4, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("n,C", SHAPES)
def test_kernels_range_is_as_documented(n, C):
    """The kernels sum x^2 in float32: exact from tiny lanes up to sum(x^2) ~ 3.4e38; past it r = 0 and the
    coefficients come from the biases alone (mhc_lab.ops' docstring)."""
    _c_target()
    x, phi, bias, alpha, _ = _site(7, n, C, seed=n)
    inside = 1e37 / (n * C * x.pow(2).mean().item())  # sum(x^2) about 1e37 per token: inside the range
    for scale in (1e-30, math.sqrt(inside)):
        y, _, post, res = _truth(x * scale, phi, bias, alpha)
        got = ops.mhc_pre(x * scale, phi, bias, alpha, backend="kernels")
        for name, a, w in zip(("y", "post", "res"), got, (y, post, res)):
            _assert_close(f"scale {scale:.3g} {name}", a, w, 2e-5)
    _, post, res = ops.mhc_pre(x * 1e19 * math.sqrt(n * C), phi, bias, alpha, backend="kernels")  # past it
    _, _, post0, res0 = _truth(x, phi * 0, bias, alpha)
    _assert_close("post from the biases", post, post0, 2e-6)
    _assert_close("res from the biases", res, res0, 2e-6)


# ---- 5. the exported compiled kernels check their tensors -------------------------------------------------


def _post_args(tokens, n, C, seed=0):
    x, _, _, _, f = _site(tokens, n, C, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return [x, f, torch.rand(tokens, n, generator=g) * 2, torch.rand(tokens, n, n, generator=g),
            torch.full((tokens, n, C), float("nan"))]


def _pre_args(tokens, n, C, seed=0):
    x, phi, bias, alpha, _ = _site(tokens, n, C, seed=seed)
    nan = float("nan")
    return [x, phi, bias, alpha, torch.full((tokens, C), nan), torch.full((tokens, n), nan),
            torch.full((tokens, n), nan), torch.full((tokens, n, n), nan)]


POST_NAMES = ("x", "f", "post", "res", "out")
PRE_NAMES = ("x", "phi", "bias", "alpha", "y", "pre", "post", "res")


@pytest.mark.parametrize("n,C", SHAPES)
def test_exported_kernels_compute_right_when_called_right(n, C):
    _c_target()
    assert isinstance(post_kernel(n, C, "float32", "c"), CheckedKernel)
    assert isinstance(pre_kernel_c(n, C), CheckedKernel)
    x, f, post, res, out = _post_args(7, n, C)
    post_kernel(n, C, "float32", "c")(x, f, post, res, out)
    want = torch.einsum("tij,tjc->tic", res.double(), x.double()) + post.double()[..., None] * f.double()[:, None]
    _assert_close("post_kernel out", out, want, 1e-6)
    args = _pre_args(7, n, C)
    pre_kernel_c(n, C)(*args)
    y, pre, post, res = _truth(*args[:4])
    for name, a, w in zip(("y", "pre", "post", "res"), args[4:], (y, pre, post, res)):
        _assert_close(f"pre_kernel_c {name}", a, w, 2e-5)


@pytest.mark.parametrize("factory,names,make", [
    (lambda n, C: post_kernel(n, C, "float32", "c"), POST_NAMES, _post_args),
    (pre_kernel_c, PRE_NAMES, _pre_args),
], ids=["post_kernel", "pre_kernel_c"])
@pytest.mark.parametrize("n,C", [(2, 7), (4, 13)])
def test_exported_kernels_refuse_tensors_that_disagree_on_the_tokens(factory, names, make, n, C):
    """The raw post kernel wrote 6 tokens past a 2-token out: every tensor's tokens must be x's."""
    _c_target()
    kernel = factory(n, C)
    for i, name in enumerate(names):
        args = make(7, n, C)
        if args[i].shape[0] != 7:  # phi, bias, alpha have no tokens
            continue
        guard = torch.full((7, *args[i].shape[1:]), float("nan"))
        guard[:2] = args[i][:2]
        args[i] = guard[:2]  # two tokens, with five more after them in memory
        blamed, tokens = ("f" if names is POST_NAMES else "y", 2) if i == 0 else (name, 7)
        with pytest.raises(InputError, match=f"{blamed}: expected shape \\(T, .*\\) with T = {tokens} \\(from x\\), "
                                             f"got shape \\({7 if i == 0 else 2}, .*same in every tensor"):
            kernel(*args)
        assert torch.isnan(guard[2:]).all()  # nothing written past the end


def test_exported_kernels_name_the_argument_for_dtype_size_layout_count_and_device():
    _c_target()
    n, C = 4, 13
    kernel = post_kernel(n, C, "float32", "c")
    prefix = "post_kernel\\(4, 13, 'float32', 'c'\\): "
    cases = [
        (2, lambda t: t.long(), "post: expected dtype torch.float32, got torch.int64"),
        (0, lambda t: t.double(), "x: expected dtype torch.float32, got torch.float64"),
        (3, lambda t: torch.zeros(7, n + 1, n + 1),
         "res: expected shape \\(T, 4, 4\\) with T = 7 \\(from x\\), got shape \\(7, 5, 5\\)"),
        (0, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "x: expected a contiguous tensor"),
        (4, lambda t: None, "out: expected a torch.Tensor, got NoneType"),
        (1, lambda t: t.to("meta"), "f: expected a cpu tensor \\(the kernel is compiled for cpu\\), got device meta"),
    ]
    for i, change, message in cases:
        args = _post_args(7, n, C)
        args[i] = change(args[i])
        with pytest.raises(InputError, match=prefix + message):
            kernel(*args)
    with pytest.raises(InputError, match=prefix + "expected 5 tensors \\(x, f, post, res, out\\), got 4"):
        kernel(*_post_args(7, n, C)[:4])
    args = _pre_args(7, n, C)
    args[1] = args[1][:, :-1]
    with pytest.raises(InputError, match="pre_kernel_c\\(4, 13, 'float32'\\): phi: expected shape \\(24, 52\\), got "
                                         "shape \\(24, 51\\)"):
        pre_kernel_c(n, C)(*args)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found on PATH or in /usr/local/cuda/bin: no CUDA build")
def test_cuda_post_kernel_given_cpu_tensors_names_the_device():
    kernel = post_kernel(4, 64, "bfloat16", "sm_90")
    args = [t.bfloat16() if t.dim() != 2 or t.shape[1] == 64 else t for t in _post_args(3, 4, 64)]
    args[4] = args[4].bfloat16()
    with pytest.raises(InputError, match="post_kernel\\(4, 64, 'bfloat16', 'sm_90'\\): x: expected a cuda tensor "
                                         "\\(the kernel is compiled for cuda\\), got device cpu"):
        kernel(*args)


# ---- 6. unknown keywords, integer tensors, devices ----------------------------------------------------------


@pytest.mark.parametrize("keyword", ["plan", "tuning"])
def test_unknown_keywords_are_errors_on_the_cpu(keyword):
    x, phi, bias, alpha, f = _site(3, 2, 7)
    post, res = torch.rand(3, 2), torch.rand(3, 2, 2)
    calls = [
        lambda: ops.mhc_pre(x, phi, bias, alpha, **{keyword: "split"}),
        lambda: ops.mhc_post(x, f, post, res, **{keyword: "split"}),
        lambda: ops.mhc_site(x, phi, bias, alpha, torch.tanh, **{keyword: "split"}),
        lambda: ops.mhc_pre_fused(x, phi, bias, alpha, **{keyword: "split"}),
        lambda: ops.MHCConnection(2, 7, **{keyword: "split"}),
        lambda: post_kernel(2, 7, "float32", "c", **{keyword: "split"}),
        lambda: pre_kernel_c(2, 7, **{keyword: "split"}),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
            call()
    with pytest.raises(InputError, match="backend: expected one of \\('auto', 'reference', 'kernels'\\), got 'split'"):
        ops.mhc_pre(x, phi, bias, alpha, backend="split")


@pytest.mark.parametrize("name", ["phi", "bias", "alpha"])
def test_integer_parameters_are_refused_not_cast(name):
    args = dict(zip(("x", "phi", "bias", "alpha"), _site(3, 2, 7)[:4]))
    args[name] = args[name].long()
    message = f"{name}: expected a floating-point tensor, got torch.int64"
    with pytest.raises(InputError, match=f"^mhc_pre: {message}"):
        ops.mhc_pre(**args)
    with pytest.raises(InputError, match=f"^mhc_site: {message}"):
        ops.mhc_site(**args, layer=torch.tanh)
    with pytest.raises(InputError, match=f"^{message}"):
        mhc_coefficients(**args)
    with pytest.raises(InputError, match=f"^{message}"):
        pre_backward(**args, grad_layer_input=torch.zeros(3, 7), grad_post=torch.zeros(3, 2),
                     grad_res=torch.zeros(3, 2, 2))


def test_integer_coefficients_and_layer_outputs_are_refused_not_cast():
    x, phi, _, _, f = _site(3, 2, 7)
    post, res = torch.rand(3, 2), torch.rand(3, 2, 2)
    for name, args in (("post", (x, f, post.long(), res)), ("res", (x, f, post, res.long()))):
        with pytest.raises(InputError, match=f"^mhc_post: {name}: expected a floating-point tensor, got torch.int64"):
            ops.mhc_post(*args)
        with pytest.raises(InputError, match=f"^{name}: expected a floating-point tensor, got torch.int64"):
            mhc_post(*args)
        with pytest.raises(InputError, match=f"^{name}: expected a floating-point tensor, got torch.int64"):
            post_backward(*args, torch.zeros_like(x))
    with pytest.raises(InputError, match="^layer_out: expected a floating-point tensor, got torch.int64"):
        mhc_post(x, f.long(), post, res)
    with pytest.raises(InputError, match="^pre: expected a floating-point tensor, got torch.int64"):
        mhc_pre(x, post.long())
    with pytest.raises(InputError, match="^alpha_m: expected a floating-point tensor, got torch.int64"):
        hc_apply(x, torch.tanh, torch.ones(2, dtype=torch.long), torch.eye(2), torch.ones(2))
    _, phi4, bias4, alpha4, _ = _site(3, 2, 7)
    with pytest.raises(InputError, match="^mhc_site: next_phi: expected a floating-point tensor, got torch.int64"):
        ops.mhc_site_chained(x, phi4, bias4, alpha4, torch.tanh, next_phi=phi.long())


def test_tensors_on_another_device_are_named_with_both_devices():
    x, phi, bias, alpha, f = _site(3, 2, 7)
    with pytest.raises(InputError, match="^mhc_pre: phi: expected device cpu \\(the lanes'\\), got .*device meta"):
        ops.mhc_pre(x, phi.to("meta"), bias, alpha)
    with pytest.raises(InputError, match="^mhc_post: res: expected shape \\(3, 2, 2\\) on cpu, got .*device meta"):
        ops.mhc_post(x, f, torch.rand(3, 2), torch.rand(3, 2, 2, device="meta"))
    with pytest.raises(InputError, match="^mhc_post: layer_output: expected shape \\(3, 7\\) on cpu, got .*device "
                                         "meta"):
        ops.mhc_post(x, f.to("meta"), torch.rand(3, 2), torch.rand(3, 2, 2))
