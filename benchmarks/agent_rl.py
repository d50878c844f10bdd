"""Does a small model learn to use tools by doing, and more than it would from its own successes alone?

The environment (benchmarks/agent_env.py): made-up towns whose populations only a tool knows, derived from the
name by a hash; every question names towns drawn afresh, so nothing can be memorised. The training
distribution asks for one town's population (one call), a population plus a number (two calls: the lookup,
then `add`) and two towns' together (three calls). Held out: questions of that distribution and compositional
ones never shown in training (a difference through `subtract`, which town is larger, three towns' total).

Each seed: SmolLM2-135M-Instruct taught the call form by tool-call SFT on a few rows (the start, sized by
--sft-rows so that greedy success is 35-55% with pass@8 >= 80%: both measured and printed before any GRPO),
then, from that start, GRPO for --grpo-steps and rejection-sampling fine-tuning (RFT: episodes sampled from the
start on the same training questions, the successful ones kept, SFT on them) given GRPO's own wall time. Every
model is scored by its greedy episodes on the same held-out questions; each figure with its 95% interval (Wilson
for one run's share, the paired difference's normal interval for a gain, a t interval over the seeds).

    python benchmarks/agent_rl.py                                        # the issue's scale: 3 seeds, ~4.5 h
    python benchmarks/agent_rl.py --seeds 1 --held-out 100 --compositional 60 --pass-questions 40 --grpo-steps 24
    python benchmarks/agent_rl.py --seeds 1 --sft-rows 8 --grpo-steps 1 --held-out 4 --compositional 3 \\
        --pass-questions 2 --grpo-rows 8                                  # a smoke run of every stage

TRL's GRPOTrainer is not run beside it: it is not among this project's dependencies, and its multi-turn tool
loop needs its own environment and generation set-up (vLLM on a GPU in its docs); nothing is said of it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_env  # noqa: E402  (the values every question is built from)

ENV = Path(__file__).resolve().parent / "agent_env.py"
TRAINED = ("one", "plus", "sum")  # the training distribution's kinds: 1, 2 and 3 calls
COMPOSED = ("difference", "compare", "three")  # never shown in training
BAND = (35.0, 55.0, 80.0)  # the start: greedy success 35-55%, pass@8 >= 80%


def town(rng: random.Random) -> str:
    """A made-up town's name: two or three syllables."""
    syllables = [rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.choice((2, 3)))]
    return ("".join(syllables) + rng.choice(("", "n", "r", "s", "ton", "ford"))).capitalize()


def question(rng: random.Random, kind: str) -> dict:
    """A question of `kind`, its answer and the calls a perfect agent makes ([name, arguments], in order)."""
    names = [town(rng) for _ in range(3)]
    a, b, c = names
    pa, pb, pc = (agent_env.population_of(n) for n in names)
    if kind in ("difference", "compare") and pa == pb or len(set(names)) < 3:
        return question(rng, kind)
    if kind in ("difference", "compare") and pa < pb:
        (a, pa), (b, pb) = (b, pb), (a, pa)
    look = [["population", {"town": t}] for t in (a, b, c)]
    n = rng.randint(2, 40)
    shapes = {
        "one": (f"What is the population of {a}?", pa, look[:1]),
        "plus": (f"What is the population of {a} plus {n}?", pa + n, [look[0], ["add", {"a": pa, "b": n}]]),
        "sum": (f"What is the population of {a} and {b} together?", pa + pb,
                [*look[:2], ["add", {"a": pa, "b": pb}]]),
        "difference": (f"How much larger is the population of {a} than that of {b}?", pa - pb,
                       [*look[:2], ["subtract", {"a": pa, "b": pb}]]),
        "compare": (f"Which town has more people, {b} or {a}?" if rng.random() < 0.5 else
                    f"Which town has more people, {a} or {b}?", a, look[:2]),
        "three": (f"What is the population of {a}, {b} and {c} together?", pa + pb + pc,
                  [*look, ["add", {"a": pa, "b": pb}], ["add", {"a": pa + pb, "b": pc}]]),
    }
    text, answer, calls = shapes[kind]
    return {"question": text, "answer": str(answer), "kind": kind, "calls": calls}


