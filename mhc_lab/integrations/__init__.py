"""Integrations: mhc_lab's ops inside models built by other libraries.

- transformers.py: ``use_mhc_lab(model)`` runs the two mHC sites of every decoder layer of a transformers
  DeepSeek-V4 model (DeepseekV4Model, DeepseekV4ForCausalLM) through mhc_lab.ops, on the layer's own
  parameters; ``restore(model)`` (or the returned handle's ``restore()``) undoes it. Needs the optional extra:
  ``pip install mhc-lab[transformers]``.

Importing this package imports no third-party library; each integration imports its library when called.
"""

from mhc_lab.integrations.transformers import MHCLabPatch, restore, use_mhc_lab

__all__ = ["MHCLabPatch", "restore", "use_mhc_lab"]
