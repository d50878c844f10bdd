"""Does a small model learn to use tools by doing: SmolLM2-135M-Instruct first taught the tools' call form by
tool-call SFT, then trained by GRPO in an environment whose answers can only be had through the tools
(temperatures of made-up towns; a question about two towns needs two calls and the sum). Held-out questions ask
about towns that never appear in training, SFT or GRPO. Prints, for the SFT model and after GRPO, the held-out
greedy episodes' success, the calls with exactly the expected arguments, calls per episode, the calls that
failed, and the training wall times on this machine.

    python benchmarks/agent_rl.py [--sft-rows 240] [--grpo-steps 40] [--out DIR]   # 40 steps: ~30 min on 2 cores
    python benchmarks/agent_rl.py --sft-rows 24 --grpo-steps 2 --held-out 4    # a smoke run of every stage
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

# Made-up towns, split: SFT and GRPO ask about the first part, the held-out questions only about the second
TOWNS = ["Arlen", "Brisco", "Caddo", "Dunmore", "Elkin", "Farwell", "Gansett", "Holloway", "Ivydale", "Jessup",
         "Kenmare", "Lamont", "Marlow", "Nesbit", "Orrin", "Pelham", "Quimby", "Rosalind", "Sutter", "Tolland",
         "Ulster", "Vinton", "Wexley", "Yardley", "Zenda", "Alcott", "Barlow", "Corbin", "Delray", "Eastham",
         "Fenwick", "Gilroy", "Harlan", "Ingram", "Juniper", "Keswick"]
HELD = 12  # the last 12 towns
SYSTEM = "Use the tools to find the answer, then give the number alone."
ENV = '''"""The benchmark's environment (written by benchmarks/agent_rl.py)."""

TEMPERATURES = {temperatures!r}


def temperature(town: str) -> int:
    """Today's temperature in a town, in degrees Celsius.

    Args:
        town: the town's name
    """
    return TEMPERATURES[town]


