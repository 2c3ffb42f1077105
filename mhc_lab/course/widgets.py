"""Interactive explorers with a static fallback.

``explorer(plot, controls)`` shows ``plot(**defaults)`` with its controls as one output whose bundle holds the
figure as the lab renderer draws it (mhc_lab.course.display: the interactive figure and its PNG, or one line
saying why there is no PNG; viewers without widgets show the PNG or that line) and a widget view (what
JupyterLab shows: the interactive figure inside an ipywidgets Output, then the controls); in JupyterLab moving
a control redraws the interactive figure.
"""

from __future__ import annotations

from typing import Callable

from IPython.display import display


def _bundle(figure, static: bool = True) -> tuple[dict, dict]:
    """The figure's mime bundle without displaying it (a plotly figure displays itself from IPython's formatter,
    which then returns nothing). ``static=False``: a plotly figure's interactive part alone (a redraw, which
    only JupyterLab shows, need not wait for a picture)."""
    if not static and hasattr(figure, "to_plotly_json"):
        from mhc_lab.course.display import interactive_bundle

        return interactive_bundle(figure), {}
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
    # is the content of an Output widget, which the callback replaces. Its first content is the whole bundle, PNG
    # included: viewers that draw widgets from the notebook's saved widget state (nbconvert's HTML) show that.
    def show(live_data, live_metadata):
        figure.outputs = ({"output_type": "display_data", "data": live_data, "metadata": live_metadata},)

    figure = widgets.Output()
    show(data, metadata)

    def redraw(change=None):
        show(*_bundle(plot(**{name: control.value for name, control in controls.items()}), static=False))

    for control in controls.values():
        control.observe(redraw, names="value")
    label = widgets.HTML(f"<b>{title}</b> (move a control to redraw the figure above)" if title else "")
    view = widgets.VBox([figure, label, widgets.HBox(list(controls.values()))])
    # One output: JupyterLab renders the widget view (figure and controls); viewers without widgets render the
    # figure's PNG, or its line saying why there is none (which the widget view's text must not replace).
    bundle = dict(data)
    bundle.update(view._repr_mimebundle_())
    if "text/plain" in data:
        bundle["text/plain"] = data["text/plain"]
    display(bundle, metadata=metadata, raw=True)
