"""The learner's kernel in a box: resource limits for every graded kernel, and another user than the grader's
when the grader runs as root.

The grading worker starts each kernel through a kernel spec of its own (``write_kernel_spec``), whose command is
this module: ``python -m mhc_lab.classroom.sandbox --memory BYTES [--uid UID] -- python -m ipykernel_launcher -f
CONNECTION_FILE``. Before it becomes the kernel (exec), it

* sets resource limits (``resource.setrlimit``): address space (``--memory``: a notebook that allocates more gets a
  MemoryError or a failed allocation in its cell, the grader goes on), file size, open files, no core files;
* with ``--uid`` (the grader runs as root): hands the connection file and a private home and temporary folder to
  that user, drops every group and becomes that user and group (setgroups, setgid, setuid), and limits its
  processes. Each kernel gets a user id of its own, so that two kernels graded side by side (--jobs 2) cannot
  read, trace or signal each other, and neither can read the grader's pipes, memory or files that others may not
  read (the hidden checks: keep their folder closed to others, ``chmod 700``).

What it does not do: hide the grader's processes and command lines (``/proc`` shows them to every user), or the
files that every user may read (the course's library source included); cut the network; limit CPU time (the
grader's cell and notebook time limits do).
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import subprocess
import sys
from pathlib import Path

KERNEL_NAME = "mhc-lab-graded"
DEFAULT_MEMORY = 8 * 2**30  # bytes of address space a graded kernel may map
FILE_SIZE = 2 * 2**30  # the largest file a graded kernel may write
OPEN_FILES = 4096
PROCESSES = 2048  # threads included; per user id, so only with a user id of the kernel's own
FIRST_UID = 1_500_000_000  # graded kernels' user ids: far above any account's (nothing on the system owns them)


class SandboxError(RuntimeError):
    """The kernels cannot be boxed as asked (running as root, and no other user can run the course's Python)."""


def kernel_uid() -> int:
    """A user id for one graded kernel: unused by any account, different for every kernel of a run."""
    return FIRST_UID + secrets.randbelow(500_000_000)


def write_kernel_spec(folder: Path, *, memory: int | None, uid: int | None) -> Path:
    """A Jupyter kernel spec named KERNEL_NAME under ``folder``/kernels whose kernel starts boxed (see the module
    doc); put ``folder`` first on JUPYTER_PATH. Returns the spec's folder."""
    spec = folder / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "mhc_lab.classroom.sandbox", "--memory", str(memory or 0)]
    if uid is not None:
        argv += ["--uid", str(uid)]
    argv += ["--", sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "graded notebook",
                                                  "language": "python"}))
    return spec


def set_limits(memory: int | None, processes: int | None = None) -> None:
    """This process's resource limits (inherited by what it runs)."""
    limits = [(resource.RLIMIT_FSIZE, FILE_SIZE), (resource.RLIMIT_NOFILE, OPEN_FILES), (resource.RLIMIT_CORE, 0)]
    if memory:
        limits.append((resource.RLIMIT_AS, int(memory)))
    if processes:
        limits.append((resource.RLIMIT_NPROC, processes))
    for which, value in limits:
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


def become(uid: int, folder: Path, connection_file: Path | None) -> None:
    """Root only: make a home, a work folder and a temporary folder for ``uid`` in ``folder``, give them and the
    connection file to that user, then drop to that user and group for good (the work folder is the current
    one)."""
    home, work, tmp = (folder / f"{kind}-{uid}" for kind in ("home", "work", "tmp"))
    for path in (home, work, tmp):
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, uid, uid)
        os.chmod(path, 0o700)
    if connection_file is not None:
        os.chown(connection_file, uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
        raise SandboxError(f"could not become user {uid}")
    name = f"learner{uid}"
    os.environ.update(HOME=str(home), USER=name, LOGNAME=name, TMPDIR=str(tmp), PWD=str(work))
    os.chdir(work)


def end_processes_of(uid: int) -> None:
    """Root only: stop every process left running as ``uid`` (what a graded kernel started and left behind)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, 9)  # every process this user may signal: its own
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def can_drop_to_another_user(env: dict | None = None) -> str | None:
    """Root only: None when a process of an unprivileged user id can run this Python and import the course and
    a kernel; otherwise why not."""
    uid = kernel_uid()
    probe = "import ipykernel, mhc_lab.classroom.grading_kernel"

    def drop():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    try:
        done = subprocess.run([sys.executable, "-c", probe], preexec_fn=drop, env=env, cwd="/",
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as error:
        return f"{type(error).__name__}: {error}"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit status {done.returncode}"
    return None


def _main(argv: list[str]) -> int:
    if "--" not in argv:
        sys.exit("usage: python -m mhc_lab.classroom.sandbox --memory BYTES [--uid UID] -- KERNEL COMMAND "
                 "(the grader's kernel spec runs this)")
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    values = dict(zip(options[::2], options[1::2]))
    memory = int(values.get("--memory", 0)) or None
    uid = int(values["--uid"]) if "--uid" in values else None
    connection = Path(command[command.index("-f") + 1]) if "-f" in command else None
    if uid is not None:
        become(uid, Path(os.getcwd()), connection)
        set_limits(memory, PROCESSES)
    else:
        set_limits(memory)
    os.execv(command[0], command)
    return 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
