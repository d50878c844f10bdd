"""Multi-turn GRPO rollouts' decoding alone: `--prompts` GSM8K questions x `--generations` episodes, each opening a
long system prompt (as an environment's tool schemas make it) and taking `--turns` turns of up to `--new-tokens`
sampled tokens at temperature 1; after each turn a fixed tool turn is appended to every episode (the same episodes
both ways, whatever the model wrote), each turn decoded as Episodes.play decodes it, on the built-in
SmolLM2-135M-Instruct in the precision a run picks here.

Two paths: `whole` decodes each turn's whole contexts afresh (what the rollout did before decoding.Turns), `kept`
keeps each episode's KV cache across its turns and prefills a group's opening once. Prints generated tokens (to
each EOS) a second, the context tokens fed, and whether both paths made the same tokens, over `--repeats` rollouts
after one untimed, alternated A B A B.

The `whole` path also runs against another checkout's code (one from 2026-12-03 on: it calls grpo.cut_after_eos and
Placed.pad_id), for a paired before/after on one machine:

    .venv/bin/python benchmarks/rollout.py
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/rollout.py --paths whole

Needs ../shared/data (GSM8K); run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
SYSTEM = ("You can call tools. Tools: lookup(name) returns the value stored under a name; add(a, b) returns a + b; "
          "multiply(a, b) returns a * b; compare(a, b) says which is larger. Call a tool by writing "
          '<tool_call>{"name": ..., "arguments": {...}}</tool_call> and wait for its result; answer when you know. ')
TOOL_TURN = '<|im_start|>tool\n{"result": 42, "unit": "items", "source": "lookup"}<|im_end|>\n<|im_start|>assistant\n'


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--system-repeat", type=int, default=3, help="the system prompt this many times (~250 tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", nargs="+", default=["kept", "whole"], choices=["kept", "whole"])
    args = ap.parse_args()
    if not GSM8K.exists():
        raise SystemExit(f"needs GSM8K at {GSM8K} (../shared/data)")

    import torch

    import tunebench
    from tunebench.model import inference
    from tunebench.training import grpo

    placed = inference.load("smollm2-135m-instruct", None)
    tok = placed.tokenizer
    questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:args.prompts]]
    openings = [tok(tok.apply_chat_template([{"role": "system", "content": SYSTEM * args.system_repeat},
                                             {"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=False), add_special_tokens=False)["input_ids"] for q in questions]
    tool_turn = tok(TOOL_TURN, add_special_tokens=False)["input_ids"]

    def rollout(path: str) -> tuple[int, int, float, list]:
        """(generated tokens, context tokens fed, seconds, every reply)."""
        from tunebench.model import decoding

        contexts = [list(o) for o in openings for _ in range(args.generations)]
        rows = list(range(len(contexts)))
        turns = decoding.Turns() if path == "kept" else None
        generated, fed, replies = 0, 0, []
        torch.manual_seed(0)
        started = time.perf_counter()
        eos, pad = tok.eos_token_id, placed.pad_id()
        with torch.no_grad():
            for _ in range(args.turns):  # each turn as Episodes.play decodes it
                fed += 0 if turns is not None else sum(map(len, contexts))
                if turns is not None:
                    with placed.running() as model:
                        new = turns.decode(model, rows, contexts, args.new_tokens, eos, pad, 1.0, 1.0)
                else:
                    new = placed.decode(*decoding.left_padded(contexts, pad, placed.device), args.new_tokens, 1.0, 1.0)
                out = grpo.cut_after_eos(new, eos)
                generated += sum(map(len, out))
                replies.append(out)
                for c, reply in zip(contexts, out):
                    c += reply + tool_turn
        seconds = time.perf_counter() - started
        return generated, fed + (turns.prefilled if turns is not None else 0), seconds, replies

    for path in args.paths:
        rollout(path)  # untimed
    runs: dict[str, list] = {p: [] for p in args.paths}
    for _ in range(args.repeats):
        for path in args.paths:
            runs[path].append(rollout(path))
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, tunebench at "
          f"{Path(tunebench.__file__).parents[1]}, {placed.device}, autocast {placed.autocast_dtype}")
    print(f"{args.prompts} prompts x {args.generations} episodes, {args.turns} turns of up to {args.new_tokens} "
          f"new tokens, openings of {min(map(len, openings))}-{max(map(len, openings))} tokens")
    for path, got in runs.items():
        speeds = [n / s for n, _, s, _ in got]
        print(f"{path}: {got[0][0]} tokens generated a rollout, {got[0][1]:,} context tokens fed; generated "
              f"tokens/s median {statistics.median(speeds):.1f} (min {min(speeds):.1f}, max {max(speeds):.1f})")
    if len(runs) == 2:
        same = runs["kept"][0][3] == runs["whole"][0][3]
        ratio = statistics.median(n / s for n, _, s, _ in runs["kept"]) / \
            statistics.median(n / s for n, _, s, _ in runs["whole"])
        print(f"kept / whole: {ratio:.2f}x; the same tokens both ways: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
