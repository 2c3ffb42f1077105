"""mhc_lab's ops inside transformers' DeepSeek-V4: one call, on the model's own parameters, undoable.

    from mhc_lab.integrations.transformers import use_mhc_lab, restore

    patch = use_mhc_lab(model)       # a DeepseekV4Model or DeepseekV4ForCausalLM; backend="auto"
    ...                              # train, save and load checkpoints as before: no parameter moves or copies
    patch.restore()                  # or restore(model); or `with use_mhc_lab(model): ...`

What it changes. DeepSeek-V4's decoder layer has two mHC sites, one around the attention and one around the
MoE. The layer asks its HyperConnection modules (attn_hc, ffn_hc) for the coefficients and the layer input,
and mixes the lanes itself, inline in its forward, in eager PyTorch. use_mhc_lab gives each decoder layer
instance a subclass of its own class whose forward runs the two sites through mhc_lab.ops.mhc_site_chained:
where the ops can, the attention site's post projects the lanes for the MoE site's pre, and each site's two
lane gradients are summed in one pass. The layer's norms, attention (its keyword arguments, the cache
included) and MoE (with the token ids its hash router reads) are called exactly as the layer calls them.
Nothing else changes: the class and every other instance stay as they are, the parameters and state_dict keys
are the same objects and names, and transformers' gradient checkpointing still wraps the layer (it wraps a
subclass's forward too).

The parameters, read in place: HyperConnection.fn is our phi ([n^2 + 2n, nC], rows [pre, post, res]), .base
our bias, .scale our alpha. Its comb is our H_res transposed (the layer applies comb^T). The ops fix the
convention's constants (20 Sinkhorn rounds, eps 1e-6, RMSNorm eps 1e-6: mhc_lab.reference.mhc_coefficients'
defaults), so a model configured otherwise is refused rather than run with other numbers.

Where the numbers differ. The ops mix in float32 and round the next lanes once to the lanes' dtype; the layer
rounds post and comb to the lanes' dtype first and multiplies and adds in that dtype. Float32 lanes: equal up
to the order and precision of the sums. bfloat16 lanes: each site's mixing is rounded once here, three times
there, so the two differ by a few bfloat16 units in the last place per site; through a whole model that is
the size of the model's own bfloat16 rounding (tests/test_transformers_integration.py holds them to it).

Backends (mhc_lab.ops.dispatch): "auto" runs the fused kernels where they take the lanes (CUDA, bfloat16
lanes, n <= 8, n*C a multiple of 8) and the reference elsewhere; "kernels" insists; "reference" is PyTorch.

Tested with transformers TESTED_TRANSFORMERS (the optional extra: pip install 'mhc-lab[transformers]'); with
another version use_mhc_lab warns, since the layer's forward is replaced whole. Not supported: a layer whose
forward is already replaced on the instance (accelerate's hooks from device_map, say). A patched model pickles
whole (torch.save(model), copy.deepcopy) and loads patched; state_dict, save_pretrained and from_pretrained are
unaffected.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field

from torch import nn

from mhc_lab.ops import BACKENDS, mhc_site_chained
from mhc_lab.reference.mhc import mhc_coefficients
from mhc_lab.reference.validate import InputError

TESTED_TRANSFORMERS = "5.24.0"
EXPECTED_MODELS = ("DeepseekV4Model", "DeepseekV4ForCausalLM")

_DEFAULTS = inspect.signature(mhc_coefficients).parameters
SINKHORN_ROUNDS = _DEFAULTS["iterations"].default  # the ops' convention (DeepSeek-V4's)
SINKHORN_EPS = _DEFAULTS["eps"].default
RMS_EPS = _DEFAULTS["rms_eps"].default


def _deepseek_v4():
    """transformers' DeepSeek-V4 modeling module, or an ImportError that says how to install it."""
    try:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4
    except ImportError as error:
        raise ImportError(
            "mhc_lab.integrations.transformers needs transformers with DeepSeek-V4 (tested: transformers=="
            f"{TESTED_TRANSFORMERS}): pip install 'mhc-lab[transformers]'") from error
    return modeling_deepseek_v4


class _MHCLabSites:
    """Mixed in before a DeepSeek-V4 decoder layer's class: its two sites through mhc_lab.ops."""

    mhc_lab_backend = "auto"

    def forward(self, hidden_states, input_ids=None, **kwargs):
        """The layer's forward with the same arguments and result (the next lanes [B, S, n, C])."""

        def attention(y):
            return self.self_attn(self.input_layernorm(y), **kwargs)[0]

        def moe(y):
            return self.mlp(self.post_attention_layernorm(y), input_ids=input_ids)

        first, second = self.attn_hc, self.ffn_hc
        lanes, partial = mhc_site_chained(hidden_states, *_site_parameters(first), attention,
                                          next_phi=second.fn.float(), backend=self.mhc_lab_backend)
        return mhc_site_chained(lanes, *_site_parameters(second), moe, partial=partial,
                                backend=self.mhc_lab_backend)[0]

    def extra_repr(self):
        return f"sites=mhc_lab.ops, backend={self.mhc_lab_backend!r}"

    def __reduce_ex__(self, protocol):
        """Pickled (torch.save(model), copy.deepcopy) as the layer's own class and backend: the patched class is
        made at run time, so it is rebuilt on loading rather than looked up by name."""
        reduced = list(super().__reduce_ex__(protocol))
        reduced[:2] = _new_patched, (self._mhc_lab_base, self.mhc_lab_backend)
        return tuple(reduced)


def _new_patched(base: type, backend: str):
    """An empty patched layer of this class and backend, for unpickling to fill (see __reduce_ex__)."""
    return object.__new__(_patched_class(base, backend))


