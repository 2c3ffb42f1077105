"""Interactive explorers with a static fallback.

``explorer(plot, controls)`` shows ``plot(**defaults)`` as an ordinary figure output, so papermill, nbval and
plain notebook viewers see it, then the controls; in JupyterLab moving a control redraws that same figure
in place.
"""

from __future__ import annotations

from typing import Callable

from IPython.display import display


def explorer(plot: Callable[..., object], controls: dict, title: str | None = None) -> None:
    import ipywidgets as widgets

    values = {name: control.value for name, control in controls.items()}
    handle = display(plot(**values), display_id=True)

    def redraw(change=None):
        current = {name: control.value for name, control in controls.items()}
        handle.update(plot(**current))

    for control in controls.values():
        control.observe(redraw, names="value")
    label = widgets.HTML(f"<b>{title}</b> (move a control to redraw the figure above)" if title else "")
    display(widgets.VBox([label, widgets.HBox(list(controls.values()))]))
