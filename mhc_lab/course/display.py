"""How the labs show a plotly figure: one output that carries the interactive figure (what JupyterLab shows) and
a PNG of it (what GitHub's notebook view, nbconvert's HTML and other viewers without JavaScript show).

The PNG is drawn by kaleido in a headless Chrome or Chromium found on the machine (Debian's ``chromium``
package, which ``make browser`` installs, or any Chrome on PATH; ``BROWSER_PATH`` names another). One browser
starts at the first figure of a kernel and serves every later one. Where no picture can be drawn (kaleido
missing, no browser, a render that fails), the output carries the interactive figure and, for every other
viewer, one line saying why there is no picture. A run whose outputs nobody reads (a grader) skips the browser
with ``MHC_LAB_STATIC_FIGURES=off`` in the kernel's environment."""

from __future__ import annotations

import asyncio
import atexit
import base64
import os
import struct
import threading
import zlib
from concurrent.futures import TimeoutError as FutureTimeout

from plotly.io._base_renderers import MimetypeRenderer, PlotlyRenderer

PLOTLY_MIME = "application/vnd.plotly.v1+json"
RENDERER = "mhc_lab"
# Plotly's own default size, used where a figure's layout sets none.
DEFAULT_WIDTH, DEFAULT_HEIGHT = 700, 450
# Longest wait for one picture; the first one of a kernel also starts the browser.
RENDER_TIMEOUT_S = 90
# "on" in the environment (headless runs: mhc_lab.classroom.runner sets it): a picture beside each figure; else
# no browser and no picture (the one-line reason instead), as in JupyterLab, where a bundled PNG can keep
# JupyterLab's plotly renderer from drawing the interactive figure.
SWITCH = "MHC_LAB_STATIC_FIGURES"


def _reason(error: BaseException) -> str:
    """One line for the reader: the error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def recompressed(png: bytes) -> bytes:
    """The same PNG, its image data deflated at zlib's highest level (the browser's encoder favours speed; about
    a fifth fewer bytes in every stored notebook). Chunks other than the image data are kept as they are."""
    chunks, at = [], 8
    while at < len(png):
        (length,) = struct.unpack(">I", png[at:at + 4])
        chunks.append((png[at + 4:at + 8], png[at + 8:at + 8 + length]))
        at += 12 + length
    data = zlib.compress(zlib.decompress(b"".join(d for kind, d in chunks if kind == b"IDAT")), 9)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    head = b"".join(chunk(k, d) for k, d in chunks if k not in (b"IDAT", b"IEND"))
    smaller = png[:8] + head + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    return smaller if len(smaller) < len(png) else png


class StaticPictures:
    """Draws PNGs of figure dicts with kaleido, in one browser kept for the process's lifetime and driven from
    a thread of its own (so that a notebook's running event loop is never touched). After a failure to start
    (kaleido missing, no browser), ``unavailable`` holds the reason and no further attempt is made."""

    def __init__(self):
        self.unavailable: str | None = None
        self._browser = None
        self._loop = None

    def _run(self, coroutine, timeout: float):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _start(self) -> None:
        if os.environ.get(SWITCH, "").lower() != "on":
            raise RuntimeError(f"drawn only where a notebook is executed headless ({SWITCH}=on): JupyterLab "
                               "shows the interactive figure")
        try:
            import kaleido
        except ImportError:
            raise RuntimeError("the kaleido package is not installed (pip install 'kaleido>=1.1')") from None

        async def open_browser():
            # No MathJax: the labs' figures have no LaTeX, and kaleido would fetch MathJax from the network.
            browser = kaleido.Kaleido(n=1, timeout=RENDER_TIMEOUT_S, mathjax=False)
            await browser.open()
            return browser

        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="static-pictures", daemon=True).start()
        self._browser = self._run(open_browser(), RENDER_TIMEOUT_S)
        atexit.register(self.close)

    def close(self) -> None:
        """Close the browser (at the latest when the process exits)."""
        browser, self._browser = self._browser, None
        if browser is not None:
            try:
                self._run(browser.close(), 10)
            except Exception:  # closing a browser that already died
                pass
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def png(self, fig_dict: dict) -> tuple[bytes | None, str | None]:
        """(PNG bytes, None), or (None, the reason there is no picture)."""
        if self.unavailable:
            return None, self.unavailable
        first = self._browser is None
        try:
            if first:
                self._start()
            layout = fig_dict.get("layout", {})
            opts = {"format": "png", "scale": 1, "width": layout.get("width") or DEFAULT_WIDTH,
                    "height": layout.get("height") or DEFAULT_HEIGHT}
            return recompressed(self._run(self._browser.calc_fig(fig_dict, opts=opts), RENDER_TIMEOUT_S)), None
        except Exception as error:  # a browser that cannot start or a failed render must not cost the figure
            reason = _reason(error)
            if isinstance(error, FutureTimeout):
                reason = f"no picture within {RENDER_TIMEOUT_S} s"
            if type(error).__name__ == "ChromeNotFoundError":
                reason = "no Chrome or Chromium found: install Debian's chromium, or name one in BROWSER_PATH"
            if first:  # a browser that never drew a picture will not draw the next one either
                self.unavailable = reason
                self.close()
            return None, reason


def no_picture_line(fig_dict: dict, reason: str) -> str:
    """What a viewer without JavaScript shows in place of the figure: its title and why there is no picture."""
    title = fig_dict.get("layout", {}).get("title", {})
    title = title.get("text") if isinstance(title, dict) else title
    named = f"Figure '{title}'" if title else "Figure"
    return f"{named}: interactive in JupyterLab; no static picture here ({reason})"


class LabRenderer(MimetypeRenderer):
    """Plotly's mime type (the interactive figure) plus image/png, or plus a text/plain line saying why there is
    no picture."""

    def __init__(self, pictures: StaticPictures | None = None):
        self.pictures = pictures or StaticPictures()

    def to_mimebundle(self, fig_dict):
        bundle = PlotlyRenderer().to_mimebundle(fig_dict)
        png, reason = self.pictures.png(bundle[PLOTLY_MIME])
        if png is not None:
            bundle["image/png"] = base64.b64encode(png).decode("ascii")
        else:
            bundle["text/plain"] = no_picture_line(fig_dict, reason)
        return bundle


def use_lab_renderer() -> None:
    """Make every figure's ``show()`` (and a figure left as a cell's value) use the lab renderer."""
    import plotly.io as pio

    if RENDERER not in pio.renderers:
        pio.renderers[RENDERER] = LabRenderer()
    pio.renderers.default = RENDERER


def interactive_bundle(figure) -> dict:
    """The plotly mime bundle of a figure without its static picture (a redraw inside JupyterLab, which shows
    the interactive figure only)."""
    return PlotlyRenderer().to_mimebundle(figure.to_dict())
