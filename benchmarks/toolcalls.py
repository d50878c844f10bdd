"""Does a small model learn to call functions: a function-calling set made here (four tools with typed
arguments; held-out rows whose argument values training never saw; rows where no tool fits), SmolLM2-135M-Instruct
before and after a LoRA fine-tune on this machine. Prints the held-out scores of both (the right tool, exact
arguments, arguments valid against the tool's schema, a call exactly where one is due) and the training time.

    python benchmarks/toolcalls.py [--rows 320] [--held-out 60] [--epochs 2] [--target-modules all-linear] [--out DIR]
    python benchmarks/toolcalls.py --write DIR    # only the data: DIR/train.jsonl and DIR/heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount of money",
     "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                                     "to": {"type": "string"}},
                    "required": ["amount", "from", "to"]}}},
    {"type": "function", "function": {"name": "set_timer", "description": "Start a countdown timer",
     "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}, "label": {"type": "string"}},
                    "required": ["minutes", "label"]}}},
    {"type": "function", "function": {"name": "get_stock_price", "description": "Latest price of a stock",
     "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}},
]
# Values split in two: training rows draw from the first part, held-out rows only from the second
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Dublin", "Seoul", "Quito", "Nairobi", "Madrid", "Hanoi", "Perth",
          "Bogota", "Vienna", "Austin", "Porto", "Accra", "Riga", "Kyoto", "Denver"]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "CAD", "AUD", "SEK", "NOK", "INR", "BRL", "MXN"]
LABELS = ["tea", "pasta", "laundry", "workout", "meeting", "nap", "eggs", "oven", "bus", "study", "plants", "call"]
SYMBOLS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "IBM", "ORCL", "INTC", "NFLX", "SHOP", "UBER", "ADBE"]
CHAT = [("Hi there!", "Hello! How can I help you today?"), ("Thanks a lot.", "You're welcome!"),
        ("Tell me a joke.", "Why did the scarecrow win an award? He was outstanding in his field."),
        ("What is the capital of Italy?", "The capital of Italy is Rome."),
        ("How many days are in a week?", "There are seven days in a week."),
        ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet."),
        ("What color is the sky?", "On a clear day the sky is blue."), ("Good night!", "Good night, sleep well!")]


def _half(values: list, held: bool) -> list:
    cut = len(values) * 2 // 3
    return values[cut:] if held else values[:cut]


def _call(rng: random.Random, held: bool) -> tuple[str, dict]:
    tool = rng.choice(TOOLS)["function"]["name"]
    if tool == "get_weather":
        city = rng.choice(_half(CITIES, True)) if held else _made_up(rng, CITIES, city=True)
        unit = rng.choice(["celsius", "fahrenheit"])
        ask = rng.choice(["What's the weather in {c} in {u}?", "How warm is it in {c}? Use {u}.",
                          "Weather for {c} please, in {u}."]).format(c=city, u=unit)
        return ask, {"name": tool, "arguments": {"city": city, "unit": unit}}
    if tool == "convert_currency":
        amount = rng.choice([5, 12, 20, 45, 100, 250, 999, 1500]) + (rng.choice([0, 0.5]) if held else 0)
        src, dst = rng.sample(_half(CURRENCIES, held), 2)
        ask = rng.choice(["Convert {a} {f} to {t}.", "How much is {a} {f} in {t}?",
                          "Change {a} {f} into {t} for me."]).format(a=amount, f=src, t=dst)
        return ask, {"name": tool, "arguments": {"amount": amount, "from": src, "to": dst}}
    if tool == "set_timer":
        minutes = rng.choice(range(31, 60) if held else range(1, 31))
        label = rng.choice(_half(LABELS, True)) if held else _made_up(rng, LABELS, city=False)
        ask = rng.choice(["Set a {m} minute timer for {l}.", "Timer: {m} minutes, label it {l}.",
                          "Remind me about {l} in {m} minutes."]).format(m=minutes, l=label)
        return ask, {"name": tool, "arguments": {"minutes": minutes, "label": label}}
    # training symbols, cities and labels are made up (none of the held-out ones): a model that saw only eight
    # real tickers learns those eight; one that saw hundreds learns to copy the one asked about
    symbol = rng.choice(_half(SYMBOLS, True)) if held else _made_up_symbol(rng)
    ask = rng.choice(["What is {s} trading at?", "Price of {s} stock?", "Give me the latest {s} quote."]).format(s=symbol)
    return ask, {"name": tool, "arguments": {"symbol": symbol}}


def _made_up(rng: random.Random, real: list[str], city: bool) -> str:
    """A pronounceable made-up word (a city's, capitalized, or a timer label's), none of the real ones."""
    while True:
        word = "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.choice((2, 3))))
        word = word + rng.choice(("", "n", "r", "s")) if city else word
        if word.capitalize() not in real and word not in real:
            return word.capitalize() if city else word


def _made_up_symbol(rng: random.Random) -> str:
    while True:
        symbol = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.choice((3, 4))))
        if symbol not in SYMBOLS:
            return symbol


def rows(n: int, held: bool, seed: int) -> list[dict]:
    """`n` rows in OpenAI's fine-tuning format: one in six asks for no tool and is answered in words."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 6 == 5:
            ask, answer = rng.choice(CHAT)
            reply = {"role": "assistant", "content": answer}
        else:
            ask, call = _call(rng, held)
            reply = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]}
        out.append({"messages": [{"role": "user", "content": ask}, reply], "tools": TOOLS})
    return out


