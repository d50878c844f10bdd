"""An environment for multi-turn GRPO: a Python file the user writes, in the shape TRL's users know.

    TOOLS = [lookup, add]                  # plain functions, type-hinted, with Google-style docstrings
    def reset(row) -> list[dict]: ...      # the opening messages (OpenAI form) from a data row, every column given
    def reward(messages, row) -> float: ...  # the finished episode's score

Each tool's JSON schema is made from its signature and docstring by transformers' get_json_schema (what
apply_chat_template(tools=[fn]) does). A call runs in the environment's own process (core/userprocess.py: the
file's same bytes, run again there) under a time limit that holds even for a call stuck in C: a tool that raises,
runs past it (its process is then killed and started afresh), is not offered, or gets arguments its schema refuses
answers the model with an error text (the episode goes on; a reward may penalise it). Everything here is checked
when the file is loaded, before any model loads.
A tool whose answers are random is the user's to seed: tunebench seeds Python's `random`, numpy and torch in the
environment's process per step (episodes.Episodes.draw), which makes a tool drawing from those reproducible on
resume.

An environment with state (a shopping cart, a file system, a game) gives a class instead, as TRL's
`environment_factory` does: one instance an episode, its public methods the tools.

    class Cart:
        def reset(self, row) -> list[dict]: ...        # sets this episode's state; the same messages as for the row
        def add(self, item: str, n: int) -> str: ...   # a tool: type-hinted, documented (every public method but
        def reward(self, messages, row) -> float: ...  # reset and reward)
    ENVIRONMENT = Cart                                 # a class, or any function making a new instance

An episode ends by the first stop rule that fires (episodes.Stops: the model answered, its reply was cut, its last
turn called, no room for the results); an environment adds its own as STOPS, each a function of (messages, row)
(a method of (self, messages, row) on ENVIRONMENT, its name listed) that returns True to end the episode once a
turn's tool results are in; the step's stats give the share each rule ended (episodes/stop/NAME).

    def solved(messages, row) -> bool: ...         # e.g. the last tool result says the task is done
    STOPS = [solved]                               # (a class: STOPS = ["solved"], a method of its own)

The module-level functions are shared by every episode; an instance is its episode's alone. A tool that runs past
its limit takes the environment's process with it: the instances of the episodes still playing go too (their later
calls answer with an error text, their reward is None: no opinion).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunebench.core import userprocess
from tunebench.core.errors import TunebenchError
from tunebench.core.userfile import UserFile
from tunebench.data import readers, toolcalls

BUILT_IN = Path(__file__).resolve().parents[2] / "configs" / "environments"  # `builtin:NAME` -> NAME.py here


@dataclass(frozen=True)
class Environment:
    """What an episode talks to. From a file of module-level functions, one value every episode shares; from a file
    with an ENVIRONMENT class, `session` gives each episode its own (tools, reset and reward of a new instance).
    Each function is the environment process's (host.Remote), called with a time limit."""

    path: str
    tools: dict[str, userprocess.Remote]  # by name
    schemas: list[dict[str, Any]]  # OpenAI's tool form, as chat templates take them
    reset: userprocess.Remote  # reset(row) -> the opening messages
    reward: userprocess.Remote  # reward(messages, row) -> a float, a list of them, or None
    timeout_s: float
    host: userprocess.Host
    per_episode: bool = False  # ENVIRONMENT: one instance an episode (False: the module's functions, shared)
    stops: dict[str, userprocess.Remote] = dataclasses.field(default_factory=dict)  # its own stop rules, by name


@dataclass(frozen=True)
class ToolAnswer:
    """One call's answer to the model, and whether it ran without error."""

    text: str
    ok: bool


