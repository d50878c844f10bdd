"""A built-in environment (`--environment builtin:lookup`): questions about the temperatures of made-up towns,
which no model knows, so the only way to the answer is the `temperature` tool; questions about two towns need
two calls and the `add` tool. Rows: {"question": ..., "answer": ...} (`rows()` below writes
some; docs/tutorials/agents.md shows how).

The reward is 1 when the last message is the model's answer (no call) and holds the right number, else 0.
"""

TOWNS = {"Arlen": 17, "Brisco": 4, "Caddo": 23, "Dunmore": 9, "Elkin": 31, "Farwell": 12, "Gansett": 6,
         "Holloway": 27, "Ivydale": 15, "Jessup": 2, "Kenmare": 19, "Lamont": 8}


def temperature(town: str) -> int:
    """Today's temperature in a town, in degrees Celsius.

    Args:
        town: the town's name, as the question writes it
    """
    if town not in TOWNS:
        raise KeyError(f"no town named {town!r}")
    return TOWNS[town]


def add(a: float, b: float) -> float:
    """The sum of two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


TOOLS = [temperature, add]


def reset(row: dict) -> list[dict]:
    return [{"role": "system", "content": "Use the tools to find the answer, then give the number alone."},
            {"role": "user", "content": row["question"]}]


def reward(messages: list[dict], row: dict) -> float:
    last = messages[-1]
    if last["role"] != "assistant" or last.get("tool_calls"):
        return 0.0
    return float(str(row["answer"]) in last["content"])


def rows(towns: list[str] | None = None) -> list[dict]:
    """Questions over `towns` (default all): one per town, and one per neighbouring pair asking for the sum."""
    towns = towns or list(TOWNS)
    one = [{"question": f"What is the temperature in {t}?", "answer": str(TOWNS[t])} for t in towns]
    two = [{"question": f"What is the temperature in {a} plus the temperature in {b}?",
            "answer": str(TOWNS[a] + TOWNS[b])} for a, b in zip(towns, towns[1:])]
    return one + two
