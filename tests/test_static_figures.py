"""Every figure shows outside JupyterLab: a lab executed in small mode carries, beside each interactive plotly
figure, a PNG of it, and nbconvert's HTML of the executed notebook shows that PNG. Where no PNG can be drawn
(no kaleido, no browser) the output still carries the interactive figure and says in one line why there is no
picture.

The PNG is drawn by kaleido in Debian's Chromium (or any Chrome on PATH), which `make test` installs
(`make browser`). Run alone without them, the notebook tests are skipped and say why; with
MHC_LAB_BROWSER_TEST=required (set by `make test`) they fail instead.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import nbformat
import numpy as np
import pytest

from mhc_lab.course import display as lab_display

ROOT = Path(__file__).resolve().parents[1]
LAB = "00_setup.ipynb"  # two figures, one of them an explorer; about a minute in small mode
PLOTLY = lab_display.PLOTLY_MIME
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


@pytest.fixture(autouse=True)
def headless(monkeypatch):
    """As a headless run sets it (mhc_lab.classroom.runner.pictures_on); a test may turn it off again."""
    monkeypatch.setenv(lab_display.SWITCH, "on")


def test_interactive_sessions_draw_no_picture_unless_asked(monkeypatch):
    """JupyterLab's own session (the switch unset) gets the interactive figure and the one line, no browser: a
    bundled PNG can keep JupyterLab's plotly renderer from drawing the figure (tests/test_browser.py)."""
    monkeypatch.delenv(lab_display.SWITCH)
    bundle = lab_display.LabRenderer().to_mimebundle(_figure().to_dict())
    assert "image/png" not in bundle and "executed headless" in bundle["text/plain"]


def test_headless_runs_ask_for_pictures():
    from mhc_lab.classroom.runner import pictures_on

    os.environ.pop(lab_display.SWITCH)
    with pictures_on():
        assert os.environ[lab_display.SWITCH] == "on"
    assert lab_display.SWITCH not in os.environ


def _figure(title="a figure"):
    import plotly.graph_objects as go

    return go.Figure(go.Scatter(x=[0, 1, 2], y=[2, 0, 1]), layout={"title": {"text": title}, "width": 320,
                                                                    "height": 240})


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", png[16:24])