def resolve(spec: str) -> Path:
    """`builtin:NAME` (configs/environments/NAME.py) or a path to the user's file; refused when there is none."""
    if spec.startswith("builtin:"):
        path = BUILT_IN / f"{spec.removeprefix('builtin:')}.py"
        if not path.is_file():
            shipped = ", ".join(f"builtin:{p.stem}" for p in sorted(BUILT_IN.glob("*.py")))
            raise TunebenchError(f"--environment {spec}: no such built-in environment; shipped: {shipped}")
        return path
    path = Path(spec)
    if not path.is_file() or path.suffix != ".py":
        raise TunebenchError(f"--environment {spec} is not a Python file; give the file that defines TOOLS, reset "
                             "and reward (or builtin:lookup)")
    return path


def load(spec: str, timeout_s: float, file: UserFile | None = None) -> Environment:
    """The environment in `spec`'s file, every name checked: TOOLS a list of type-hinted, documented functions,
    reset(row) and reward(messages, row) callable with those arguments (or ENVIRONMENT's, on one instance). `file`:
    the file's bytes as read (and hashed) before, run as they are (here, to check them, and again in the
    environment's process, which runs the calls); else read here."""
    path = resolve(spec)
    file = file or UserFile.read(path)
    name = f"tunebench_environment_{path.stem}"
    try:
        module = file.run(name)
    except Exception as e:  # noqa: BLE001 - the user's file: its error, said in one line
        raise TunebenchError(f"--environment {spec} fails on import: {type(e).__name__}: {e}") from None
    if hasattr(module, "ENVIRONMENT"):
        return _of_class(spec, path, module, timeout_s, file)
    missing = [name for name in ("TOOLS", "reset", "reward") if not hasattr(module, name)]
    if missing:
        raise TunebenchError(f"--environment {spec} defines no {', '.join(missing)}; an environment gives TOOLS (a "
                             "list of functions), reset(row) and reward(messages, row), or ENVIRONMENT (a class "
                             "whose methods are reset, reward and the tools)")
    tools = module.TOOLS
    if not isinstance(tools, (list, tuple)) or not tools or not all(callable(t) for t in tools):
        raise TunebenchError(f"--environment {spec}: TOOLS must be a non-empty list of functions")
    _check_callbacks(spec, module)
    tools, schemas = _described(spec, tools)
    stops = _stop_rules(spec, module, set(tools))
    host = userprocess.Host(file.source, str(path), name)
    return _remote(Environment(str(path), tools, schemas, None, None, timeout_s, host, stops=dict.fromkeys(stops)),
                   userprocess.MODULE)


def _remote(env: Environment, instance: int) -> Environment:
    """`env` with its tools, reset and reward those of `instance` in its process."""
    return dataclasses.replace(env, tools={n: userprocess.Remote(env.host, instance, n) for n in env.tools},
                               reset=userprocess.Remote(env.host, instance, "reset"),
                               reward=userprocess.Remote(env.host, instance, "reward"),
                               stops={n: userprocess.Remote(env.host, instance, n, raw=True) for n in env.stops})


def _of_class(spec: str, path: Path, module, timeout_s: float, file: UserFile) -> Environment:
    """ENVIRONMENT's environment, checked on one instance made here: reset(row), reward(messages, row) and at least
    one tool (its public methods but those two). Module-level TOOLS, reset or reward beside it are refused: which
    one trains would be a guess."""
    both = [name for name in ("TOOLS", "reset", "reward") if hasattr(module, name)]
    if both:
        raise TunebenchError(f"--environment {spec} defines ENVIRONMENT and module-level {', '.join(both)}; give one "
                             "form: the class (one instance an episode) or the module's functions (shared)")
    factory = module.ENVIRONMENT
    if not callable(factory):
        raise TunebenchError(f"--environment {spec}: ENVIRONMENT must be a class (or a function making an "
                             f"instance); it is {type(factory).__name__}")
    instance = _instance(spec, factory)
    missing = [name for name in ("reset", "reward") if not callable(getattr(instance, name, None))]
    if missing:
        raise TunebenchError(f"--environment {spec}: ENVIRONMENT's instances have no {' or '.join(missing)} method; "
                             "give reset(self, row) and reward(self, messages, row)")
    _check_callbacks(spec, instance)
    stops = _stop_rules(spec, instance, set())
    names = [n for n in _tool_names(instance) if n not in stops]
    if not names:
        raise TunebenchError(f"--environment {spec}: ENVIRONMENT has no tools; its public methods other than reset "
                             "and reward are the tools the model calls")
    tools, schemas = _described(spec, [getattr(instance, n) for n in names])
    host = userprocess.Host(file.source, str(path), module.__name__)
    env = Environment(str(path), tools, schemas, None, None, timeout_s, host, per_episode=True,
                      stops=dict.fromkeys(stops))
    return _remote(env, _new(env))  # the instance whose reset opens the data's rows when they load