def questions(seed: int, stream: str, count: int, kinds: tuple[str, ...], avoid: set[str] = frozenset()) -> list[dict]:
    """`count` questions cycling through `kinds`, from their own stream of `seed`; none naming a town in `avoid`."""
    rng, rows = random.Random(f"{seed}/{stream}"), []
    while len(rows) < count:
        q = question(rng, kinds[len(rows) % len(kinds)])
        if not avoid & towns_in([q]):
            rows.append(q)
    return rows


def towns_in(rows: list[dict]) -> set[str]:
    return {call[1]["town"] for q in rows for call in q["calls"] if call[0] == "population"}


def sft_row(q: dict, env) -> dict:
    """The episode a perfect agent plays, as an OpenAI chat row: one call a turn, the tools' own answers, the answer."""
    from tunebench.training.grpo import environment

    messages = agent_env.reset(q)
    for name, args in q["calls"]:
        messages += [{"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]},
                     {"role": "tool", "name": name, "content": environment.call(env, name, args).text}]
    messages.append({"role": "assistant", "content": q["answer"]})
    return {"messages": messages, "tools": env.schemas}


def write(out: Path, seed: int, a) -> dict[str, Path]:
    """The seed's data: SFT rows, GRPO's prompts, and the held-out sets, whose towns no training row names."""
    from tunebench.training.grpo import environment

    out.mkdir(parents=True, exist_ok=True)
    env = environment.load(str(ENV), 10)
    sft, grpo = questions(seed, "sft", a.sft_rows, TRAINED), questions(seed, "grpo", a.grpo_rows, TRAINED)
    seen = towns_in(sft + grpo)
    rows = {"sft": [sft_row(q, env) for q in sft], "grpo": grpo,
            "held": questions(seed, "held", a.held_out, TRAINED, seen),
            "composed": questions(seed, "composed", a.compositional, COMPOSED, seen)}
    files = {}
    for name, items in rows.items():
        files[name] = out / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in items))
    return files


def played(placed, env, records: list[dict], max_turns: int, samples: int = 1, seed: int = 0) -> list[tuple]:
    """(episode, reward) of each record's episodes: one greedy episode, or `samples` at temperature 1."""
    from tunebench.training.grpo import environment, episodes

    return [(e, environment.score(env, e.messages, records[e.key]) or 0.0) for e in episodes.play(
        placed, env, records, max_turns, 48, 1024, 16, samples, 1.0 if samples > 1 else None, seed)]


def successes(placed, records: list[dict], max_turns: int, samples: int = 1, seed: int = 0) -> list[list[float]]:
    """Each record's episodes' rewards: one greedy episode, or `samples` at temperature 1."""
    from tunebench.training.grpo import environment

    won: list[list[float]] = [[] for _ in records]
    for e, reward in played(placed, environment.load(str(ENV), 10), records, max_turns, samples, seed):
        won[e.key].append(reward)
    return won


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def scored(model: str | None, adapter: str | None, files: dict[str, Path], a) -> dict[str, list[float]]:
    """A model's greedy success per held-out question, the training distribution's and the compositional."""
    from tunebench.model import inference

    placed = inference.load(model, adapter)
    return {k: [w[0] for w in successes(placed, read(files[k]), a.max_turns)] for k in ("held", "composed")}


def rft(start: str, files: dict[str, Path], out: Path, budget_s: float, a, seed: int) -> dict:
    """Rejection-sampling fine-tuning in `budget_s`: half of it sampling the start's episodes on GRPO's training
    questions (as many chunks as fit), the successful episodes kept, then SFT on them for what is left."""
    from tunebench.interfaces import cli
    from tunebench.model import inference
    from tunebench.training.grpo import environment

    began, env = time.perf_counter(), environment.load(str(ENV), 10)
    placed, prompts, kept, tried = inference.load(start, None), read(files["grpo"]), [], 0
    for at in range(0, len(prompts), 4):
        if time.perf_counter() - began > budget_s / 2:
            break
        chunk = played(placed, env, prompts[at:at + 4], a.max_turns, a.num_generations, seed + at)
        tried += len(chunk)
        kept += [{"messages": e.messages, "tools": env.schemas} for e, reward in chunk if reward]
    del placed
    rows = out / "rft.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in kept))
    left = budget_s - (time.perf_counter() - began)
    code = cli.main(["train", "--model", start, "--data", str(rows), "--output-dir", str(out / "rft"), "--epochs", "4",
                     "--time-budget", f"{max(1, int(left))}s", "--max-length", "1024", "--eval-fraction", "0",
                     "--lr", "2e-4", "--no-progress", "--seed", str(seed)]) if kept else 1
    return {"episodes": tried, "kept": len(kept), "trained": code == 0, "wall_s": time.perf_counter() - began}