def _require_static_pictures():
    from mhc_lab.classroom.runner import pictures_on

    with pictures_on():
        pictures = lab_display.StaticPictures()
        png, reason = pictures.png(_figure().to_dict())
        pictures.close()
    if png is None:
        message = f"static figures need kaleido and a Chrome or Chromium: {reason}; `make browser` installs Chromium"
        if os.environ.get("MHC_LAB_BROWSER_TEST") == "required":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The lab executed in small mode on the CPU, as the course runs it (a copy: the stored solution is kept)."""
    _require_static_pictures()
    from mhc_lab.classroom.runner import execute_with_papermill

    target = tmp_path_factory.mktemp("static-figures") / LAB
    result = execute_with_papermill(ROOT / "solutions" / LAB, target, {"SIZE": "small", "DEVICE": "cpu"})
    assert result["ok"], f"{LAB} failed in small mode: {result['failure'] or result['errors']}"
    return nbformat.read(target, as_version=4)


def _figure_outputs(nb) -> list[dict]:
    return [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs
            if PLOTLY in output.get("data", {})]


def _output_model_outputs(nb, view_id: str) -> list[dict]:
    """The outputs held, in the notebook's saved widget state, by the Output widget inside an explorer's view."""
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    children = state[view_id]["state"]["children"]
    output_ids = [c.removeprefix("IPY_MODEL_") for c in children
                  if state[c.removeprefix("IPY_MODEL_")]["model_name"] == "OutputModel"]
    assert len(output_ids) == 1, f"explorer view {view_id}: expected one Output widget, found {output_ids}"
    return state[output_ids[0]]["state"]["outputs"]


@pytest.mark.notebooks
def test_every_figure_of_the_executed_lab_carries_its_png(executed):
    stored = nbformat.read(ROOT / "solutions" / LAB, as_version=4)
    figures = _figure_outputs(executed)
    assert len(figures) == len(_figure_outputs(stored)) >= 2, "the lab's figures: some output went missing"
    for output in figures:
        data = output["data"]
        assert "image/png" in data, f"a figure without a static picture: {data.get('text/plain')}"
        width, height = _png_size(base64.b64decode(data["image/png"]))
        layout = data[PLOTLY]["layout"]
        expected = (layout.get("width") or lab_display.DEFAULT_WIDTH,
                    layout.get("height") or lab_display.DEFAULT_HEIGHT)
        assert (width, height) == expected, f"PNG of {width}x{height}, figure laid out as {expected}"


@pytest.mark.notebooks
def test_nbconvert_html_shows_every_figure(executed):
    from nbconvert import HTMLExporter

    html, _ = HTMLExporter().from_notebook_node(executed)
    figures = _figure_outputs(executed)
    plain = [o for o in figures if WIDGET_VIEW not in o["data"]]
    explorers = [o for o in figures if WIDGET_VIEW in o["data"]]
    assert plain and explorers, "the test lab should show both a plain figure and an explorer"
    # A plain figure: its PNG as an image of the page.
    for output in plain:
        assert f'src="data:image/png;base64,{output["data"]["image/png"]}"' in html
    assert html.count('src="data:image/png;base64,') == len(plain)
    # An explorer: nbconvert draws it from the saved widget state (written into the page with "/" escaped),
    # whose Output widget holds the same PNG.
    for output in explorers:
        held = _output_model_outputs(executed, output["data"][WIDGET_VIEW]["model_id"])
        assert [o["data"].get("image/png") for o in held] == [output["data"]["image/png"]]
        assert output["data"]["image/png"].replace("/", "\\/") in html
    # A viewer that draws no widgets (GitHub's notebook view): every figure as an image.
    without_widgets = nbformat.from_dict(json.loads(json.dumps(executed)))
    without_widgets.metadata.pop("widgets")
    html, _ = HTMLExporter().from_notebook_node(without_widgets)
    assert html.count('src="data:image/png;base64,') == len(figures)


def test_the_picture_leaves_the_interactive_figure_as_plotly_gives_it():
    """nbval compares a checked cell's plotly JSON with the stored one: drawing the PNG must not change it."""
    _require_static_pictures()
    import plotly.io as pio

    fig = _figure("unchanged")
    fig.add_bar(y=[1.5, 0.25, 3.0])
    bundle = lab_display.LabRenderer().to_mimebundle(fig.to_dict())
    assert bundle[PLOTLY] == pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())[PLOTLY]
    assert _png_size(base64.b64decode(bundle["image/png"])) == (320, 240)


def _png_parts(png: bytes) -> tuple[list[bytes], bytes]:
    """The chunk kinds in order, and the image data inflated (the pixels, as filtered rows)."""
    kinds, data, at = [], b"", 8
    while at < len(png):
        (length,) = struct.unpack(">I", png[at:at + 4])
        kind, body = png[at + 4:at + 8], png[at + 8:at + 8 + length]
        assert struct.unpack(">I", png[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        kinds.append(kind)
        data += body if kind == b"IDAT" else b""
        at += 12 + length
    return kinds, zlib.decompress(data)


@pytest.mark.parametrize("size", [(1, 1), (7, 3), (97, 61)])
def test_recompressed_png_has_the_same_pixels_in_fewer_bytes(size):
    """A PNG written the way a fast encoder writes one (several image-data chunks, low compression level)."""
    width, height = size
    rng = np.random.default_rng(width * height)
    rows = b"".join(b"\x00" + rng.integers(0, 4, 4 * width, dtype=np.uint8).tobytes() for _ in range(height))
    data = zlib.compress(rows, 1)

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    pieces = b"".join(chunk(b"IDAT", data[i:i + 50]) for i in range(0, len(data), 50))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0))
           + chunk(b"tEXt", b"Software\x00test") + pieces + chunk(b"IEND", b""))
    smaller = lab_display.recompressed(png)
    kinds, pixels = _png_parts(smaller)
    assert pixels == rows and kinds == [b"IHDR", b"tEXt", b"IDAT", b"IEND"]
    assert _png_size(smaller) == size and len(smaller) <= len(png)
    if width * height > 100:
        assert len(smaller) < len(png)


