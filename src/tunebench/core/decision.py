"""One row of a settings table. At the bottom of the package: hardware, the run's plan, the measured
decisions (tune/) and the jobs all make rows of this one type, and import it from here."""

from __future__ import annotations

from typing import Any, NamedTuple


class Decision(NamedTuple):
    """One row of a run's settings table: every decision, measured or planned, is one of these."""

    setting: str
    value: Any
    reason: str


_NONE = object()


def value_of(decisions, setting: str, default: Any = _NONE) -> Any:
    """The value of the row named `setting` in a table of decisions: a machine's plan (machine.hardware.Plan), a
    run's (training.runplan.RunPlan); `default` where there is none, else KeyError."""
    for d in decisions:
        if d.setting == setting:
            return d.value
    if default is _NONE:
        raise KeyError(f"no '{setting}' row among {', '.join(d.setting for d in decisions)}")
    return default
