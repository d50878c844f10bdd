"""GRPO's reward functions: the verifiable ones built in, and a user's own Python function.

A reward is named by a spec, given once per `--reward` (TRL's reward_funcs), each with its weight
(`--reward-weights`, TRL's reward_weights, default 1 each):
- `gsm8k[:COLUMN]`: 1 when the completion's final number equals the reference's (the row's COLUMN, default
  `answer`), as the task metric reads both (quality.final_answer: what follows `####`, else the last number);
- `format:REGEX`: 1 when the completion matches REGEX (a search, DOTALL: anchor it with ^ and $ to match the
  whole completion), by the `regex` module under a time limit (PATTERN_S: past it, 0; `re` has none, and a
  nested repetition on one completion can run for hours);
- `exact[:COLUMN]`, `contains[:COLUMN]`: 1 when the stripped completion equals the reference, or holds it;
- `path/to/file.py:function`: the function, called as TRL calls one, `fn(prompts=..., completions=..., **columns)`
  (the row's other columns as lists, one item a completion), returning a float (or None: no opinion) for each
  completion. It runs in a process of its own under a time limit, as an environment's reward does
  (core/userprocess.py; CALL_S): one that hangs ends the run in one line instead of hanging it.
Each is checked before any model loads: a column the data lacks, a regex that does not compile, a file or
function that is not there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunebench.core.errors import TunebenchError
from tunebench.core.userfile import UserFile
from tunebench.core.userprocess import MODULE, Host, Remote
from tunebench.model.quality import final_answer

BUILT_IN = ("gsm8k", "format", "exact", "contains")
PATTERN_S = 1.0  # a format: regex's search on one completion
CALL_S = 60.0  # a --reward function's call on one step's completions (an environment's reward has the same)


@dataclass(frozen=True)
class Reward:
    name: str  # as metrics name it: rewards/<name>/mean
    weight: float
    score: Callable[[list[str], list[str], dict[str, list[Any]]], list[float | None]]  # (prompts, completions, columns)
    column: str | None = None  # the reference column it reads


def parse(specs: Sequence[str], weights: Sequence[float] | None, read: dict[str, UserFile] | None = None
          ) -> list[Reward]:
    """The rewards of `specs` with their weights (one each, as the GRPO settings' check has made sure); refused
    with the fix when one cannot be built. `read`: the user's files as `files` read and hashed them, run as
    they are (else read here)."""
    weights = list(weights) if weights else [1.0] * len(specs)
    rewards = [one(spec, float(w), read or {}) for spec, w in zip(specs, weights)]
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        raise TunebenchError(f"--reward names one reward twice ({', '.join(names)}); give each once, with its weight")
    return rewards


def one(spec: str, weight: float, read: dict[str, UserFile]) -> Reward:
    kind, _, arg = spec.partition(":")
    if not math.isfinite(weight):
        raise TunebenchError(f"--reward-weights {weight} for {spec} is not a number; give a finite weight")
    if kind == "gsm8k":
        column = arg or "answer"
        return Reward("gsm8k", weight, lambda p, c, cols: [
            float(final_answer(x) is not None and final_answer(x) == final_answer(str(ref)))
            for x, ref in zip(c, cols[column])], column)
    if kind == "format":
        if not arg:
            raise TunebenchError("--reward format needs its regex: format:REGEX, e.g. 'format:^<think>.*</think>'")
        import regex

        try:
            pattern = regex.compile(arg, regex.DOTALL)
        except regex.error as e:
            raise TunebenchError(f"--reward {spec}: the regex does not compile ({e}); fix the pattern") from None
        return Reward("format", weight, lambda p, c, cols: [float(_matches(pattern, x)) for x in c])
    if kind in ("exact", "contains"):
        column = arg or "answer"
        test = (lambda x, ref: x.strip() == ref.strip()) if kind == "exact" else (lambda x, ref: ref.strip() in x)
        return Reward(kind, weight, lambda p, c, cols: [float(test(x, str(ref))) for x, ref in zip(c, cols[column])],
                      column)
    return user_function(spec, weight, read.get(str(Path(spec.rpartition(":")[0]).resolve())))


def files(specs: Sequence[str]) -> dict[str, UserFile]:
    """{resolved path: its file read} of the user's reward files among `specs`, read without running them: a run
    records their hashes, and a resume refuses a file that changed since (the function would run other code than
    the run trained with) before it runs; `parse` then runs these bytes."""
    out = {}
    for spec in specs:
        path = spec.rpartition(":")[0]
        if spec.partition(":")[0] not in BUILT_IN and path.endswith(".py") and Path(path).is_file():
            out[str(Path(path).resolve())] = UserFile.read(path)
    return out


def user_function(spec: str, weight: float, file: UserFile | None = None) -> Reward:
    """`path/to/file.py:function`, loaded from the file (not from an installed package)."""
    path, _, name = spec.rpartition(":")
    if not path or not name or not path.endswith(".py"):
        raise TunebenchError(f"--reward {spec!r:.80} is not one of {', '.join(BUILT_IN)} nor path/to/file.py:function; "
                             "name a built-in reward or a Python file and the function in it")
    if file is None and not Path(path).is_file():
        raise TunebenchError(f"--reward {spec}: no file {path}; give the path of the Python file that defines {name}")

    file = file or UserFile.read(path)
    try:  # the file runs in a process of its own (the user's code: its errors are theirs to see, in one line)
        host = Host(file.source, str(file.path.resolve()), f"tunebench_reward_{Path(path).stem}")
    except TunebenchError as e:
        raise TunebenchError(f"--reward {spec}: {e}") from None
    has = host.ask(("has", name), CALL_S)
    if has != ("ok", True):
        raise TunebenchError(f"--reward {spec}: {path} has no function {name}; define def {name}(prompts, "
                             "completions, **kwargs) returning one float per completion")
    fn = Remote(host, MODULE, name, raw=True)

    def score(prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> list[float | None]:
        box = fn.within(CALL_S, prompts=prompts, completions=completions, **columns)
        if box is None:
            raise TunebenchError(f"reward {name} ({path}) gave no answer within {CALL_S:g} s on "
                                 f"{len(completions)} completions (its process was stopped); it must return")
        if "error" in box:
            e = box["error"]
            raise TunebenchError(f"reward {name} ({path}) raised {type(e).__name__}: {e}")
        values = box["value"]
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            raise TunebenchError(f"reward {name} returned {type(values).__name__} of "
                                 f"{len(values) if hasattr(values, '__len__') else '?'} item(s) for "
                                 f"{len(completions)} completions; return one float (or None) per completion")
        return [None if v is None else float(v) for v in values]

    return Reward(name, weight, score)


def _matches(pattern, text: str) -> bool:
    """Whether `pattern` finds a match in `text` within PATTERN_S; one that cannot decide in time does not."""
    try:
        return pattern.search(text, timeout=PATTERN_S) is not None
    except TimeoutError:
        return False


def check_columns(rewards: list[Reward], columns: set[str], source: str) -> None:
    for r in rewards:
        if r.column is not None and r.column not in columns:
            raise TunebenchError(f"--reward {r.name} reads the reference column '{r.column}', and '{source}' has "
                                 f"{', '.join(sorted(columns))}; give {r.name}:COLUMN with the column holding the "
                                 "reference")
