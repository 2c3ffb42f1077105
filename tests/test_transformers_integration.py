"""transformers' DeepSeek-V4 with its mHC sites run by mhc_lab.ops (mhc_lab.integrations.transformers.use_mhc_lab),
against the same model unpatched, on the CPU (backend "auto" runs the reference there).

The model is tiny but whole: four decoder layers (sliding-window, compressed-sparse and heavily-compressed
attention; a hash-routed and three top-k MoE layers), its HyperConnection parameters drawn away from their
initial values so that H_pre, H_post and H_res are far from uniform. Every expert is routed to and the indexer
keeps every compressed entry, so no discrete choice (a top-k) can flip between two runs that differ by rounding.

Where ours differs, and why. transformers' layer rounds post and comb to the lanes' dtype and mixes the lanes
in that dtype; mhc_lab.ops mix in float32 and round the next lanes once.
- float32 lanes: the two differ only in the order of the sums, so logits, loss and every gradient are compared
  directly, within a few float32 units of rounding (rtol 1e-4 for gradients, which sum over tokens; an atol
  of 1e-5 of the model's largest gradient for entries that are sums cancelling to nearly zero).
- bfloat16 lanes: both are off the exact values by bfloat16 rounding, everywhere in the model (its attention
  and MoE run in bfloat16 too), so the tolerance is that rounding itself, measured: the unpatched model's
  weights in float32 give reference values, and the patched model may differ from the unpatched one by at most
  twice the unpatched model's own distance from them, plus a few bfloat16 epsilons (torch.finfo eps, 2^-7) of
  their size. Logits: within 4 eps of their largest value.
One site is also checked against mhc_lab.reference in float64: transformers' HyperConnection, our ops and the
reference give the same coefficients, layer input and next lanes.
"""

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers with DeepSeek-V4 is not installed "
                    "(the optional extra: pip install 'mhc-lab[transformers]')")

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DeepseekV4Model

from mhc_lab.integrations.transformers import MHCLabPatch, restore, use_mhc_lab
from mhc_lab.ops import mhc_pre, mhc_site
from mhc_lab.reference import InputError, mhc_coefficients
from mhc_lab.reference import mhc_post as reference_post
from mhc_lab.reference import mhc_pre as reference_pre

VOCAB, TOKENS = 96, 24
BF16_EPS = torch.finfo(torch.bfloat16).eps


def tiny_config(**changes) -> DeepseekV4Config:
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=4,
        o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], max_position_embeddings=256, use_cache=False)
    settings.update(changes)
    return DeepseekV4Config(**settings)


def tiny_model(dtype=torch.float32, seed=0, cls=DeepseekV4ForCausalLM, **changes):
    torch.manual_seed(seed)
    model = cls._from_config(tiny_config(**changes), dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_hc.fn"):
                param.normal_(0.0, 0.3)
            elif name.endswith("_hc.base"):
                param.normal_(0.0, 1.0)
            elif name.endswith("_hc.scale"):
                param.uniform_(0.5, 2.0)
    return model


def token_ids(seed=1):
    return torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(seed))


def step(model, ids):
    """(logits, loss, {name: gradient}) of one forward and backward, in float64 to compare."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().double(), out.loss.detach().double(), grads


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def runs(request):
    """The unpatched and patched steps of one model, and (bfloat16) the unpatched float32 copy's."""
    model, ids = tiny_model(request.param), token_ids()
    truth = step(copy.deepcopy(model).float(), ids) if request.param == torch.bfloat16 else None
    plain = step(model, ids)
    with use_mhc_lab(model):
        patched = step(model, ids)
    return request.param, plain, patched, truth


def test_logits_loss_and_every_gradient_match_the_unpatched_model(runs):
    dtype, (logits_u, loss_u, grads_u), (logits_p, loss_p, grads_p), truth = runs
    assert set(grads_p) == set(grads_u), "the patched model trains another set of parameters"
    assert any(name.endswith("attn_hc.fn") for name in grads_p)
    assert any(name.endswith("ffn_hc.scale") for name in grads_p)
    if dtype == torch.float32:
        torch.testing.assert_close(logits_p, logits_u, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss_p, loss_u, rtol=1e-6, atol=0)
        largest = max(g.abs().max() for g in grads_u.values()).item()
        for name in grads_u:
            torch.testing.assert_close(grads_p[name], grads_u[name], rtol=1e-4, atol=1e-5 * largest,
                                       msg=lambda m, name=name: f"{name}: {m}")
        return
    _assert_bfloat16_close((logits_u, loss_u, grads_u), (logits_p, loss_p, grads_p), truth)


