"""One row of a settings table. At the bottom of the package: hardware, the run's plan, the measured
decisions (tune/) and the jobs all make rows of this one type, and import it from here."""

from __future__ import annotations

from typing import Any, NamedTuple


class Decision(NamedTuple):
    """One row of a run's settings table: every decision, measured or planned, is one of these."""

    setting: str
    value: Any
    reason: str