def wilson(k: float, n: int) -> tuple[float, float]:
    """A share's 95% Wilson interval, in percent."""
    if not n:
        return math.nan, math.nan
    p, z = k / n, 1.96
    mid, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, 100 * (mid - half)), min(100.0, 100 * (mid + half))


def share(won: list[float]) -> str:
    low, high = wilson(sum(won), len(won))
    return f"{100 * sum(won) / len(won):.1f} [{low:.1f}, {high:.1f}]"


def gain(after: list[float], before: list[float]) -> str:
    """The paired difference in points with its 95% normal interval."""
    d = [100 * (x - y) for x, y in zip(after, before)]
    half = 1.96 * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    mean = statistics.fmean(d)
    return f"{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]"


def over_seeds(values: list[float]) -> str:
    """The seeds' mean with a t interval (95%)."""
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78}.get(len(values), 1.96)
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:+.1f} (one seed: no interval)"
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]"


def make_start(out: Path, model: str, sft: Path, seed: int, run=None) -> str:
    """The seed's start (out/start): `model` taught the call form by tool-call SFT on the rows of `sft`, merged;
    made once (an earlier run's is kept). `run(args) -> exit code` runs each command (default: in this process)."""
    from tunebench.interfaces import cli

    run = run or cli.main
    if not (out / "start" / "config.json").is_file():
        if run(["train", "--model", model, "--data", str(sft), "--output-dir", str(out / "sft"),
                     "--epochs", "2", "--max-length", "1024", "--eval-fraction", "0", "--no-progress", "--lr", "1e-3",
                     "--lora-r", "16", "--lora-alpha", "32", "--target-modules", "all-linear", "--seed", str(seed)]) \
                or run(["merge", "--adapter", str(out / "sft"), "--output-dir", str(out / "start")]):
            sys.exit(1)
    return str(out / "start")


def one_seed(seed: int, out: Path, a, model: str) -> dict:
    from tunebench.interfaces import cli
    from tunebench.model import inference

    if (out / "figures.json").is_file():  # a seed done by an earlier, interrupted run of the same --out
        print(f"reusing seed {seed}'s figures in {out}")
        return json.loads((out / "figures.json").read_text())
    files = write(out / "data", seed, a)
    start = make_start(out, model, files["sft"], seed)
    r = {"start": scored(start, None, files, a)}
    began = time.perf_counter()
    sampled = successes(inference.load(start, None), read(files["held"])[:a.pass_questions], a.max_turns, 8, seed)
    r["pass8"] = [float(any(w)) for w in sampled]
    r["pass8_s"] = time.perf_counter() - began
    print(f"seed {seed} start: greedy {share(r['start']['held'])} %, pass@8 {share(r['pass8'])} % "
          f"(the band: greedy {BAND[0]:.0f}-{BAND[1]:.0f}%, pass@8 >= {BAND[2]:.0f}%); compositional greedy "
          f"{share(r['start']['composed'])} %", flush=True)
    if a.start_only:
        return r
    if a.online_rft_steps:
        return online_rft(r, start, files, out, a, seed)
    began = time.perf_counter()
    if cli.main(["train", "--method", "grpo", "--model", start, "--environment", str(ENV), "--data", str(files["grpo"]),
                 "--num-generations", str(a.num_generations), "--max-completion-length", "48", "--max-turns",
                 str(a.max_turns), "--max-length", "1024", "--effective-batch-size", "4", "--eval-fraction", "0",
                 "--lr", a.grpo_lr, "--temperature", "1.0", "--no-progress", "--seed", str(seed),
                 "--output-dir", str(out / "grpo"), "--max-steps", str(a.grpo_steps),
                 *(["--target-modules", a.grpo_target_modules] if a.grpo_target_modules else []),
                 "--turn-credit", a.turn_credit, "--resample-alike", str(a.resample_alike), "--kind-column", "kind",
                 *(["--balance-kinds", "on"] if a.balance_kinds else [])]):
        sys.exit(1)
    r["grpo_s"] = time.perf_counter() - began
    r["grpo"] = scored(None, str(out / "grpo"), files, a)
    r["grpo_summary"] = json.loads((out / "grpo" / "summary.json").read_text())
    r["grpo_metrics"] = read(out / "grpo" / "metrics.jsonl")
    r["rft_run"] = rft(start, files, out, r["grpo_s"], a, seed) if not a.skip_rft else \
        {"episodes": 0, "kept": 0, "trained": False, "wall_s": 0.0}
    r["rft"] = scored(None, str(out / "rft"), files, a) if r["rft_run"]["trained"] else None
    (out / "figures.json").write_text(json.dumps(r, indent=1))
    return r