def write(out: Path, n_train: int, n_held: int) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "heldout.jsonl"
    for path, data in zip(paths, (rows(n_train, False, 0), rows(n_held, True, 1))):
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return paths


def scores(model: str | None, adapter: str | None, held: Path, out: Path, max_new_tokens: int) -> dict:
    from tunebench.jobs import evaluate
    from tunebench.settings.finetune import load_config

    data = load_config(options={"data.path": str(held), "data.max_length": 1024}).data
    return evaluate.run(model, adapter, data, generate=10**6, max_new_tokens=max_new_tokens,
                        answers=out / f"answers-{'tuned' if adapter else 'base'}.jsonl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=320)
    p.add_argument("--held-out", type=int, default=60)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="the longest held-out call is 50 tokens with its end; 48, the earlier default, cut it")
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--target-modules", default="auto", help="the LoRA's: auto (q/v) | all-linear | names")
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None)
    p.add_argument("--write", metavar="DIR", help="write the data and stop")
    p.add_argument("--check-args", action="store_true", help="parse the arguments and imports, run nothing")
    args = p.parse_args()
    if args.check_args:
        from harness import check_imports
        check_imports(__file__)
        return
    if args.write:
        print(*write(Path(args.write), args.rows, args.held_out), sep="\n")
        return
    from tunebench.interfaces import cli
    from tunebench.model import models

    args.model = args.model or models.SMOLLM2
    out = Path(args.out or tempfile.mkdtemp(prefix="toolcalls-"))
    train, held = write(out / "data", args.rows, args.held_out)
    base = scores(args.model, None, held, out, args.max_new_tokens)
    began = time.perf_counter()
    code = cli.main(["train", "--model", args.model, "--data", str(train), "--output-dir", str(out / "run"),
                     "--epochs", str(args.epochs), "--max-length", "1024", "--eval-fraction", "0", "--no-progress",
                     "--lr", args.lr, "--lora-r", "16", "--lora-alpha", "32", "--target-modules", args.target_modules])
    trained_s = time.perf_counter() - began
    if code:
        sys.exit(code)
    tuned = scores(None, str(out / "run"), held, out, args.max_new_tokens)
    summary = json.loads((out / "run" / "summary.json").read_text())
    print(f"\n{args.rows} training rows, {args.held_out} held out (argument values unseen in training); "
          f"training {trained_s:.0f} s wall ({summary['train_time_s']:.0f} s in the loop, {summary['steps']} steps)")
    keys = ("tool_decision", "tool_name", "tool_args", "tool_schema", "rougeL")
    print("| model | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for label, s in (("base", base), ("LoRA-tuned", tuned)):
        print(f"| {label} | " + " | ".join("-" if s.get(k) is None else f"{s[k]:.1f}" for k in keys) + " |")
    print(f"answers: {out}")


if __name__ == "__main__":
    main()
