"""Run untrusted, model-written Python against assert-style tests.

Isolation (``isolation.py``)
    Each call starts a fresh ``python -I -S`` child under bubblewrap: new user, PID,
    mount, network, IPC, UTS and cgroup namespaces; an unprivileged uid (a fresh one
    outside when the caller is root, so RLIMIT_NPROC binds); a read-only root holding
    only ``/usr`` and the interpreter; a size-limited tmpfs as the only writable work
    directory; a minimal ``/etc`` and an empty environment; ``--die-with-parent``. The
    child lowers RLIMIT_AS, CPU, FSIZE, NPROC and CORE before any candidate code runs.
    Afterwards the PID namespace's init is killed, which ends every process the code
    started, and the parent waits until it is gone.

Verdicts (``checks.py``, ``child.py``)
    The parent splits every ``assert``; the sandbox reports only the type-tagged values
    of the operands that depend on the candidate, and the parent compares them with
    expected values the sandbox never sees, on rebuilt values of exact built-in types.
    Walking the stack to the runner's ``report`` or returning an object whose ``__eq__``
    always holds therefore gains nothing. Records out of the runner's order, without
    the run's nonce, or malformed count as a forgery: every test fails and it is logged.

Fallback
    Where bubblewrap is missing or cannot start, the child runs as a plain process with
    in-process guards (``guards.py``) that code can undo. :func:`sandbox_mode`
    then says ``"python-fallback"``, a warning is issued once, and the mode is part of
    :func:`sandbox_fingerprint`, which the MBPP verifier records in run manifests.

Not covered: kernel exploits (there is no seccomp filter); CPU taken from other work
during the run (bounded by the timeout); memory beyond ``max_procs`` x ``memory_mb`` where
no cgroup can be made (with one, a run gets 2 x ``memory_mb`` plus its tmpfs); asserts on
expressions the checker cannot split (see ``checks.py``).

The modules, each separate because it runs in a different place or answers a different threat:

* ``run.py``: the entry point (:func:`run_python`), the choice of isolation, and the
  result channel the parent reads and judges.
* ``checks.py``: the trusted half of checking: splitting asserts into what the sandbox
  computes and what the parent compares.
* ``values.py``: values and text from the sandbox read as hostile data, with bounds on the
  parent's work.
* ``isolation.py``: starting the child (bubblewrap or the fallback) and making sure
  nothing it started survives.
* ``cgroups.py``: per-run memory and pids cgroups, where the caller may create them.
* ``child.py``: the program that runs inside the sandbox, passed to the interpreter as
  text (stdlib only; never imported).
* ``guards.py``: the fallback's in-process guards, also executed as text inside the child.

Only the names below are for the rest of the library; the modules' other names serve the
sandbox itself and its tests.
"""

from __future__ import annotations

from tosca_mlmt.tasks.sandbox.checks import Planner
from tosca_mlmt.tasks.sandbox.isolation import MODE_BWRAP, MODE_FALLBACK
from tosca_mlmt.tasks.sandbox.run import (run_python, sandbox_fingerprint, sandbox_mode, SANDBOX_VERSION,
                                          SandboxResult, SandboxWarning)
from tosca_mlmt.tasks.sandbox.values import clean_text

__all__ = ["MODE_BWRAP", "MODE_FALLBACK", "Planner", "SANDBOX_VERSION", "SandboxResult", "SandboxWarning", "clean_text",
           "run_python", "sandbox_fingerprint", "sandbox_mode"]
