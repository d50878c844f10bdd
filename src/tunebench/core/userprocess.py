"""A user's Python file run in a process of its own, its functions called there under a time limit that holds.

What a GRPO environment's tools, reset and reward run in (training/grpo/environment.py), and a --reward file's
function (training/grpo/rewards.py). A call in a thread of the
training process (what this replaced) could not be stopped: a thread cannot be killed, and a function stuck in a C
call that holds the GIL (a regular expression backtracking, a huge integer power) kept the whole training process
from running, its time limit, Ctrl-C and SIGTERM included. Here each call is a message to a child process that ran
the file's same bytes (core/userfile.py: those that were hashed); the caller waits for the answer under the limit,
and past it kills the child (SIGKILL) and starts a new one from those bytes. The module's state starts afresh, and
the instances the child held (`new`: ENVIRONMENT's, one an episode) are lost with it: a Remote of one of them then
answers {"lost": True}.

Written by hand rather than with multiprocessing or concurrent.futures: a spawned multiprocessing child imports the
parent's __main__ (the CLI, torchrun's entry, pytest), a forked one copies a process with OpenMP threads running,
and a ProcessPoolExecutor cannot kill one stuck call (the whole pool breaks). The child is a fresh interpreter that
imports only this module, core/childenv.py and core/userfile.py (0.1 s; the user's file imports what it needs), linked to the parent
by a socket pair that multiprocessing's Connection frames and pickles.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tunebench.core import startup
from tunebench.core.childenv import SAFE_PATH
from tunebench.core.errors import TunebenchError
from tunebench.core.userfile import UserFile

START_S = 120.0  # the child's start: the interpreter, then the user's file and its imports (torch's alone: ~7 s)
MAX_ANSWER = 64 * 1024  # characters of a tool's answer the model is given; the rest is cut in the child
MODULE = 0  # the instance id of the module's own functions (an environment of TOOLS, reset and reward)


class Host:
    """The child process that runs one user file's bytes, and the requests it answers in order."""

    def __init__(self, source: bytes, path: str, module_name: str):
        self.source, self.path, self.module_name = source, path, module_name
        self.generation = 0  # one more at each start: an instance made by an earlier child is lost
        self.restarts = 0
        self._dropped: list[int] = []
        self._state: dict[str, Any] = {}  # the child and its connection, for the finalizer (which must not hold self)
        self._start()
        weakref.finalize(self, _stop, self._state)

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        package = str(Path(__file__).resolve().parents[2])  # the folder holding tunebench, for a source checkout
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen(
            # safe path: `python -c` would put the current folder first on sys.path, ahead of tunebench itself
            [sys.executable, *SAFE_PATH, "-c", "import sys; from tunebench.core.userprocess import serve; serve(*sys.argv[1:])",
             str(theirs.fileno()), self.path, self.module_name, str(os.getpid())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)  # a process group of its own: _stop ends what its tools started with it
        theirs.close()
        conn = Connection(ours.detach())
        conn.send_bytes(self.source)
        self._state.update(proc=proc, conn=conn)
        self.generation += 1
        self._dropped.clear()  # the new child holds no instance
        # ready once the file has run there: its imports are no call's time, and a restart's never the next call's
        ready = conn.recv() if conn.poll(START_S) else ("error", "TimeoutError", f"no answer within {START_S:g} s")
        if ready[0] != "ok":
            _stop(self._state)
            raise TunebenchError(f"{self.path} did not run in a process of its own ({ready[1]}: {ready[2]}); its top "
                                 "level must run the same each time it is imported")

    def restart(self) -> None:
        _stop(self._state)
        self.restarts += 1
        self._start()

    def ask(self, request: tuple, limit_s: float | None) -> tuple | None:
        """The child's answer to `request`: ("ok", value) or ("error", type name, text); None when it gave none
        within `limit_s` (the child is then killed and a new one started). A child that died answers an error."""
        conn = self._state["conn"]
        if self._dropped:
            dropped, self._dropped = self._dropped, []  # swapped: a finalizer may append while this sends
            conn.send(("drop", tuple(dropped)))
        try:
            conn.send(request)
            if not conn.poll(limit_s):
                self.restart()
                return None
            return conn.recv()
        except (EOFError, OSError):  # the file's own code ended its process (os._exit, a crash in C)
            code = self._state["proc"].wait()
            self.restart()
            return ("error", "EnvironmentExited", f"the environment's process ended (exit code {code}) during the call")

    def new(self, limit_s: float) -> tuple | None:
        """A new ENVIRONMENT instance in the child: ("ok", its id) or an error, as ask."""
        return self.ask(("new",), limit_s)

    def drop(self, generation: int, instance: int) -> None:
        """An episode's instance is no longer needed: freed with the next request (never sent from a finalizer,
        which may run while another message is being written)."""
        if generation == self.generation:
            self._dropped.append(instance)

    def seed(self, seed: int, limit_s: float = 60.0) -> None:
        """The child's `random`, NumPy's and torch's draws seeded (what the training process does for a step), within
        `limit_s` (a child that takes no message would hang the run without a word)."""
        if self.ask(("seed", seed), limit_s) is None:
            raise TunebenchError(f"{self.path}: the environment's process took no seed within {limit_s:g} s (it was "
                                 "restarted); a file whose imports start threads that hold the interpreter can cause it")


def _stop(state: dict[str, Any]) -> None:
    proc, conn = state.get("proc"), state.get("conn")
    if conn is not None:
        conn.close()
    if proc is not None and proc.poll() is None:
        try:  # the whole group: a tool's own subprocesses (a shell, a server it started) end with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class Remote:
    """One of the child's functions (a tool, reset or reward; of the module or of one instance), called by name."""

    def __init__(self, host: Host, instance: int, name: str, raw: bool = False):
        self.host, self.instance, self.name, self.raw = host, instance, name, raw
        self.generation = host.generation

    def within(self, limit_s: float, /, *args, **kwargs) -> dict[str, Any] | None:
        """{"value": ...} or {"error": the exception} as the call ended, None when it gave no answer in time.
        Positional-only: a model's tool call may name any argument, `limit_s` and `self` included."""
        if self.instance != MODULE and self.generation != self.host.generation:
            return {"lost": True}
        answer = self.host.ask(("value" if self.raw else "call", self.instance, self.name, args, kwargs), limit_s)
        if answer is None:
            return None
        if answer[0] == "ok":
            return {"value": answer[1]}
        return {"error": type(answer[1], (Exception,), {})(answer[2])}


def _sentinel(keep_closed: int) -> None:
    """Fork a process that kills this one's whole group once this one is gone, however it ended. The parent's
    `_stop` kills the group, but a trainer killed with -9 runs no `_stop`: this process dies of its parent-death
    signal and what a tool started (a shell, a server) lived on in the group, orphaned. The sentinel waits on a pipe
    only this process writes to (its end is closed on exec, so programs a tool starts do not hold it; a tool that
    forks without exec does, and the sentinel then waits for that fork too), reads end-of-file when it dies, and
    kills the group, itself last. Forked here, before the user's file runs: one thread, nothing of the user's."""
    read, write = os.pipe()
    if os.fork():
        os.close(read)
        return  # `write` stays open for this process's life
    os.close(write)
    os.close(keep_closed)  # the parent's socket: it must see end-of-file when this process dies
    try:
        while os.read(read, 1):
            pass
    finally:
        os.killpg(0, signal.SIGKILL)


def serve(fd: str, path: str, module_name: str, parent: str) -> None:
    """The child: run the file's bytes as a module, then answer the parent's requests until it closes the pipe."""

    # Ctrl-C is the parent's to act on (it stops us): a Python no-op, not SIG_IGN, which every program a tool
    # starts would inherit
    signal.signal(signal.SIGINT, lambda *_: None)
    startup.die_with_parent(int(parent), signal.SIGKILL)  # even from inside a call stuck in C
    _sentinel(int(fd))
    conn = Connection(int(fd))
    sys.path.append(str(Path(path).resolve().parent))  # the file's own folder, last: its sibling modules import
    try:
        module = UserFile(Path(path), conn.recv_bytes()).run(module_name)
    except Exception as e:  # noqa: BLE001 - the user's file: its error goes back to be said
        conn.send(("error", type(e).__name__, str(e)))
        return
    conn.send(("ok", None))
    owners: dict[int, Any] = {MODULE: module}
    # A module environment's tools are the functions its TOOLS lists, by their names (what the model was shown),
    # not the module's attributes of those names: TOOLS may list functions imported or made elsewhere.
    listed = {} if hasattr(module, "ENVIRONMENT") else \
        {getattr(t, "__name__", None): t for t in getattr(module, "TOOLS", None) or () if callable(t)}
    made = MODULE
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        kind = request[0]
        if kind == "drop":
            for instance in request[1]:
                owners.pop(instance, None)
            continue
        try:
            if kind == "seed":
                random.seed(request[1])
                if "numpy" in sys.modules:
                    sys.modules["numpy"].random.seed(request[1] % 2**32)
                if "torch" in sys.modules:
                    sys.modules["torch"].manual_seed(request[1])
                answer = ("ok", None)
            elif kind == "new":
                made += 1
                owners[made] = module.ENVIRONMENT()
                answer = ("ok", made)
            elif kind == "has":  # a function of that name in the module (a --reward file's)
                answer = ("ok", callable(getattr(module, request[1], None)))
            elif kind == "value":  # a function's value as it is (a --reward function's scores)
                _, instance, name, args, kwargs = request
                answer = ("ok", getattr(owners[instance], name)(*args, **kwargs))
            else:
                _, instance, name, args, kwargs = request
                tool = listed.get(name) if instance == MODULE and name not in ("reset", "reward") else None
                value = (tool or getattr(owners[instance], name))(*args, **kwargs)
                if name not in ("reset", "reward") and not isinstance(value, str):  # a tool's answer: the model's text
                    value = json.dumps(value, default=str)  # (GRPO's environments: reset and reward give values)
                if name not in ("reset", "reward") and len(value) > MAX_ANSWER:  # cut here: never sent or read whole
                    value = value[:MAX_ANSWER] + f"\n[the answer was cut at {MAX_ANSWER:,} of its {len(value):,} characters]"
                answer = ("ok", value)
        except Exception as e:  # noqa: BLE001 - the user's code: its error goes back to be said or shown
            answer = ("error", type(e).__name__, str(e))
        try:
            conn.send(answer)
        except Exception as e:  # noqa: BLE001 - a value pickle cannot send (a generator, a lock, an open file)
            conn.send(("error", type(e).__name__, f"its value ({type(answer[1]).__name__}) cannot be sent back to the "
                                                  f"training process: {e}; return text, numbers, lists or dicts"))

