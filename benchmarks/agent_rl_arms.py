"""The towns benchmark with its settings chosen on a validation set: which way of learning from a small model's own
episodes wins, at equal wall time, judged once on held-out questions (issue 96's redesign of agent_rl.py).

Each seed draws fresh towns (benchmarks/agent_env.py: populations only a tool knows) and its own start:
SmolLM2-135M-Instruct taught the call form by tool-call SFT on --sft-rows rows (agent_rl.make_start). From that
start each arm trains for --minutes of wall time, sampling included (`--time-budget`, which ends a run whose steps
sample after the step that passes it), on the same training questions:

    grpo   `tunebench train --method grpo`      the group-relative policy gradient
    rft    `tunebench train --objective rft`    rejection sampling (expert iteration): each step's successful
                                                episodes kept and trained on, each kind an equal share

`--arm NAME=grpo|rft [FLAGS]` adds an arm with flags of its own (say `--arm "grpo-state=grpo --turn-credit
state"`). Every model is judged by `tunebench eval` (greedy episodes in the environment, scored by its rewards,
each question's reward kept) on the validation questions (--validation, a third of each kind): compare arms
there to choose a setting. `--final` then judges each arm, and the start, on the held-out questions (--held-out)
and the compositional ones (kinds never trained on), once: their figures are kept and never computed again.

The primary score is the mean over the kinds of greedy success (macro), its difference from the start paired per
question, with a 95% bootstrap interval (questions resampled within each kind). A gain counts only when its
interval is above 0 and no kind falls more than 5 points below the start. With more than one seed, each pair of
arms is also compared with the seeds' questions pooled (on validation: where a default is chosen).

    python benchmarks/agent_rl_arms.py --seeds 0 --minutes 45                       # choose on validation
    python benchmarks/agent_rl_arms.py --seeds 0 --minutes 45 --final              # then held-out, once
    python benchmarks/agent_rl_arms.py --seeds 0,1 --minutes 45 --final --out SAME # a later session adds seed 1
    python benchmarks/agent_rl_arms.py --seeds 0 --sft-rows 8 --train-rows 12 --validation 3 --held-out 3 \\
        --compositional 3 --minutes 1 --max-steps 2 --final                        # a smoke run of every stage

Every seed's files (data, start, each arm's run and judgements) stay under --out/seedN and are reused, never
made again: a later session names the done seeds beside the new one, and only the new one trains.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_rl  # noqa: E402  (the questions, the environment and the start)

KINDS = agent_rl.TRAINED
SETS = {"val": "validation", "held": "held-out", "composed": "compositional"}
FLOOR = -5.0  # a gain counts only when no kind falls further below the start (points)


def write(out: Path, seed: int, a) -> dict[str, Path]:
    """The seed's data: SFT rows for the start, the arms' training questions, and the validation, held-out and
    compositional questions, none naming a town a training row names."""
    from tunebench.training.grpo import environment

    env = environment.load(str(agent_rl.ENV), 10)
    sft, train = agent_rl.questions(seed, "sft", a.sft_rows, KINDS), agent_rl.questions(seed, "grpo", a.train_rows, KINDS)
    seen = agent_rl.towns_in(sft + train)
    rows = {"sft": [agent_rl.sft_row(q, env) for q in sft], "train": train,
            "val": agent_rl.questions(seed, "val", a.validation, KINDS, seen),
            "held": agent_rl.questions(seed, "held", a.held_out, KINDS, seen),
            "composed": agent_rl.questions(seed, "composed", a.compositional, agent_rl.COMPOSED, seen)}
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, items in rows.items():
        files[name] = out / f"{name}.jsonl"
        if not files[name].is_file():  # a later call on the same seed keeps what the arms were judged on
            files[name].write_text("".join(json.dumps(r) + "\n" for r in items))
    return files


def arm_specs(given: list[str]) -> dict[str, tuple[str, list[str]]]:
    """NAME=grpo|rft [FLAGS] -> {NAME: (objective, flags)}; grpo and rft at their defaults when none is given."""
    specs = {}
    for text in given or ["grpo=grpo", "rft=rft"]:
        name, _, rest = text.partition("=")
        words = shlex.split(rest)
        if not name or not words or words[0] not in ("grpo", "rft"):
            sys.exit(f"agent_rl_arms: --arm {text!r}: write NAME=grpo or NAME=rft, then any flags")
        specs[name] = (words[0], words[1:])
    return specs


def tunebench(*args: str) -> None:
    """`tunebench ARGS` in a process of its own (each arm's memory and threads its own); its failure stops here."""
    code = subprocess.run([sys.executable, "-m", "tunebench", *args]).returncode
    if code:
        why = f"killed by signal {-code}" + (" (on Linux most often the kernel's out-of-memory killer: see dmesg)"
                                             if code == -9 else "") if code < 0 else f"exit {code}"
        sys.exit(f"agent_rl_arms: tunebench {' '.join(args[:3])} ... failed: {why}")


def train(run: Path, start: str, files: dict[str, Path], objective: str, flags: list[str], seed: int, a) -> float:
    """The arm trained from `start` for a.minutes of wall time (once: a finished run is kept); its wall seconds."""
    if (run / "summary.json").is_file():
        return json.loads((run / "arm.json").read_text())["wall_s"]
    began = time.perf_counter()
    tunebench("train", *(["--method", "grpo"] if objective == "grpo" else ["--objective", "rft"]),
              "--model", start, "--environment", str(agent_rl.ENV), "--data", str(files["train"]),
              "--kind-column", "kind", "--num-generations", str(a.num_generations), "--max-completion-length", "48",
              "--max-turns", str(a.max_turns), "--max-length", "1024", "--effective-batch-size", "4",
              "--eval-fraction", "0", "--lr", a.lr, "--schedule", a.schedule, "--temperature", "1.0",
              "--no-progress", "--seed", str(seed), "--output-dir", str(run), "--max-steps", str(a.max_steps),
              "--time-budget", f"{a.minutes:g}m", *flags)
    wall = time.perf_counter() - began
    (run / "arm.json").write_text(json.dumps({"objective": objective, "flags": flags, "wall_s": wall}))
    return wall


def judged(run: Path, files: dict[str, Path], which: str, seed_dir: Path) -> tuple[dict, dict]:
    """(the arm's, the start's) eval figures on `which` set, each with every question's reward (by_row); each
    computed once and kept (the start's with the first arm judged on the set)."""
    mine, start = run / f"judged-{which}.json", seed_dir / f"start-judged-{which}.json"
    if not mine.is_file():
        folder = run / f"judged-{which}"
        tunebench("eval", "--adapter", str(run), "--data", str(files[which]), "--output-dir", str(folder),
                  *([] if start.is_file() else ["--base"]))
        scores = json.loads((folder / "scores.json").read_text())
        if not start.is_file():
            start.write_text(json.dumps(scores["base"]))
        mine.write_text(json.dumps(scores[run.name]))
    return json.loads(mine.read_text()), json.loads(start.read_text())


def by_kind(figures: dict, rows: list[dict]) -> dict[str, list[float]]:
    """Each kind's greedy successes (1.0 where the episode's reward is above 0), in the order of `rows`."""
    reward = dict((int(row), r) for row, r in figures["by_row"])
    kinds: dict[str, list[float]] = {}
    for i, q in enumerate(rows):
        kinds.setdefault(q["kind"], []).append(float(reward[i] > 0))
    return kinds


def macro(kinds: dict[str, list[float]]) -> float:
    """The mean over the kinds of their success, in percent: each kind counts the same, whatever its size."""
    return 100 * statistics.fmean(statistics.fmean(v) for v in kinds.values())


def paired_gain(after: dict[str, list[float]], before: dict[str, list[float]], resamples: int = 2000,
                seed: int = 0) -> tuple[float, float, float]:
    """macro(after) - macro(before) in points, with a 95% percentile interval from a bootstrap that resamples the
    questions within each kind and keeps each question's two answers together."""
    rng = random.Random(seed)
    diffs = {k: [x - y for x, y in zip(after[k], before[k])] for k in before}
    draws = sorted(100 * statistics.fmean(statistics.fmean(d[rng.randrange(len(d))] for _ in d) for d in diffs.values())
                   for _ in range(resamples))
    return macro(after) - macro(before), draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def kind_changes(after: dict[str, list[float]], before: dict[str, list[float]]) -> dict[str, float]:
    """Each kind's success after minus before, in points."""
    return {k: 100 * (statistics.fmean(after[k]) - statistics.fmean(before[k])) for k in before}


def verdict(gain: tuple[float, float, float], changes: dict[str, float]) -> str:
    """Whether a gain counts: its interval above 0 and no kind more than 5 points below the start."""
    fell = {k: c for k, c in changes.items() if c < FLOOR}
    if fell:
        return "no: " + ", ".join(f"{k} {c:+.1f}" for k, c in fell.items())
    return "yes" if gain[1] > 0 else "no: the interval reaches 0"


def steps_line(run: Path) -> str:
    """What the arm's steps show (issue 96's collapse watch): steps and seconds a step, entropy first to last, the
    share of groups that scored alike, each kind's share of informative groups, and each kind's training reward in
    the first third of the steps against the last (a kind that falls while the others climb is the collapse)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    if not rows:
        return "no steps"

    def mean(key: str, part: list[dict] = rows) -> float | None:
        values = [r[key] for r in part if key in r]
        return statistics.fmean(values) if values else None

    def share(key: str, part: list[dict] = rows, form: str = ".0%") -> str:
        value = mean(key, part)
        return "n/a" if value is None else format(value, form)

    third = max(1, len(rows) // 3)
    first, last = rows[:third], rows[-third:]
    # a kind absent from a third (a step logs only the kinds it drew) reads n/a there
    rewards = ", ".join(f"{k} {share(f'kinds/{k}/reward', first, '.2f')} -> {share(f'kinds/{k}/reward', last, '.2f')}"
                        for k in KINDS if mean(f"kinds/{k}/reward") is not None)
    informative = ", ".join(f"{k} {share(f'kinds/{k}/informative')}" for k in KINDS)
    pace = f"{rows[-1]['elapsed_s'] / len(rows):.1f} s a step; " if "elapsed_s" in rows[-1] else ""
    return (f"{len(rows)} steps; {pace}entropy {rows[0].get('entropy', 0):.3f} -> {rows[-1].get('entropy', 0):.3f} "
            f"nats a token; groups alike {share('frac_reward_zero_std')}; kept {share('frac_kept')}; informative: "
            f"{informative}" + (f"; training reward, first third of the steps -> last: {rewards}" if rewards else ""))


def one_seed(seed: int, out: Path, a, specs: dict) -> list[dict]:
    """The seed's start and arms, judged on validation (and with --final on held-out and compositional): a row a
    model and set."""
    from tunebench.model import models

    files = write(out / "data", seed, a)
    # in processes of their own: an SFT at 1,024 tokens left this one holding ~10 GB, and the GRPO arm beside it
    # (13.7 GB while it measured) was killed by the kernel for memory (2026-12-02, 23 GB)
    start = agent_rl.make_start(out, a.model or models.SMOLLM2, files["sft"], seed,
                                lambda args: subprocess.run([sys.executable, "-m", "tunebench", *args]).returncode)
    sets = ["val", *(["held", "composed"] if a.final else [])]
    table = []
    for name, (objective, flags) in specs.items():
        run = out / "arms" / name
        wall = train(run, start, files, objective, flags, seed, a)
        print(f"seed {seed} {name}: {wall:.0f} s; {steps_line(run)}", flush=True)
        for which in sets:
            rows = agent_rl.read(files[which])
            mine, base = judged(run, files, which, out)
            table.append({"seed": seed, "arm": name, "set": which, "wall_s": wall,
                          "after": by_kind(mine, rows), "before": by_kind(base, rows)})
    return table


def report(table: list[dict]) -> None:
    """Each arm against the start on each set (macro success, the paired gain and its interval, each kind's change,
    whether it counts), each pair of arms on the same seed and set, and the seeds' mean gain."""
    print("\n| seed | set | arm | wall s | start % | arm % | gain [95%] | each kind | counts |\n|---|---|---|---|---|---|---|---|---|")
    for r in table:
        g, changes = paired_gain(r["after"], r["before"]), kind_changes(r["after"], r["before"])
        kinds = ", ".join(f"{k} {c:+.1f}" for k, c in changes.items())
        counts = verdict(g, changes) if r["set"] != "composed" else "(reported)"
        print(f"| {r['seed']} | {SETS[r['set']]} | {r['arm']} | {r['wall_s']:.0f} | {macro(r['before']):.1f} | "
              f"{macro(r['after']):.1f} | {g[0]:+.1f} [{g[1]:+.1f}, {g[2]:+.1f}] | {kinds} | {counts} |")
    pairs = [(x, y) for x in table for y in table
             if (x["seed"], x["set"]) == (y["seed"], y["set"]) and x["arm"] < y["arm"]]
    for x, y in pairs:
        g = paired_gain(x["after"], y["after"])
        print(f"seed {x['seed']} {SETS[x['set']]}: {x['arm']} - {y['arm']} {g[0]:+.1f} [{g[1]:+.1f}, {g[2]:+.1f}]")
    for arm in dict.fromkeys(r["arm"] for r in table):
        for which in SETS:
            gains = [macro(r["after"]) - macro(r["before"]) for r in table if (r["arm"], r["set"]) == (arm, which)]
            if gains:
                print(f"{arm} on {SETS[which]}, over {len(gains)} seed(s): {agent_rl.over_seeds(gains)}")
    if len({r["seed"] for r in table}) > 1:
        for which in ("val", "held"):
            for x, y in sorted({(x["arm"], y["arm"]) for x, y in pairs if x["set"] == which}):
                after, before = pooled(table, x, which), pooled(table, y, which)
                g = paired_gain(after, before)
                print(f"seeds pooled, {SETS[which]} ({sum(map(len, after.values()))} questions): {x} - {y} "
                      f"{g[0]:+.1f} [{g[1]:+.1f}, {g[2]:+.1f}]")


def pooled(table: list[dict], arm: str, which: str) -> dict[str, list[float]]:
    """The arm's greedy successes on `which` set, each kind's questions of every seed together in seed order, so
    that a pair of arms compared through paired_gain keeps each question's two answers together (a default is
    chosen on the seeds' validation questions pooled: each seed alone holds 50 a kind)."""
    kinds: dict[str, list[float]] = {}
    for r in sorted((r for r in table if (r["arm"], r["set"]) == (arm, which)), key=lambda r: r["seed"]):
        for k, v in r["after"].items():
            kinds.setdefault(k, []).extend(v)
    return kinds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0", help="comma-separated seeds, each with fresh towns and its own start")
    p.add_argument("--sft-rows", type=int, default=60, help="the start's SFT rows (agent_rl.py's)")
    p.add_argument("--train-rows", type=int, default=600, help="the arms' training questions")
    p.add_argument("--validation", type=int, default=150, help="validation questions, a third of each kind")
    p.add_argument("--held-out", type=int, default=300, help="held-out questions, a third of each kind")
    p.add_argument("--compositional", type=int, default=150, help="questions of the kinds never trained on")
    p.add_argument("--minutes", type=float, default=45.0, help="each arm's wall time, sampling included")
    p.add_argument("--max-steps", type=int, default=400, help="the most an arm runs (its schedule's span)")
    p.add_argument("--schedule", default="constant", help="the arms' learning-rate schedule (a deadline ends them "
                   "where a decaying one would not have decayed)")
    p.add_argument("--lr", default="2e-4")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--arm", action="append", default=[], help="NAME=grpo|rft [FLAGS]; default: grpo and rft")
    p.add_argument("--final", action="store_true", help="also judge every arm and the start on the held-out and "
                   "compositional questions (once: kept)")
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None)
    p.add_argument("--check-args", action="store_true", help="parse the arguments and imports, run nothing")
    a = p.parse_args()
    specs = arm_specs(a.arm)
    if a.check_args:
        from harness import check_imports
        check_imports(__file__)
        return
    out = Path(a.out or f"agent-rl-arms-{time.strftime('%Y-%m-%d')}").resolve()
    table = [r for seed in map(int, a.seeds.split(",")) for r in one_seed(seed, out / f"seed{seed}", a, specs)]
    report(table)
    print(f"runs and data: {out}")


if __name__ == "__main__":
    main()