def _site_parameters(hc):
    """(phi, bias, alpha) of a HyperConnection module: its own float32 parameters (.float() is the parameter
    itself then; a model cast whole to another dtype gets a differentiable float32 cast, as the module makes)."""
    return hc.fn.float(), hc.base.float(), hc.scale.float()


@functools.cache
def _patched_class(base: type, backend: str) -> type:
    """The subclass a patched layer takes: same name (transformers and accelerate match layers by class name),
    forward through mhc_lab.ops. One per layer class and backend."""
    return type(base.__name__, (_MHCLabSites, base), {
        "mhc_lab_backend": backend, "_mhc_lab_base": base, "__module__": __name__,
        "__qualname__": f"_MHCLabSites[{base.__qualname__}, {backend}]"})


@dataclass
class MHCLabPatch:
    """What use_mhc_lab changed: the patched layers and their backend. restore() undoes it; also a context
    manager (the layers are restored on leaving the block)."""

    model: nn.Module = field(repr=False)
    backend: str
    layers: list = field(default_factory=list, repr=False)

    def restore(self) -> None:
        restore(self.model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        restore(self.model)
        return False


def _decoder_layers(model, *, action: str) -> list:
    """The model's decoder layers, after checking that it is a DeepSeek-V4 model of transformers."""
    if not isinstance(model, nn.Module) or not type(model).__name__.startswith("DeepseekV4"):
        raise InputError(f"{action}: expected a transformers DeepSeek-V4 model ({' or '.join(EXPECTED_MODELS)}), "
                         f"got {type(model).__module__}.{type(model).__qualname__}")
    v4 = _deepseek_v4()
    expected = tuple(getattr(v4, name) for name in EXPECTED_MODELS)
    if not isinstance(model, expected):
        raise InputError(f"{action}: expected a transformers DeepSeek-V4 model ({' or '.join(EXPECTED_MODELS)}), "
                         f"got {type(model).__module__}.{type(model).__qualname__}")
    return [m for m in model.modules() if isinstance(m, v4.DeepseekV4DecoderLayer)]


def _check_layer(index: int, layer, v4) -> None:
    """A layer use_mhc_lab can take: not patched, forward not replaced on the instance, both sites in the ops'
    convention."""
    where = f"use_mhc_lab: decoder layer {index}"
    if isinstance(layer, _MHCLabSites):
        raise InputError(f"{where} is already patched (backend {layer.mhc_lab_backend!r}); call restore(model) "
                         "first to patch it again")
    if "forward" in vars(layer):
        raise InputError(f"{where} has its forward replaced on the instance ({vars(layer)['forward']!r}, e.g. "
                         "accelerate's hooks from device_map), which use_mhc_lab would bypass; load the model "
                         "without them")
    for name in ("attn_hc", "ffn_hc"):
        hc = getattr(layer, name, None)
        if not isinstance(hc, v4.DeepseekV4HyperConnection):
            raise InputError(f"{where}: expected {name} to be a DeepseekV4HyperConnection, got {type(hc).__name__}")
        found = {"hc_sinkhorn_iters": hc.hc_sinkhorn_iters, "hc_eps": hc.hc_eps, "rms_norm_eps": hc.input_norm.eps}
        wanted = {"hc_sinkhorn_iters": SINKHORN_ROUNDS, "hc_eps": SINKHORN_EPS, "rms_norm_eps": RMS_EPS}
        if found != wanted:
            raise InputError(f"{where}.{name}: mhc_lab.ops run DeepSeek-V4's convention {wanted}; this model "
                             f"has {found}")


def use_mhc_lab(model: nn.Module, backend: str = "auto") -> MHCLabPatch:
    """Run both mHC sites of every decoder layer of a transformers DeepseekV4Model / DeepseekV4ForCausalLM
    through mhc_lab.ops (see the module's docstring). backend: "auto" (fused kernels where they apply, else the
    reference), "kernels" or "reference". Returns the patch; restore(model) or patch.restore() undoes it.
    InputError for another model, a model already patched, or one configured outside the ops' convention."""
    if backend not in BACKENDS:
        raise InputError(f"use_mhc_lab: backend: expected one of {BACKENDS}, got {backend!r}")
    layers = _decoder_layers(model, action="use_mhc_lab")
    v4 = _deepseek_v4()
    if not layers:
        raise InputError(f"use_mhc_lab: {type(model).__name__} has no DeepseekV4DecoderLayer to patch")
    for index, layer in enumerate(layers):
        _check_layer(index, layer, v4)
    import transformers

    if transformers.__version__ != TESTED_TRANSFORMERS:
        warnings.warn(f"use_mhc_lab was tested with transformers {TESTED_TRANSFORMERS}, this is "
                      f"{transformers.__version__}: it replaces the decoder layer's forward whole, so compare the "
                      "patched model with the unpatched one before relying on it", stacklevel=2)
    for layer in layers:
        layer.__class__ = _patched_class(type(layer), backend)
    return MHCLabPatch(model=model, backend=backend, layers=layers)


def restore(model: nn.Module) -> None:
    """Give every patched decoder layer of the model its own class (and forward) back. InputError where no
    layer is patched."""
    layers = [m for m in _decoder_layers(model, action="restore") if isinstance(m, _MHCLabSites)]
    if not layers:
        raise InputError(f"restore: no decoder layer of this {type(model).__name__} is patched by use_mhc_lab")
    bases = [type(layer).__dict__.get("_mhc_lab_base") for layer in layers]
    for layer, base in zip(layers, bases):
        if base is None:
            raise InputError(f"restore: a decoder layer's class was wrapped again after use_mhc_lab "
                             f"({type(layer).__qualname__}); undo that wrapping first")
    for layer, base in zip(layers, bases):
        layer.__class__ = base