def _assert_bfloat16_close(plain, patched, truth):
    """bfloat16 lanes: the patched model within the unpatched model's own bfloat16 rounding (truth: the
    unpatched model's float32 copy). A gradient that is a sum of many terms that nearly cancel (the final
    collapse's scale, say) carries the bfloat16 rounding of its terms, not of itself: each gradient's tolerance
    takes the larger of its own size and the model's median gradient size."""
    (logits_u, loss_u, grads_u), (logits_p, loss_p, grads_p) = plain, patched
    logits_t, _, grads_t = truth
    typical = torch.tensor([g.norm().item() for g in grads_t.values()]).median().item()
    assert (logits_p - logits_u).abs().max() <= 4 * BF16_EPS * logits_u.abs().max()
    assert (logits_p - logits_t).abs().max() <= 2 * (logits_u - logits_t).abs().max()
    torch.testing.assert_close(loss_p, loss_u, rtol=BF16_EPS, atol=0)
    for name, g_t in grads_t.items():
        apart = (grads_p[name] - grads_u[name]).norm()
        own_error = (grads_u[name] - g_t).norm()
        assert apart <= 2 * own_error + 16 * BF16_EPS * max(g_t.norm().item(), typical), (
            f"{name}: |patched - unpatched| {apart:.3g}, the unpatched model's distance from float32 {own_error:.3g}, "
            f"|gradient| {g_t.norm():.3g}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the GPU programs run only there")
def test_on_a_gpu_the_fused_kernels_train_the_bfloat16_model():
    """On CUDA, bfloat16: backend "auto" takes the fused GPU kernels for both sites of every layer (the
    profiler sees them), and the patched model stays within the unpatched model's own bfloat16 rounding."""
    from torch.profiler import ProfilerActivity, profile

    model, ids = tiny_model(torch.bfloat16).cuda(), token_ids().cuda()
    truth = step(copy.deepcopy(model).float(), ids)
    plain = step(model, ids)
    with use_mhc_lab(model):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            patched = step(model, ids)
    names = {event.key for event in prof.key_averages()}
    assert any("post_project" in name for name in names) and any("lanes_backward" in name for name in names), (
        sorted(names))
    _assert_bfloat16_close(plain, patched, truth)


def test_the_fused_kernels_run_the_sites_too():
    """backend "kernels": on the CPU the fused kernels run through TileLang's C target (float32), on CUDA the
    GPU programs; one layer, against the unpatched model."""
    model = tiny_model(num_hidden_layers=1, layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"])
    ids = token_ids()
    logits_u, loss_u, grads_u = step(model, ids)
    with use_mhc_lab(model, backend="kernels"):
        logits_p, loss_p, grads_p = step(model, ids)
    torch.testing.assert_close(logits_p, logits_u, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-6, atol=0)
    largest = max(g.abs().max() for g in grads_u.values()).item()
    assert set(grads_p) == set(grads_u)
    for name in grads_u:
        torch.testing.assert_close(grads_p[name], grads_u[name], rtol=1e-4, atol=1e-5 * largest)


def test_one_site_equals_the_float64_reference():
    """Layer 0's attention site in float32: transformers' HyperConnection (post, comb, layer input) and our ops
    (coefficients, layer input, next lanes) against mhc_lab.reference in float64; comb is H_res transposed."""
    hc = tiny_model().model.layers[0].attn_hc
    x = torch.randn(2, 5, 4, 64, generator=torch.Generator().manual_seed(2))
    layer = nn.Linear(64, 64)
    with torch.no_grad():
        post_t, comb_t, collapsed_t = hc(x)
        ref = mhc_coefficients(x.double(), hc.fn.double(), hc.base.double(), hc.scale.double())
        y_ref = reference_pre(x.double(), ref.pre)
        next_ref = reference_post(x.double(), layer.double()(y_ref), ref.post, ref.res)
        layer.float()
        y, post, res = mhc_pre(x, hc.fn, hc.base, hc.scale)
        lanes = mhc_site(x, hc.fn, hc.base, hc.scale, layer)
    close = dict(rtol=1e-5, atol=1e-6)
    for got in (post_t, post):
        torch.testing.assert_close(got.double(), ref.post, **close)
    for got in (comb_t.transpose(-1, -2), res):
        torch.testing.assert_close(got.double(), ref.res, **close)
    for got in (collapsed_t, y):
        torch.testing.assert_close(got.double(), y_ref, **close)
    # the next lanes take the float32 layer's output too (64-term sums in float32 against float64)
    torch.testing.assert_close(lanes.double(), next_ref, rtol=1e-5, atol=1e-5)


def test_parameters_and_state_dict_are_the_models_own(tmp_path):
    model, ids = tiny_model(), token_ids()
    before = model.state_dict()
    params = list(model.parameters())
    patch = use_mhc_lab(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key] is value or after[key].data_ptr() == value.data_ptr(), f"{key} moved or was copied"
        assert torch.equal(after[key], value)
    assert all(a is b for a, b in zip(model.parameters(), params)) and len(list(model.parameters())) == len(params)
    model.load_state_dict(before, strict=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)  # saved from the patched model, loaded unpatched
    loaded = DeepseekV4ForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)
    torch.save(model, tmp_path / "whole.pt")  # pickled whole, the model loads patched
    for twin in (torch.load(tmp_path / "whole.pt", weights_only=False), copy.deepcopy(model)):
        assert [type(layer) for layer in twin.model.layers] == [type(layer) for layer in model.model.layers]
        with torch.no_grad():
            assert torch.equal(twin(input_ids=ids).logits, logits)
        restore(twin)
    patch.restore()


