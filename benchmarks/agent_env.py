"""The environment of benchmarks/agent_rl.py (`--environment benchmarks/agent_env.py`): made-up towns whose
populations only the tools know. A town's population is derived from its name (a hash), and every question
names towns drawn afresh, so nothing can be memorised: each answer needs the calls, copied exactly, and the
arithmetic on their results."""

import hashlib

SYSTEM = "Use the tools to find the answer, then reply with the answer alone: a number, or a town's name."


def population_of(town: str) -> int:
    """What the `population` tool answers (10-99), from the name alone."""
    return int(hashlib.sha256(town.encode()).hexdigest(), 16) % 90 + 10


def population(town: str) -> int:
    """The population of a town, in thousands.

    Args:
        town: the town's name
    """
    return population_of(town)


def add(a: float, b: float) -> float:
    """The sum of two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def subtract(a: float, b: float) -> float:
    """The first number less the second.

    Args:
        a: the number to subtract from
        b: the number to subtract
    """
    return a - b


TOOLS = [population, add, subtract]


def reset(row):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["question"]}]


def correct(text: str, answer: str) -> bool:
    """A reply is right when it is the answer alone: the same number (57 or 57.0), or the town's name."""
    text = text.strip().rstrip(".").strip()
    try:
        return float(text) == float(answer)
    except ValueError:
        return text == answer


def reward(messages, row):
    last = messages[-1]
    return float(last["role"] == "assistant" and not last.get("tool_calls") and correct(last["content"], row["answer"]))
