"""mhc_lab: the helper library of the mHC course (reference math, kernels, ops, course tools).

Layers, lowest first; a lower layer never imports a higher one:

    mhc_lab.reference  the equations in plain PyTorch (residual, HC, mHC, Sinkhorn, metrics)
    mhc_lab.kernels    TileLang tile programs, one factory per kernel
    mhc_lab.ops        wrappers that allocate, check and dispatch to kernels or references
    mhc_lab.integrations  the ops inside other libraries' models (transformers' DeepSeek-V4)
    mhc_lab.course     checks, hints, measuring, recorded results, widgets, data, training, build, CLI
"""

__version__ = "0.1.0"
