"""The grader's side of the grading channel: the learner's functions, called from the grader's process.

After the learner's notebook has run, the worker grades in its own process. Each of the learner's functions
becomes a ``Remote``: calling it sends the arguments to the learner's kernel (``grading_kernel.serve``), which
calls the real function there and sends back what it returned, as plain data opened with
``torch.load(weights_only=True)``, and its tensor arguments as the call left them (copied back into the
grader's own, so a kernel that writes into ``out`` is checked as it would be locally). What is not plain data
(a compiled kernel, a tile program) comes back as another ``Remote``. An exception in the learner's code comes
back as an exception of the same name (``RemoteError``), a stub's ``NotImplementedError`` as itself.
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import pickle
import time

from mhc_lab.classroom.grading_kernel import HANDLE, RESULT_MIME, Reference, tensors_in

MAX_REQUEST = 64_000_000  # characters of one request's arguments
MAX_LEARNER_TEXT = 500  # characters kept of an exception message from the learner's kernel
MAX_NAME = 60  # characters kept of a type name from the learner's kernel


class RemoteError(Exception):
    """An exception raised by the learner's code in its kernel (subclassed under the exception's own name)."""


class CheckTimeout(BaseException):
    """A check ran past its time limit (a BaseException, so that a learner's ``except Exception`` in the grader's
    own code paths cannot eat it)."""


class KernelDied(BaseException):
    """The learner's kernel died while the grader was calling one of its functions."""


class GraderError(BaseException):
    """The grader could not make a request (a check handed over something that cannot be sent): a fault of the
    check, never counted against the learner."""


_ERROR_CLASSES: dict[str, type] = {}
_REMOTE_CLASSES: dict[tuple[str, bool], type] = {}


def _error_class(name: str) -> type:
    name = name[:MAX_NAME]
    if name not in _ERROR_CLASSES:
        clean = name if name.isidentifier() else "RemoteError"
        _ERROR_CLASSES[name] = type(clean, (RemoteError,), {"__module__": "learner"})
    return _ERROR_CLASSES[name]


class Remote:
    """An object that lives in the learner's kernel: attributes are fetched lazily, ``type(self).__name__`` is
    the object's own type name there (so that a check's message says "got ndarray", not "got Remote")."""

    _mhc_lab_remote = True

    def __init__(self, session: "KernelSession", name: str | None, handle: int | None, path: tuple = ()):
        self._session, self._name, self._handle, self._path = session, name, handle, tuple(path)

    def __getattr__(self, attribute: str):
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return _remote_class("attribute", True)(self._session, self._name, self._handle, (*self._path, attribute))

    def __reduce__(self):
        return (Reference, (self._name, self._handle, self._path))

    def __repr__(self) -> str:
        where = self._name or f"object {self._handle}"
        return f"<{type(self).__name__} {'.'.join([where, *self._path])} in the learner's kernel>"


class RemoteFunction(Remote):
    def __call__(self, *args, **kwargs):
        return self._session.request("call", target=self, args=args, kwargs=kwargs)


def _remote_class(type_name: str, is_callable: bool) -> type:
    type_name = type_name[:MAX_NAME]
    key = (type_name, is_callable)
    if key not in _REMOTE_CLASSES:
        clean = type_name if type_name.isidentifier() else "object"
        _REMOTE_CLASSES[key] = type(clean, (RemoteFunction if is_callable else Remote,), {"__module__": "learner"})
    return _REMOTE_CLASSES[key]


def is_remote(value) -> bool:
    return getattr(type(value), "_mhc_lab_remote", False)


