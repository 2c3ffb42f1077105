"""Interactive explorers with a static fallback.

``explorer(plot, controls)`` shows ``plot(**defaults)`` with its controls as one output whose bundle holds both
the figure (what papermill, nbval and plain notebook viewers show) and a widget view (what JupyterLab shows:
the figure inside an ipywidgets Output, then the controls); in JupyterLab moving a control redraws the figure.
"""

from __future__ import annotations

from typing import Callable

from IPython.display import display


def _bundle(figure) -> tuple[dict, dict]:
    """The figure's mime bundle without displaying it (a plotly figure displays itself from IPython's formatter,
    which then returns nothing)."""
    make = getattr(figure, "_repr_mimebundle_", None)
    if make is not None:
        data = make()
        return data if isinstance(data, tuple) else (data, {})
    from IPython import get_ipython

    return get_ipython().display_formatter.format(figure)


def explorer(plot: Callable[..., object], controls: dict, title: str | None = None) -> None:
    import ipywidgets as widgets

    values = {name: control.value for name, control in controls.items()}
    data, metadata = _bundle(plot(**values))
    # JupyterLab drops display updates sent after a cell has finished (a control's callback), so the live figure
    # is the content of an Output widget, which the callback replaces.
    figure = widgets.Output()
    figure.outputs = ({"output_type": "display_data", "data": data, "metadata": metadata},)

    def redraw(change=None):
        current = {name: control.value for name, control in controls.items()}
        new_data, new_metadata = _bundle(plot(**current))
        figure.outputs = ({"output_type": "display_data", "data": new_data, "metadata": new_metadata},)

    for control in controls.values():
        control.observe(redraw, names="value")
    label = widgets.HTML(f"<b>{title}</b> (move a control to redraw the figure above)" if title else "")
    view = widgets.VBox([figure, label, widgets.HBox(list(controls.values()))])
    # One output: JupyterLab renders the widget view (figure and controls); papermill, nbval and viewers
    # without widgets render the static figure of the same bundle.
    bundle = dict(data)
    bundle.update(view._repr_mimebundle_())
    display(bundle, metadata=metadata, raw=True)