def test_without_kaleido_the_figure_stays_and_one_line_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "kaleido", None)  # `import kaleido` now raises ImportError
    renderer = lab_display.LabRenderer()
    bundle = renderer.to_mimebundle(_figure("lanes over depth").to_dict())
    assert set(bundle) == {PLOTLY, "text/plain"}
    line = bundle["text/plain"]
    assert "\n" not in line and "lanes over depth" in line and "kaleido" in line and "no static picture" in line
    assert renderer.pictures.unavailable  # remembered: later figures do not try again
    again = renderer.to_mimebundle(_figure("second").to_dict())
    assert "kaleido" in again["text/plain"] and "image/png" not in again


def test_without_a_browser_the_figure_stays_and_one_line_says_why():
    pytest.importorskip("kaleido")
    script = (
        "import json, plotly.graph_objects as go\n"
        "from mhc_lab.course import display\n"
        "display.use_lab_renderer()\n"
        "fig = go.Figure(go.Bar(y=[1, 2]), layout={'title': {'text': 'bytes per token'}})\n"
        "print(json.dumps([sorted(fig._repr_mimebundle_()), fig._repr_mimebundle_().get('text/plain')]))\n"
    )
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, BROWSER_PATH=str(ROOT / "no-such-browser"), PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    keys, line = json.loads(done.stdout.strip().splitlines()[-1])
    assert keys == [PLOTLY, "text/plain"]
    assert "\n" not in line and "bytes per token" in line and "no Chrome or Chromium found" in line


def test_the_switch_turns_pictures_off_without_starting_a_browser(monkeypatch):
    monkeypatch.setenv(lab_display.SWITCH, "off")
    monkeypatch.setattr("asyncio.new_event_loop", lambda: pytest.fail("a browser's loop was started"))
    bundle = lab_display.LabRenderer().to_mimebundle(_figure("graded").to_dict())
    assert set(bundle) == {PLOTLY, "text/plain"}
    assert "executed headless" in bundle["text/plain"]


def test_a_render_past_its_time_gives_the_line_not_a_hang(monkeypatch):
    import asyncio
    import threading
    import time

    class StuckBrowser:
        async def calc_fig(self, fig, opts):
            await asyncio.sleep(30)

        async def close(self):
            pass

    def start(pictures):
        pictures._loop = asyncio.new_event_loop()
        threading.Thread(target=pictures._loop.run_forever, daemon=True).start()
        pictures._browser = StuckBrowser()

    monkeypatch.setattr(lab_display, "RENDER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(lab_display.StaticPictures, "_start", start)
    renderer = lab_display.LabRenderer()
    began = time.perf_counter()
    bundle = renderer.to_mimebundle(_figure("stuck").to_dict())
    assert time.perf_counter() - began < 10
    assert set(bundle) == {PLOTLY, "text/plain"} and "no picture within 0.5 s" in bundle["text/plain"]


def test_explorer_keeps_the_reason_line_when_there_is_no_picture(monkeypatch):
    import ipywidgets

    from mhc_lab.course import widgets

    import plotly.io as pio

    monkeypatch.setitem(sys.modules, "kaleido", None)
    pio.renderers["mhc_lab_without_kaleido"] = lab_display.LabRenderer()  # a name of its own: the lab's is kept
    shown = []
    monkeypatch.setattr(widgets, "display", lambda bundle, **_: shown.append(bundle))
    default = pio.renderers.default
    try:
        pio.renderers.default = "mhc_lab_without_kaleido"
        widgets.explorer(lambda n: _figure(f"n = {n}"), {"n": ipywidgets.IntSlider(value=4, min=1, max=8)})
    finally:
        pio.renderers.default = default
    (bundle,) = shown
    assert WIDGET_VIEW in bundle and PLOTLY in bundle and "image/png" not in bundle
    assert bundle["text/plain"].startswith("Figure 'n = 4'") and "no static picture" in bundle["text/plain"]


def test_setup_installs_the_lab_renderer():
    import plotly.io as pio
    import torch

    from mhc_lab.course import setup as course_setup

    threads = torch.get_num_threads()
    try:
        course_setup.setup("small", "cpu", 0, quiet=True)
    finally:
        torch.set_num_threads(threads)
    assert pio.renderers.default == lab_display.RENDERER
    assert "PNG" in course_setup.setup.__doc__


def test_grading_workers_draw_no_static_pictures(tmp_path):
    """Graded notebooks' pictures are never looked at: the workers (and the kernels they start) switch them off."""
    from mhc_lab.classroom.grading import worker_environment
    from mhc_lab.course.display import SWITCH

    assert worker_environment(tmp_path)[SWITCH] == "off"