def add(a: float, b: float) -> float:
    """The sum of two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


TOOLS = [temperature, add]


def reset(row):
    return [{{"role": "system", "content": {system!r}}}, {{"role": "user", "content": row["question"]}}]


def reward(messages, row):
    last = messages[-1]
    return float(last["role"] == "assistant" and not last.get("tool_calls") and row["answer"] == last["content"].strip())
'''


def temperatures(seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    return {t: rng.randint(-9, 35) for t in TOWNS}


def question(rng: random.Random, towns: list[str], temps: dict[str, int], two: bool) -> dict:
    if two:
        a, b = rng.sample(towns, 2)
        return {"question": rng.choice(["What is the temperature in {a} plus the temperature in {b}?",
                                        "Add the temperatures of {a} and {b}."]).format(a=a, b=b),
                "answer": str(temps[a] + temps[b]), "towns": [a, b]}
    a = rng.choice(towns)
    return {"question": rng.choice(["What is the temperature in {a}?", "How warm is it in {a} today?",
                                    "Temperature in {a}, please."]).format(a=a), "answer": str(temps[a]),
            "towns": [a]}


def sft_row(q: dict, temps: dict[str, int], tools: list[dict]) -> dict:
    """The episode a perfect agent plays, as an OpenAI chat row: the calls, their results, the answer."""
    def call(name, args):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}}]}

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q["question"]}]
    for town in q["towns"]:
        messages += [call("temperature", {"town": town}), {"role": "tool", "content": str(temps[town])}]
    if len(q["towns"]) == 2:
        a, b = (temps[t] for t in q["towns"])
        messages += [call("add", {"a": a, "b": b}), {"role": "tool", "content": json.dumps(float(a + b))}]
    messages.append({"role": "assistant", "content": q["answer"]})
    return {"messages": messages, "tools": tools}


def write(out: Path, sft_rows: int, grpo_rows: int, held_out: int, seed: int = 0) -> dict[str, Path]:
    from tunebench.training.grpo import environment

    out.mkdir(parents=True, exist_ok=True)
    temps = temperatures(seed)
    (out / "env.py").write_text(ENV.format(temperatures=temps, system=SYSTEM))
    tools = environment.load(str(out / "env.py"), 10).schemas
    rng = random.Random(seed)
    seen, unseen = TOWNS[:-HELD], TOWNS[-HELD:]
    files = {"env": out / "env.py", "sft": out / "sft.jsonl", "grpo": out / "grpo.jsonl", "held": out / "held.jsonl"}
    rows = {"sft": [sft_row(question(rng, seen, temps, rng.random() < 0.3), temps, tools) for _ in range(sft_rows)],
            "grpo": [question(rng, seen, temps, rng.random() < 0.5) for _ in range(grpo_rows)],
            "held": [question(rng, unseen, temps, i % 2 == 1) for i in range(held_out)]}
    for name, items in rows.items():
        files[name].write_text("".join(json.dumps(r) + "\n" for r in items))
    return files


def episodes_of(model: str | None, adapter: str | None, files: dict[str, Path], max_turns: int) -> dict:
    """Greedy episodes of every held-out question: success, exact calls, calls per episode, failed calls."""
    from tunebench.data.readers import read_records
    from tunebench.model import inference
    from tunebench.training.grpo import environment, episodes

    env = environment.load(str(files["env"]), 10)
    records = read_records(str(files["held"]))
    played = episodes.play(inference.load(model, adapter), env, records, max_turns)
    wins = [environment.score(env, e.messages, records[e.key]) for e in played]
    exact = expected = 0
    for e in played:
        asked = [m["tool_calls"][0]["function"] for m in e.messages if m.get("tool_calls")]
        want = [{"name": "temperature", "arguments": {"town": t}} for t in records[e.key]["towns"]]
        expected += len(want)
        exact += sum(w in asked for w in want)
    calls = sum(e.calls for e in played)
    return {"success": 100 * sum(w or 0.0 for w in wins) / len(played), "exact_calls": 100 * exact / expected,
            "calls_per_episode": calls / len(played),
            "failed_calls": 100 * (calls - sum(e.calls_ok for e in played)) / calls if calls else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft-rows", type=int, default=240)
    p.add_argument("--grpo-rows", type=int, default=200)
    p.add_argument("--held-out", type=int, default=40)
    p.add_argument("--grpo-steps", type=int, default=40, help="GRPO's steps (--time-budget needs a step speed the probe "
                   "cannot measure for GRPO, whose steps also sample)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None)
    p.add_argument("--check-args", action="store_true", help="parse the arguments and imports, run nothing")
    args = p.parse_args()
    if args.check_args:
        from harness import check_imports
        check_imports(__file__)
        return
    from tunebench.interfaces import cli
    from tunebench.model import models

    model = args.model or models.SMOLLM2
    out = Path(args.out or tempfile.mkdtemp(prefix="agent-rl-"))
    files = write(out / "data", args.sft_rows, args.grpo_rows, args.held_out)
    began = time.perf_counter()
    if (out / "sft-merged" / "config.json").is_file():  # a run cut after its SFT stage goes on from it
        print(f"reusing the SFT stage in {out}")
    elif cli.main(["train", "--model", model, "--data", str(files["sft"]), "--output-dir", str(out / "sft"),
                   "--epochs", "2", "--max-length", "1024", "--eval-fraction", "0", "--no-progress", "--lr", "1e-3",
                   "--lora-r", "16", "--lora-alpha", "32", "--target-modules", "all-linear"]) or \
            cli.main(["merge", "--adapter", str(out / "sft"), "--output-dir", str(out / "sft-merged")]):
        sys.exit(1)
    sft_s = json.loads((out / "sft" / "summary.json").read_text())["train_time_s"]
    before = episodes_of(str(out / "sft-merged"), None, files, args.max_turns)
    began = time.perf_counter()
    if cli.main(["train", "--method", "grpo", "--model", str(out / "sft-merged"), "--environment", str(files["env"]),
                 "--data", str(files["grpo"]), "--num-generations", str(args.num_generations),
                 "--max-completion-length", "48", "--max-turns", str(args.max_turns), "--max-length", "1024",
                 "--effective-batch-size", "4", "--eval-fraction", "0", "--lr", "2e-4", "--temperature", "1.0",
                 "--no-progress", "--output-dir", str(out / "grpo"), "--max-steps", str(args.grpo_steps)]):
        sys.exit(1)
    grpo_s = time.perf_counter() - began
    after = episodes_of(None, str(out / "grpo"), files, args.max_turns)
    summary = json.loads((out / "grpo" / "summary.json").read_text())
    print(f"\n{args.sft_rows} SFT rows ({sft_s:.0f} s in the loop), then GRPO: {summary['steps']} steps of "
          f"{args.num_generations} episodes a prompt, 4 prompts a step, in {grpo_s:.0f} s wall; {args.held_out} "
          f"held-out questions about towns no training row names, half of them needing two calls and a sum")
    keys = ("success", "exact_calls", "calls_per_episode", "failed_calls")
    print("| model | success % | exact calls % | calls / episode | failed calls % |\n|---|---|---|---|---|")
    for label, s in (("SFT", before), ("SFT + GRPO", after)):
        print(f"| {label} | " + " | ".join(f"{s[k]:.1f}" if k != "calls_per_episode" else f"{s[k]:.2f}" for k in keys)
              + " |")
    print(f"runs and data: {out}")


if __name__ == "__main__":
    main()
