"""How a run stops on a signal: Ctrl-C or SIGTERM inside the loop finishes the step and saves (StopRequest, every
rank at the same step), outside it (loading, measuring, the summary) the job says in one line what it leaves
(job, Phase)."""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable

from tunebench.core import runlock, startup
from tunebench.core.errors import TunebenchError


class Phase:
    """Whether this process's run has reached its training loop: what a stop outside the loop's own handling
    has to say (StopRequest handles it inside); and the signal `job`'s handler raised for, kept because the raise
    can land where Python swallows it (a finalizer, an at-fork hook, a thread's start: "Exception ignored in ..."),
    and the run went on as if never asked to stop (raise_if_signalled looks again)."""

    loop_started = False
    signalled: str | None = None


def raise_if_signalled() -> None:
    """Raise again the stop `job`'s handler raised, where that raise was swallowed: called between a run's stages
    and before its loop takes the signals over."""
    if Phase.signalled:
        raise _stopped(Phase.signalled)


def _stopped(name: str) -> TunebenchError:
    if Phase.loop_started:
        return TunebenchError(f"{name} after training: the run's last checkpoint is kept; rerun with --resume auto "
                              "to finish its evaluation and files", 130)
    return TunebenchError(f"{name} before the first training step (loading or measuring): nothing was trained and no "
                          "checkpoint written; start the run again to train", 130)


def job(run: Callable) -> Callable:
    """A training job's entry point: Ctrl-C or SIGTERM outside the loop (loading, measuring, the evaluation
    before it, the summary after it) stops the run with one line that says what it leaves, exit 130 as a
    stopped run; and every run directory lock it took is let go however it ends (runlock.released)."""
    @functools.wraps(run)
    def guarded(*args, **kwargs):
        def on_signal(signum, frame):
            startup.note_signal()
            Phase.signalled = signal.Signals(signum).name
            raise _stopped(Phase.signalled)

        Phase.loop_started, Phase.signalled = False, None
        main = threading.current_thread() is threading.main_thread()  # signal handlers: the main thread's only
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            return runlock.released(run)(*args, **kwargs)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    return guarded


class StopRequest:
    """Ctrl-C or SIGTERM asks the loop to stop after this step and save a checkpoint. A second Ctrl-C (a person
    at a terminal, more than a second after the first) aborts without it; SIGTERM never does: it is what a
    process manager or the studio's Stop sends, and a second Stop click must not throw away the checkpoint
    being written (the only one, with the studio's defaults)."""

    def __init__(self, rank: int | None = None):
        self.requested, self.at, self.rank = False, 0.0, rank

    def on_signal(self, signum, frame) -> None:
        startup.note_signal()
        # torchrun passes the terminal's Ctrl-C on to its workers, which got it already: a repeat within a
        # second is the same request, not the second one that aborts.
        if self.requested:
            if signum == signal.SIGINT and time.monotonic() - self.at > 1.0:
                raise KeyboardInterrupt
            return
        self.requested, self.at = True, time.monotonic()
        again = " (Ctrl-C again to abort)" if signum == signal.SIGINT else ""
        print(f"\n{signal.Signals(signum).name}" + (f" (rank {self.rank})" if self.rank is not None else "")
              + f": saving a checkpoint after this step{again}", flush=True)