def test_restore_gives_the_original_forward_back():
    model, ids = tiny_model(), token_ids()
    originals = [type(layer) for layer in model.model.layers]
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        patch = use_mhc_lab(model)
        assert isinstance(patch, MHCLabPatch) and patch.backend == "auto" and len(patch.layers) == 4
        assert all(type(layer) is not cls and isinstance(layer, cls)
                   for layer, cls in zip(model.model.layers, originals))
        assert "backend='auto'" in repr(model.model.layers[0])
        patch.restore()
        assert [type(layer) for layer in model.model.layers] == originals
        assert all("forward" not in vars(layer) for layer in model.model.layers)
        assert torch.equal(model(input_ids=ids).logits, plain)
        use_mhc_lab(model, backend="reference")
        restore(model)
        with use_mhc_lab(model):
            pass
        assert [type(layer) for layer in model.model.layers] == originals
        assert torch.equal(model(input_ids=ids).logits, plain)


def test_gradient_checkpointing_still_wraps_the_patched_layers():
    model, ids = tiny_model(), token_ids()
    model.train()
    model.activation_checkpointing_enable()
    _, _, plain = step(model, ids)
    calls = []
    for layer in model.model.layers:
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k)
    use_mhc_lab(model)
    _, _, patched = step(model, ids)
    assert len(calls) == 4, "transformers' checkpointing did not wrap the patched layers"
    largest = max(g.abs().max() for g in plain.values()).item()
    for name in plain:
        torch.testing.assert_close(patched[name], plain[name], rtol=1e-4, atol=1e-5 * largest)


def test_generation_with_the_cache_is_unchanged():
    model, ids = tiny_model(use_cache=True), token_ids()[:1]
    settings = dict(max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids))
    plain = model.generate(ids, **settings)
    with use_mhc_lab(model):
        assert torch.equal(model.generate(ids, **settings), plain)


def test_the_base_model_is_patched_too():
    model = tiny_model(cls=DeepseekV4Model)
    ids = token_ids()
    with torch.no_grad():
        plain = model(input_ids=ids).last_hidden_state
        with use_mhc_lab(model) as patch:
            assert len(patch.layers) == 4
            torch.testing.assert_close(model(input_ids=ids).last_hidden_state, plain, rtol=1e-5, atol=1e-5)


def test_refuses_other_models_double_patching_and_other_conventions():
    from transformers import LlamaConfig, LlamaForCausalLM

    expected = r"expected a transformers DeepSeek-V4 model \(DeepseekV4Model or DeepseekV4ForCausalLM\), got "
    with pytest.raises(InputError, match=expected + r"torch\.nn\.modules\.linear\.Linear"):
        use_mhc_lab(nn.Linear(4, 4))
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(InputError, match=expected + r".*LlamaForCausalLM"):
        use_mhc_lab(llama)
    with pytest.raises(InputError, match=expected + r".*DeepseekV4DecoderLayer"):
        use_mhc_lab(tiny_model().model.layers[0])

    model = tiny_model()
    with pytest.raises(InputError, match="no decoder layer .* is patched"):
        restore(model)
    with pytest.raises(InputError, match="backend: expected one of"):
        use_mhc_lab(model, backend="fast")
    use_mhc_lab(model)
    with pytest.raises(InputError, match=r"decoder layer 0 is already patched \(backend 'auto'\); call restore"):
        use_mhc_lab(model)
    restore(model)
    use_mhc_lab(model)  # once restored, it patches again

    with pytest.raises(InputError, match=r"'hc_sinkhorn_iters': 20.*'hc_sinkhorn_iters': 10"):
        use_mhc_lab(tiny_model(hc_sinkhorn_iters=10, num_hidden_layers=1, layer_types=["sliding_attention"],
                               mlp_layer_types=["moe"]))
