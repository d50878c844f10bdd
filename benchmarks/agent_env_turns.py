"""benchmarks/agent_env.py's towns and tools with a per-turn reward (`--environment benchmarks/agent_env_turns.py`):
each call a question needs, made in its place with the right arguments, pays 1 / (2 x the calls it needs) at its
turn, and the answer pays 1 when right, so the calls are credited to the turns that made them. (The episode-level
reward pays only the answer, and GRPO from the benchmark's start learned to answer after one lookup.)"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_env import TOOLS, correct, reset  # noqa: E402,F401  (the same towns, tools and opening)


def _same_call(function: dict, want: list) -> bool:
    """Whether a call ({name, arguments}) is the needed one: the same tool, the same argument names, equal values."""
    name, args = want
    given = function.get("arguments")
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except ValueError:
            return False
    if function.get("name") != name or not isinstance(given, dict) or set(given) != set(args):
        return False
    try:
        return all(given[k] == v if isinstance(v, str) else float(given[k]) == float(v) for k, v in args.items())
    except (TypeError, ValueError):
        return False


def reward(messages, row):
    needed = row["calls"]
    turns = [m for m in messages if m["role"] == "assistant"]
    made, paid = 0, []
    for t, message in enumerate(turns):
        if message.get("tool_calls"):
            pay = 0.0
            for call in message["tool_calls"]:
                if made < len(needed) and _same_call(call.get("function", call), needed[made]):
                    pay += 1 / (2 * len(needed))
                made += 1
            paid.append(pay)
        else:
            paid.append(float(t == len(turns) - 1 and correct(message["content"], row["answer"])))
    return paid