def _stop_rules(spec: str, owner: Any, tools: set[str]) -> list[str]:
    """The names of `owner`'s STOPS (the module's functions, or the instance's methods, each listed or named),
    checked: each callable with (messages, row), named once, no tool's name and no built-in rule's."""
    from tunebench.training import grpo

    listed = getattr(owner, "STOPS", ())
    if isinstance(listed, str) or not isinstance(listed, (list, tuple)):
        raise TunebenchError(f"--environment {spec}: STOPS must be a list of stop rules (functions of messages and "
                             f"row returning True to end the episode), not {type(listed).__name__}")
    names = []
    for rule in listed:
        name = rule if isinstance(rule, str) else getattr(rule, "__name__", "")
        fn = getattr(owner, name, None) if name else None
        if fn is None or not callable(fn) or not isinstance(rule, str) and getattr(fn, "__func__", fn) is not \
                getattr(rule, "__func__", rule):
            raise TunebenchError(f"--environment {spec}: STOPS lists {str(rule)[:60]!r}, which is not a function "
                                 "defined in the file under its own name (a method of ENVIRONMENT for a class)")
        if name in names or name in tools or name in grpo.EPISODE_STOPS:
            raise TunebenchError(f"--environment {spec}: stop rule {name!r} takes a name already used (by another "
                                 f"rule, a tool, or a built-in rule: {', '.join(grpo.EPISODE_STOPS)}); rename it")
        try:
            inspect.signature(fn).bind("messages", "row")
        except (TypeError, ValueError):
            raise TunebenchError(f"--environment {spec}: stop rule {name} must take (messages, row); it is "
                                 f"{name}{_signature(fn)}") from None
        names.append(name)
    return names


def _instance(spec: str, factory: Callable[[], Any]) -> Any:
    try:
        return factory()
    except Exception as e:  # noqa: BLE001 - the user's class: its error, said in one line
        raise TunebenchError(f"--environment {spec}: ENVIRONMENT() raised {type(e).__name__}: {e}; it is called "
                             "with no arguments, once an episode") from None


def _tool_names(instance: Any) -> list[str]:
    """The instance's public methods but reset and reward, in the order the class defines them."""
    found = []
    for klass in reversed(type(instance).__mro__[:-1]):  # object's own methods are no tools
        found += [n for n, v in vars(klass).items() if inspect.isfunction(v) and not n.startswith("_")
                  and n not in ("reset", "reward") and n not in found]
    return found


def session(env: Environment) -> Environment:
    """What one episode talks to: `env` itself for module functions (shared); for an ENVIRONMENT class, a new
    instance's tools, reset and reward in the environment's process (its state its own), freed there once the
    episode is dropped."""
    if not env.per_episode:
        return env
    own = _remote(env, _new(env))
    weakref.finalize(own.reset, env.host.drop, own.reset.generation, own.reset.instance)
    return own


