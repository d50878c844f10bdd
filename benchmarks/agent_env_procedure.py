"""benchmarks/agent_env.py's towns and tools with a reward that charges a wrong procedure (`--environment
benchmarks/agent_env_procedure.py`): the right answer pays 1; a wrong one pays 0 after as many calls as the question
needs and -0.5 after fewer (an answer given too soon) or more (a call the question did not need). GRPO from the
benchmark's start, rewarded by the answer alone, learned one procedure for every question (a single lookup, or a
lookup then `add`): a wrong answer cost the same whether the model tried the question's calls or skipped them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_env import TOOLS, correct, reset  # noqa: E402,F401  (the same towns, tools and opening)

PROCEDURE = -0.5  # a wrong answer after another number of calls than the question needs


def reward(messages, row):
    last = messages[-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and correct(last["content"], row["answer"]):
        return 1.0
    made = sum(len(m.get("tool_calls") or ()) for m in messages if m["role"] == "assistant")
    return 0.0 if made == len(row["calls"]) else PROCEDURE