def _outbound(value):
    """The grader's arguments as they are pickled: tensors detached (leaves keep requires_grad)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value if value.is_leaf else value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_outbound(v) for v in value)
    if isinstance(value, list):
        return [_outbound(v) for v in value]
    if isinstance(value, dict):
        return {k: _outbound(v) for k, v in value.items()}
    return value


class KernelSession:
    """Calls into the learner's kernel through an nbclient client whose kernel is running (``client.kc``)."""

    def __init__(self, client, cell_index: int, caps=None):
        self.client, self.cell_index, self.caps = client, cell_index, caps
        self.library: tuple[str, ...] = ()  # the current exercise's own library functions, watched for
        self.library_seen: set[str] = set()
        self.exercise = ""  # the exercise being graded, and the library functions withheld meanwhile
        self.withheld: tuple[str, ...] = ()
        self.deadline: float | None = None
        self.requests = 0

    @contextlib.contextmanager
    def time_limit(self, seconds: float | None):
        """Every request within the block must answer before ``seconds`` from now (CheckTimeout after)."""
        saved = self.deadline
        self.deadline = None if not seconds else time.monotonic() + seconds
        try:
            yield
        finally:
            self.deadline = saved

    def answer(self, name: str):
        """The notebook's value of ``name``: plain data as itself, anything else as a Remote."""
        return self.request("describe", target=Reference(name, None))

    def apply(self, function: str, *args, **kwargs):
        """Call the library function named ``function`` in the learner's kernel on these arguments."""
        return self.request("apply", function=function, args=args, kwargs=kwargs)

    def request(self, kind: str, *, target=None, function: str | None = None, args=(), kwargs=None):
        import nbformat
        import torch

        kwargs = kwargs or {}
        message = {"kind": kind, "target": target, "function": function, "args": _outbound(tuple(args)), "kwargs": _outbound(dict(kwargs)),
                   "library": tuple(self.library), "withheld": tuple(self.withheld), "exercise": self.exercise}
        try:
            text = base64.b64encode(pickle.dumps(message, protocol=4)).decode()
        except Exception as error:
            raise GraderError(f"a check's arguments cannot be sent to the learner's kernel ({error}); checks must "
                              "hand over tensors, numbers and library objects, not closures") from None
        if len(text) > MAX_REQUEST:
            raise ValueError(f"a grading request of {len(text)} characters is over the {MAX_REQUEST} limit")
        cell = nbformat.v4.new_code_cell(
            f"from mhc_lab.classroom.grading_kernel import serve as _mhc_lab_serve\n_mhc_lab_serve({text!r})")
        limit = None
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise CheckTimeout("ran past its time limit")
            limit = max(1, math.ceil(remaining))
        self.client.timeout = limit
        self.client.error_on_timeout = {"ename": "CheckTimeout", "evalue": "the call ran past its time limit"}
        self.requests += 1
        started = time.monotonic()
        try:
            self.client.execute_cell(cell, self.cell_index, store_history=False)
        except Exception as error:
            if type(error).__name__ == "DeadKernelError":
                raise KernelDied(str(error)) from None
            raise
        finally:
            if self.caps is not None:
                self.caps.cleared([], self.cell_index)
        payload = None
        for output in cell.get("outputs", []):
            data = output.get("data") or {}
            if RESULT_MIME in data:
                payload = data[RESULT_MIME]
        if payload is None:
            if limit is not None and time.monotonic() - started >= limit - 0.5:
                raise CheckTimeout(f"timed out after {limit:g} s (an endless loop?)")
            failure = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
            detail = f"{failure.get('ename')}: {failure.get('evalue')}" if failure else "no answer"
            raise _error_class("NoAnswer")(f"the learner's kernel gave no answer ({detail[:300]})")
        try:
            answer = torch.load(io.BytesIO(base64.b64decode(payload)), weights_only=True)
        except Exception as error:
            raise _error_class("NotData")(f"what your function returned could not be read as data: {error}") from None
        if not isinstance(answer, dict):
            raise _error_class("NotData")("the learner's kernel answered with something else than an answer")
        if "error" in answer:
            if answer["error"].get("type") == "Withheld":  # the learner's function reached a withheld answer
                text = str(answer["error"].get("message", ""))
                self.library_seen.update([n for n in self.withheld if f"{n} is withheld" in text] or self.withheld)
            raise self._exception(answer["error"])
        self.library_seen.update(str(name) for name in answer.get("library", ()))
        mine = tensors_in((args, kwargs))
        theirs = answer.get("arguments") or []
        if len(theirs) == len(mine):
            with torch.no_grad():
                for m, t in zip(mine, theirs):
                    if (isinstance(t, torch.Tensor) and t.shape == m.shape and t.dtype == m.dtype
                            and not torch.equal(t, m)):
                        m.copy_(t)
        return self._inbound(answer.get("value"))

    def _exception(self, error: dict) -> BaseException:
        from mhc_lab.course.checks import CheckFailed

        # The learner's text: cut short here, so that no long text of theirs reaches a verdict's message.
        name, text = str(error.get("type", "Exception"))[:MAX_NAME], str(error.get("message", ""))[:MAX_LEARNER_TEXT]
        if error.get("interrupted"):
            return CheckTimeout("timed out (an endless loop?)")
        if error.get("check_failed"):
            return CheckFailed(text)
        if name == "NotImplementedError":
            return NotImplementedError(text)
        return _error_class(name)(text)

    def _inbound(self, value):
        if isinstance(value, dict) and HANDLE in value:
            return _remote_class(str(value.get("type", "object")), bool(value.get("callable")))(
                self, None, int(value[HANDLE]))
        if isinstance(value, tuple):
            return tuple(self._inbound(v) for v in value)
        if isinstance(value, list):
            return [self._inbound(v) for v in value]
        if isinstance(value, dict):
            return {k: self._inbound(v) for k, v in value.items()}
        return value