def _new(env: Environment) -> int:
    """A new ENVIRONMENT instance in the environment's process, its id; refused in one line as _instance."""
    answer = env.host.new(CALLBACK_S)
    if answer is None:
        raise TunebenchError(f"--environment {env.path}: ENVIRONMENT() gave no answer within {CALLBACK_S:g} s; it is "
                             "called with no arguments, once an episode, and must return")
    if answer[0] != "ok":
        raise TunebenchError(f"--environment {env.path}: ENVIRONMENT() raised {answer[1]}: {answer[2]}; it is called "
                             "with no arguments, once an episode")
    return answer[1]


def _check_callbacks(spec: str, owner: Any) -> None:
    for name, wanted in (("reset", ("row",)), ("reward", ("messages", "row"))):
        fn = getattr(owner, name)
        try:
            inspect.signature(fn).bind(*wanted)
        except (TypeError, ValueError):
            raise TunebenchError(f"--environment {spec}: {name} must take ({', '.join(wanted)}); it is "
                                 f"{name}{_signature(fn)}") from None


def _described(spec: str, tools: list[Callable[..., Any]]) -> tuple[dict[str, Callable[..., Any]], list[dict]]:
    """The tools by name and their JSON schemas (transformers' get_json_schema), each name given once."""
    from transformers.utils import DocstringParsingException, TypeHintParsingException, get_json_schema

    schemas = []
    for tool in tools:
        try:
            schemas.append(get_json_schema(tool))
        except (TypeHintParsingException, DocstringParsingException) as e:
            raise TunebenchError(f"--environment {spec}: tool {getattr(tool, '__name__', tool)!r} cannot be "
                                 f"described to the model ({e}); give every argument a type hint and the function "
                                 "a docstring with an Args: line for each") from None
    names = [s["function"]["name"] for s in schemas]
    if len(set(names)) != len(names):
        raise TunebenchError(f"--environment {spec}: two tools share a name ({', '.join(names)}); name each once")
    return dict(zip(names, tools)), schemas


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return " (not a function)"


def rows(env: Environment, data) -> Any:
    """The data's rows as GRPO's prompts (data.prompts.PromptRows): each row's opening messages from reset(row),
    every column kept for reward(messages, row) and the --reward functions."""
    from tunebench.data import prompts

    if data.sources:
        raise TunebenchError("GRPO takes one dataset; give --data once (a file of rows for the environment)")
    records = readers.read_records(data.path)
    if not records:
        raise TunebenchError(f"dataset '{data.path}' has no rows; point --data at the environment's rows")
    return prompts.PromptRows([opening(env, r) for r in records], [dict(r) for r in records], data.path)


LOST = ("this episode's environment instance was lost: the environment's process was restarted after a call ran "
        "past its time limit")
CALLBACK_S = 60.0  # reset's, reward's and ENVIRONMENT()'s time limit: one stuck would hang the run without a word


def _callback(env: Environment, what: str, args: tuple, where: str = "") -> Any:
    """reset or reward run within CALLBACK_S: an exception or no answer is the user's bug, said in one line. The
    reward of an episode whose instance was lost (see the module's docstring) is None: no opinion."""
    return _callback_of(env, getattr(env, what), what, args, where)


def _callback_of(env: Environment, remote: userprocess.Remote, what: str, args: tuple, where: str = "") -> Any:
    """`remote` (reset, reward or a stop rule) run within CALLBACK_S (see _callback); a lost instance's reset is
    refused, its reward or stop rule None."""
    box = remote.within(CALLBACK_S, *args)
    if box is not None and "lost" in box:
        if what == "reset":
            raise TunebenchError(f"--environment {env.path}: {LOST}{where}")
        return None
    if box is None:
        raise TunebenchError(f"--environment {env.path}: {what} gave no answer within {CALLBACK_S:g} s{where}; it "
                             "must return (a slow check belongs in a tool, which has --tool-timeout)")
    if "error" in box:
        e = box["error"]
        raise TunebenchError(f"--environment {env.path}: {what} raised {type(e).__name__}: {e}{where}")
    return box["value"]


