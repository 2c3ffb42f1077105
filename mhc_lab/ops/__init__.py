"""Ops: wrappers that check inputs, allocate outputs and dispatch to the TileLang kernels or the references."""
