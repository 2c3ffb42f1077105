"""The learner's side of the grading channel: what runs in the learner's kernel while a submission is graded.

The grader's worker executes the learner's notebook, then calls the learner's functions from its own process, one
request at a time, each sent as a code cell ``serve("<request>")``. A request names a function of the notebook
(or an object an earlier request returned) and carries its arguments; ``serve`` calls it and publishes the answer
as one display message of type ``RESULT_MIME``. The grader compares the answers with the truth in its own
process, so nothing the learner's code does in this kernel can change a verdict: it can only change what its
functions return.

Arguments travel as a pickle made by the grader (the kernel trusts the grader); answers travel as a torch.save
archive of plain data (tensors, numbers, strings, lists, tuples, dicts) that the grader opens with
``torch.load(weights_only=True)``, so the learner's answer cannot run code in the grader. Anything else a
function returns (a compiled program, a module) stays here and travels as a handle the grader can call again.
"""

from __future__ import annotations

import base64
import io
import numbers
import pickle
import sys
import traceback
from typing import Any

RESULT_MIME = "application/x-mhc-lab-result"
HANDLE = "__mhc_lab_handle__"

_objects: dict[int, Any] = {}  # handles: objects returned to the grader by reference


class Reference:
    """What a handle or a notebook name becomes when the grader sends it back as an argument."""

    def __init__(self, name: str | None, handle: int | None, path: tuple[str, ...] = ()):
        self.name, self.handle, self.path = name, handle, tuple(path)

    def resolve(self, namespace: dict):
        if self.handle is not None:
            target = _objects[self.handle]
        elif self.name in namespace:
            target = namespace[self.name]
        else:
            raise NameError(f"name '{self.name}' is not defined in the notebook")
        for attribute in self.path:
            target = getattr(target, attribute)
        return target


def _namespace() -> dict:
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.user_ns
    except Exception:
        pass
    return vars(sys.modules["__main__"])


def _resolve_all(value, namespace):
    if isinstance(value, Reference):
        return value.resolve(namespace)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_resolve_all(v, namespace) for v in value)
    if isinstance(value, list):
        return [_resolve_all(v, namespace) for v in value]
    if isinstance(value, dict):
        return {k: _resolve_all(v, namespace) for k, v in value.items()}
    return value


def _encode(value, depth: int = 0):
    """``value`` as plain data; what is not plain data stays here, replaced by a handle."""
    import torch

    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        return value.detach().cpu().clone()
    if value is None or isinstance(value, torch.dtype):
        return value
    for kind in (bool, str):  # subclasses (a TVM string, a numpy bool) become the plain type
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if depth < 8:
        if isinstance(value, (list, tuple)):
            items = [_encode(v, depth + 1) for v in value]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict) and all(isinstance(k, str) for k in value) and HANDLE not in value:
            return {k: _encode(v, depth + 1) for k, v in value.items()}
    key = len(_objects) + 1
    _objects[key] = value
    return {HANDLE: key, "type": type(value).__name__, "callable": callable(value)}


def tensors_in(value) -> list:
    """The tensors in a value (nested lists, tuples and dicts), in one fixed order: the grader and the kernel
    walk a call's arguments alike with it."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def _call(request: dict, namespace: dict):
    """What a request asks for: ``describe`` a name (its value if it is data, else a handle), ``call`` a
    function, or ``apply`` a library function (compiling a tile program, gradients through a call) to
    arguments; the exercise's own library functions are watched for while it runs."""
    from mhc_lab.classroom.withheld import withholding
    from mhc_lab.course.checks import library_calls, resolve

    raw = request.get("args", ()), request.get("kwargs", {})
    args, kwargs = _resolve_all(raw[0], namespace), _resolve_all(raw[1], namespace)
    watch = library_calls(request.get("library", ()))
    withheld = withholding(request.get("withheld", ()), request.get("exercise", ""))
    kind = request["kind"]
    if kind == "describe":
        value = request["target"].resolve(namespace)
    elif kind == "call":
        target = request["target"].resolve(namespace)
        with withheld, watch.watching():
            value = target(*args, **kwargs)
    elif kind == "apply":
        function = resolve(request["function"])
        with withheld, watch.watching():
            value = function(*args, **kwargs)
    else:
        raise ValueError(f"unknown request kind {kind!r}")
    return value, raw, watch.seen


def serve(request_text: str) -> None:
    """Answer one request of the grader (see the module's doc)."""
    from IPython.display import publish_display_data

    answer: dict[str, Any]
    try:
        request = pickle.loads(base64.b64decode(request_text))
        value, raw, seen = _call(request, _namespace())
        # The tensor arguments as the call left them (a kernel writes its output into one), in the order the
        # grader walks its own copies.
        answer = {"value": _encode(value), "library": sorted(seen),
                  "arguments": [t.detach().cpu().clone() for t in tensors_in(raw)]}
    except BaseException as error:  # the learner's code may raise anything; KeyboardInterrupt is a time limit
        from mhc_lab.course.checks import CheckFailed

        answer = {"error": {"type": type(error).__name__, "message": str(error)[:4000],
                            "check_failed": isinstance(error, CheckFailed),
                            "traceback": "".join(traceback.format_exception_only(type(error), error))[-2000:]}}
        if isinstance(error, KeyboardInterrupt):
            answer["error"]["interrupted"] = True
    buffer = io.BytesIO()
    try:
        import torch

        torch.save(answer, buffer)
    except Exception as error:
        buffer = io.BytesIO()
        torch.save({"error": {"type": "TypeError", "message": f"the answer could not be sent: {error}",
                              "check_failed": False}}, buffer)
    publish_display_data({RESULT_MIME: base64.b64encode(buffer.getvalue()).decode()})