def opening(env: Environment, row: dict[str, Any]) -> list[dict[str, Any]]:
    """reset(row)'s opening messages, checked: a non-empty list of {role, content} with text content."""
    messages = _callback(env, "reset", (dict(row),), f" on the row {json.dumps(row, default=str)[:200]}")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
            for m in messages):
        raise TunebenchError(f"--environment {env.path}: reset must return a list of messages "
                             "[{'role': 'system'|'user', 'content': text}, ...]; it returned "
                             f"{str(messages)[:200]}")
    return [dict(m) for m in messages]


def call(env: Environment, name: str, arguments: dict[str, Any]) -> ToolAnswer:
    """One call, answered: the tool's return value as text, or an error text the model reads (a tool not offered,
    arguments its schema refuses, an exception, no answer within the time limit)."""
    if name not in env.tools:
        return ToolAnswer(f"error: no tool named {name!r}; the tools are {', '.join(env.tools)}", False)
    if not toolcalls.valid({"name": name, "arguments": arguments}, env.schemas):
        return ToolAnswer(f"error: the arguments {json.dumps(arguments)[:200]} do not fit {name}'s parameters", False)
    box = env.tools[name].within(env.timeout_s, **arguments)
    if box is None:
        return ToolAnswer(f"error: {name} gave no answer within {env.timeout_s:g} s", False)
    if "lost" in box:
        return ToolAnswer(f"error: {LOST}", False)
    if "error" in box:  # the tool's error is the model's to read
        return ToolAnswer(f"error: {type(box['error']).__name__}: {box['error']}", False)
    value = box.get("value")
    return ToolAnswer(value if isinstance(value, str) else json.dumps(value, default=str), True)


def stopped(env: Environment, messages: list[dict[str, Any]], row: dict[str, Any]) -> str | None:
    """The name of the first of the environment's own stop rules that returns True for the episode so far, or None.
    Each runs under CALLBACK_S; an exception, no answer or an answer that is not a bool stops the run in one line
    (None, a lost instance's, goes on)."""
    for name in env.stops:
        value = _callback_of(env, env.stops[name], f"stop rule {name}", ([dict(m) for m in messages], dict(row)))
        if value is not None and not isinstance(value, bool):
            raise TunebenchError(f"--environment {env.path}: stop rule {name} returned {str(value)[:60]!r}; return "
                                 "True to end the episode, False to go on")
        if value:
            return name
    return None


def score(env: Environment, messages: list[dict[str, Any]], row: dict[str, Any], turns: int = 1,
          episode: int = 0) -> float | list[float] | None:
    """reward(messages, row): a float for the episode; None (no opinion) when it returns None; or, returned as a
    list, one float per turn of the model's (`turns` of them: per-turn rewards, credited to each turn's tokens).
    An exception, or a list of another length or holding anything but numbers, is the user's bug and stops the
    run, said in one line naming the episode (`episode`, its index in the step) and the turn."""
    value = _callback(env, "reward", ([dict(m) for m in messages], dict(row)))
    if isinstance(value, (list, tuple)):
        if len(value) != turns:
            raise TunebenchError(f"--environment {env.path}: reward returned {len(value)} per-turn rewards for "
                                 f"episode {episode}, which took {turns} turn(s); return one number per turn of the "
                                 "model's, or one number for the episode")
        return [_number(env, v, f"reward of episode {episode}, turn {t + 1}") for t, v in enumerate(value)]
    return None if value is None else _number(env, value, f"reward of episode {episode}", nan=True)


def _number(env: Environment, value: Any, what: str, nan: bool = False) -> float:
    """`value` as a float, refused in one line where it is none (a NaN for the episode is no opinion, as None)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.inf
    if isinstance(value, str) or math.isinf(number) or math.isnan(number) and not nan:
        raise TunebenchError(f"--environment {env.path}: {what} is {str(value)[:60]!r}; return a finite number (or "
                             "None for no opinion on the episode)")
    return number
