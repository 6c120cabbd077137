"""What keeps one case from affecting the next, or outliving the harness.

* Global state: every job starts from :func:`reset` (grad mode on, float32 default dtype, seeded RNGs,
  one thread, deterministic algorithms off, anomaly detection off, the rank's starting directory);
  :func:`drift` names whatever a job left changed, and the case is reported for it.
* Process trees: a rank is a child subreaper (what an operator spawns stays its descendant) and
  kills its descendants after every job (:func:`kill_tree`); it dies with its parent
  (``PR_SET_PDEATHSIG``) and a watchdog thread ends it when the harness process is gone, however
  the harness died (the forkserver, not the harness, is a rank's parent).
* Memory: :func:`rss_mb` reads a process's resident set from ``/proc`` for the gang's memory cap.

Linux only (``prctl``, ``/proc``); elsewhere these degrade to no-ops and plain kills.
"""
from __future__ import annotations

import ctypes
import os
import random
import signal
import threading
import time

import torch

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def reset(seed: int, cwd: str) -> None:
    """Put this process in the known state every case starts from."""
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    if torch.are_deterministic_algorithms_enabled():  # setting it costs tens of ms: only when changed
        torch.use_deterministic_algorithms(False)
    if torch.is_anomaly_enabled():
        torch.autograd.set_detect_anomaly(False)
    torch.default_generator.manual_seed(seed)  # torch.manual_seed also probes every accelerator: ms per call
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)
    os.chdir(cwd)


def drift(cwd: str) -> list[str]:
    """What differs from the state :func:`reset` establishes (empty when nothing leaked)."""
    out = []
    if not torch.is_grad_enabled():
        out.append("gradient mode disabled")
    if torch.is_inference_mode_enabled():
        out.append("inference mode enabled")
    if torch.get_default_dtype() != torch.float32:
        out.append(f"default dtype {torch.get_default_dtype()}")
    if torch.get_num_threads() != 1:
        out.append(f"{torch.get_num_threads()} threads")
    if torch.are_deterministic_algorithms_enabled():
        out.append("deterministic algorithms enabled")
    if torch.is_anomaly_enabled():
        out.append("anomaly detection enabled")
    try:
        here = os.getcwd()
    except OSError:
        here = "<deleted>"
    if here != cwd:
        out.append(f"working directory {here}")
    return out


def prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def children(pid: int) -> list[int]:
    """Direct children of ``pid``, whichever of its threads started them (from ``/proc``)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``, parents before children."""
    out, todo = [], children(pid)
    while todo:
        c = todo.pop(0)
        out.append(c)
        todo += children(c)
    return out


def kill_tree(pid: int, include_self: bool = False) -> int:
    """SIGKILL the descendants of ``pid`` (and ``pid`` itself if asked); reap our own children.
    Returns how many processes were killed."""
    victims = descendants(pid) + ([pid] if include_self else [])
    for p in victims:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    if pid == os.getpid():  # reap what we can (a subreaper inherits orphaned grandchildren)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                reaped, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if reaped == 0:
                if not children(pid):
                    break
                time.sleep(0.01)
    return len(victims)


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def bind_to_parent(harness_pid: int, poll_s: float = 0.5) -> None:
    """Die with the parent process (parent-death signal) and with the harness process ``harness_pid``
    (a watchdog thread), taking this process's descendants along."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_CHILD_SUBREAPER, 1)

    def watch():
        while _alive(harness_pid):
            time.sleep(poll_s)
        kill_tree(os.getpid())
        os._exit(1)

    threading.Thread(target=watch, name="harness-watchdog", daemon=True).start()