def online_rft(r: dict, start: str, files: dict[str, Path], out: Path, a, seed: int) -> dict:
    """The arm of `--objective rft` (training/grpo/rft.py) from the start, with GRPO's sampling settings: each step's
    successful episodes kept (each kind an equal share of the loss, --kind-column kind) and trained on."""
    from tunebench.interfaces import cli

    began = time.perf_counter()
    if cli.main(["train", "--objective", "rft", "--model", start, "--environment", str(ENV), "--data",
                 str(files["grpo"]), "--kind-column", "kind", "--num-generations", str(a.num_generations),
                 "--max-completion-length", "48", "--max-turns", str(a.max_turns), "--max-length", "1024",
                 "--effective-batch-size", "4", "--eval-fraction", "0", "--lr", "2e-4", "--temperature", "1.0",
                 "--no-progress", "--seed", str(seed), "--output-dir", str(out / "online-rft"),
                 "--max-steps", str(a.online_rft_steps)]):
        sys.exit(1)
    r["online_rft_s"] = time.perf_counter() - began
    r["online_rft"] = scored(None, str(out / "online-rft"), files, a)
    r["online_rft_metrics"] = read(out / "online-rft" / "metrics.jsonl")
    r["kinds"] = {k: [q["kind"] for q in read(files[k])] for k in ("held", "composed")}
    (out / "figures.json").write_text(json.dumps(r, indent=1))
    return r


def report_online_rft(runs: list[dict], a) -> None:
    """Each seed's start against the online RFT arm: every held-out set, and each kind of the held-out questions."""
    print("\n| seed | set | start % | RFT objective % | gain |\n|---|---|---|---|---|")
    for seed, r in enumerate(runs):
        for k, label in (("held", f"held-out ({a.held_out})"), ("composed", f"compositional ({a.compositional})")):
            print(f"| {seed} | {label} | {share(r['start'][k])} | {share(r['online_rft'][k])} | "
                  f"{gain(r['online_rft'][k], r['start'][k])} |")
        kinds = r["kinds"]["held"]
        for kind in dict.fromkeys(kinds):
            pick = [i for i, x in enumerate(kinds) if x == kind]
            before, after = [r["start"]["held"][i] for i in pick], [r["online_rft"]["held"][i] for i in pick]
            print(f"| {seed} | held-out, {kind} ({len(pick)}) | {share(before)} | {share(after)} | "
                  f"{gain(after, before)} |")
        m = [x for x in r["online_rft_metrics"] if "frac_kept" in x]
        print(f"seed {seed}: {len(m)} steps in {r['online_rft_s']:.0f} s; kept {statistics.fmean(x['frac_kept'] for x in m):.0%} "
              f"of episodes; entropy {m[0].get('entropy', 0):.3f} -> {m[-1].get('entropy', 0):.3f} nats a token")


def report(runs: list[dict], a) -> None:
    print("\n| seed | set | start % | pass@8 % | GRPO % | gain | RFT % | gain | GRPO - RFT |\n|---|---|---|---|---|---|---|---|---|")
    for seed, r in enumerate(runs):
        for k, label in (("held", f"held-out ({a.held_out})"), ("composed", f"compositional ({a.compositional})")):
            rft_ = r["rft"][k] if r["rft"] else None
            print(f"| {seed} | {label} | {share(r['start'][k])} | {share(r['pass8']) if k == 'held' else ''} | "
                  f"{share(r['grpo'][k])} | {gain(r['grpo'][k], r['start'][k])} | "
                  f"{share(rft_) if rft_ else 'not trained'} | {gain(rft_, r['start'][k]) if rft_ else ''} | "
                  f"{gain(r['grpo'][k], rft_) if rft_ else ''} |")
    for k in ("held", "composed"):
        print(f"GRPO's gain on {k}, over the seeds: "
              + over_seeds([100 * (statistics.fmean(r["grpo"][k]) - statistics.fmean(r["start"][k])) for r in runs]))
    print("\n| seed | GRPO steps | wall s | episodes / min | groups all alike % | generated tokens/s | prefill s | "
          "decode s | tools s | scoring s | update s | RFT: episodes sampled, kept, wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for seed, r in enumerate(runs):
        s, m, f = r["grpo_summary"], r["grpo_metrics"], r["rft_run"]
        split = s.get("sampling_split_s", {})
        alike = 100 * statistics.fmean(x["frac_reward_zero_std"] for x in m if "frac_reward_zero_std" in x)
        print(f"| {seed} | {s['steps']} | {r['grpo_s']:.0f} | {60 * s['steps'] * 4 * a.num_generations / r['grpo_s']:.1f} | "
              f"{alike:.0f} | {s.get('generation_tokens_per_s') or 0:.1f} | "
              + " | ".join(f"{split.get(k, 0):.0f}" for k in ("prefill", "decode", "tools", "scoring"))
              + f" | {s.get('update_s', 0):.0f} | {f['episodes']}, {f['kept']}, {f['wall_s']:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sft-rows", type=int, default=60, help="the start's SFT rows: fewer make a weaker start (60: "
                   "greedy 38%%, pass@8 85%% on seed 0, 2026-11-28)")
    p.add_argument("--grpo-rows", type=int, default=400)
    p.add_argument("--held-out", type=int, default=400, help="held-out questions of the training distribution")
    p.add_argument("--compositional", type=int, default=200, help="held-out questions of the kinds never shown")
    p.add_argument("--pass-questions", type=int, default=100, help="held-out questions pass@8 samples")
    p.add_argument("--grpo-steps", type=int, default=64, help="GRPO's steps (64: about 30 min at the ~28 s a step "
                   "measured on a 2-core EPYC, 2026-11-28)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--grpo-lr", default="2e-4", help="GRPO's learning rate (RFT keeps 2e-4)")
    p.add_argument("--grpo-target-modules", default=None, help="GRPO's LoRA layers (default: PEFT's for the model; "
                   "all-linear with --grpo-lr 5e-4 learned a shortcut faster: benchmarks/README.md)")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--turn-credit", default="pooled", choices=("pooled", "state"),
                   help="GRPO's per-turn credit: pooled over the group's turns, or per shared state (GiGPO)")
    p.add_argument("--resample-alike", type=int, default=0, help="GRPO's rounds of fresh draws for an alike group")
    p.add_argument("--balance-kinds", action="store_true", help="GRPO's steps: one prompt of each kind in turn")
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None)
    p.add_argument("--skip-rft", action="store_true", help="no rejection-sampling baseline (GRPO against the start only)")
    p.add_argument("--start-only", action="store_true", help="measure the start (greedy, pass@8) and stop: to size "
                   "--sft-rows")
    p.add_argument("--online-rft-steps", type=int, default=0, help="instead of GRPO and the two-pass RFT: "
                   "`--objective rft` from the start for this many steps, with GRPO's sampling settings")
    p.add_argument("--check-args", action="store_true", help="parse the arguments and imports, run nothing")
    a = p.parse_args()
    if a.check_args:
        from harness import check_imports
        check_imports(__file__)
        return
    from tunebench.model import models

    out = Path(a.out or tempfile.mkdtemp(prefix="agent-rl-"))
    runs = [one_seed(seed, out / f"seed{seed}", a, a.model or models.SMOLLM2) for seed in range(a.seeds)]
    if a.online_rft_steps:
        report_online_rft(runs, a)
    elif not a.start_only:
        report(runs, a)
    print(f"runs and data: {out}")


if __name__ == "__main__":
    main()
