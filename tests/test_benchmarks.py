"""The scripts a lent GPU machine runs (benchmarks/gpu_session.sh and the benchmarks it calls) hold on any
machine: a dry run collects the GPU tests, parses every benchmark's arguments, imports every tunebench name
each one uses and parses every tunebench command line, without training anything."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def dry_run(*steps: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path))
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "--dry-run", *steps], env=env,
                          capture_output=True, text=True)


def benchmark(name: str):
    """benchmarks/NAME.py, imported as the scripts import each other (benchmarks/ on the path only meanwhile)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_every_step_of_the_gpu_session_is_ready_without_a_gpu(tmp_path):
    proc = dry_run("all", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("== ")] == [
        "compare", "fill", "generation", "tests", "study", "gpu-sized", "llama", "end"]
    assert not list(tmp_path.iterdir())  # nothing ran, so nothing was written


def test_a_benchmark_that_imports_a_name_tunebench_no_longer_has_fails_the_dry_run(tmp_path):
    """The rot this guards against: the llama step once imported `tunebench.models`, gone since the move
    to tunebench.model; only a lazy import inside the worker named it."""
    script = tmp_path / "rotted.py"
    script.write_text("import sys\nsys.path.insert(0, sys.argv[1])\nfrom harness import check_imports\n"
                      "def worker():\n    from tunebench.model.models import no_such_name\n"
                      "check_imports(__file__)\n")
    proc = subprocess.run([sys.executable, str(script), str(ROOT / "benchmarks")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode != 0 and "no_such_name" in proc.stderr, proc.stderr[-2000:]
    assert dry_run("bogus", tmp_path=tmp_path).returncode == 2


def test_the_agent_benchmarks_questions_are_answered_only_through_its_tools():
    """benchmarks/agent_rl.py's environment: every kind's answer is what its perfect agent's calls compute through
    the environment's own tools, scored 1 by its reward (a reply off by one scores 0); towns are drawn afresh per
    question, so the held-out sets name no town a training row names and nothing repeats to be memorised."""
    agent_rl = benchmark("agent_rl")
    from tunebench.training.grpo import environment

    env = environment.load(str(agent_rl.ENV), 10)
    assert [s["function"]["name"] for s in env.schemas] == ["population", "add", "subtract"]
    for kind in (*agent_rl.TRAINED, *agent_rl.COMPOSED):
        for q in agent_rl.questions(7, "t", 5, (kind,)):
            row = agent_rl.sft_row(q, env)
            assert environment.score(env, row["messages"], q) == 1.0, q
            wrong = [*row["messages"][:-1], {"role": "assistant", "content": "Nowhere" if kind == "compare" else
                                             str(int(q["answer"]) + 1)}]
            assert environment.score(env, wrong, q) == 0.0, q
            calls = [m for m in row["messages"] if m.get("tool_calls")]
            assert len(calls) == {"one": 1, "plus": 2, "sum": 3, "difference": 3, "compare": 2, "three": 5}[kind]
    sft, grpo = agent_rl.questions(0, "sft", 60, agent_rl.TRAINED), agent_rl.questions(0, "grpo", 200, agent_rl.TRAINED)
    seen = agent_rl.towns_in(sft + grpo)
    held = agent_rl.questions(0, "held", 200, agent_rl.TRAINED, seen)
    composed = agent_rl.questions(0, "composed", 60, agent_rl.COMPOSED, seen)
    assert not seen & agent_rl.towns_in(held + composed)
    lookups = [call[1]["town"] for q in held for call in q["calls"] if call[0] == "population"]
    assert len(set(lookups)) > 0.95 * len(lookups)  # a town asked twice is rare: fresh names, not a fixed list
    turns = environment.load(str(ROOT / "benchmarks" / "agent_env_turns.py"), 10)  # its per-turn reward
    q = agent_rl.questions(7, "t", 1, ("sum",))[0]
    row = agent_rl.sft_row(q, turns)
    assert row == agent_rl.sft_row(q, env)  # its tools are agent_env.py's, answering as there (not an error)
    assert environment.score(turns, row["messages"], q, turns=4) == pytest.approx([1 / 6, 1 / 6, 1 / 6, 1.0])
    early = [*row["messages"][:4], {"role": "assistant", "content": row["messages"][3]["content"]}]  # one lookup
    swapped = [*row["messages"][:2], row["messages"][4], *row["messages"][3:4], row["messages"][2],
               *row["messages"][5:]]  # the towns looked up in the other order: neither lookup is the needed one
    assert environment.score(turns, early, q, turns=2) == pytest.approx([1 / 6, 0.0])
    assert environment.score(turns, swapped, q, turns=4) == pytest.approx([0.0, 0.0, 1 / 6, 1.0])
    procedure = environment.load(str(ROOT / "benchmarks" / "agent_env_procedure.py"), 10)  # charges a wrong procedure
    assert agent_rl.sft_row(q, procedure) == row
    wrong = {"role": "assistant", "content": str(int(q["answer"]) + 1)}
    assert environment.score(procedure, row["messages"], q) == 1.0
    assert environment.score(procedure, [*row["messages"][:-1], wrong], q) == 0.0  # the calls it needs, then wrong
    assert environment.score(procedure, [*early[:-1], wrong], q) == -0.5  # answered after one of its three calls
    extra = [*row["messages"][:-1], row["messages"][2], row["messages"][3], wrong]  # a fourth call, then wrong
    assert environment.score(procedure, extra, q) == -0.5


def test_the_redesigned_agent_benchmark_scores_each_kind_alike_pairs_each_question_and_guards_every_kind():
    """benchmarks/agent_rl_arms.py's primary score, by hand: the mean over kinds of greedy success (a kind of 2
    questions counts as much as one of 4), its gain paired per question, and the rule that a gain counts only when
    no kind falls more than 5 points. When every question of a kind moves alike, a bootstrap that keeps a question's
    two answers together and resamples within kinds has nowhere to go: its interval is the point."""
    arms = benchmark("agent_rl_arms")
    rows = [{"kind": k} for k in ("one", "one", "plus", "plus", "plus", "plus")]
    start = arms.by_kind({"by_row": [[0, 1.0], [1, 0.0], [2, 0.0], [3, 0.0], [4, 0.0], [5, 0.0]]}, rows)
    after = arms.by_kind({"by_row": [[5, 1.0], [4, 1.0], [3, 1.0], [2, 1.0], [1, 0.0], [0, 1.0]]}, rows)
    assert start == {"one": [1.0, 0.0], "plus": [0.0, 0.0, 0.0, 0.0]} and after["plus"] == [1.0] * 4
    assert arms.macro(start) == 25.0 and arms.macro(after) == 75.0  # (50 + 0) / 2 and (50 + 100) / 2; micro: 1/6, 5/6
    assert arms.paired_gain(after, start) == (50.0, 50.0, 50.0)  # "one" unchanged question by question, "plus" all +1
    assert arms.kind_changes(after, start) == {"one": 0.0, "plus": 100.0}
    assert arms.verdict((50.0, 50.0, 50.0), {"one": 0.0, "plus": 100.0}) == "yes"
    assert arms.verdict((20.0, 5.0, 35.0), {"one": -6.0, "plus": 46.0}) == "no: one -6.0"  # a kind left behind
    assert arms.verdict((3.0, -1.0, 7.0), {"one": 0.0, "plus": 6.0}) == "no: the interval reaches 0"
    table = [{"seed": 1, "arm": "a", "set": "val", "after": {"one": [1.0], "plus": [0.0]}},  # seeds pooled in order
             {"seed": 0, "arm": "a", "set": "val", "after": {"one": [0.0], "plus": [1.0, 1.0]}},
             {"seed": 0, "arm": "a", "set": "held", "after": {"one": [1.0], "plus": [1.0]}}]
    assert arms.pooled(table, "a", "val") == {"one": [0.0, 1.0], "plus": [1.0, 1.0, 0.0]}
    mixed = {"one": [1.0, 0.0], "plus": [1.0, 1.0, 0.0, 0.0]}
    gain, low, high = arms.paired_gain(mixed, start)
    assert gain == 25.0 and low < gain < high  # questions that moved apart: an interval around the point
    assert arms.arm_specs(["g=grpo --turn-credit state"]) == {"g": ("grpo", ["--turn-credit", "state"])}


def test_the_agent_benchmarks_step_line_shows_a_kind_falling_while_the_others_climb(tmp_path):
    """agent_rl_arms.steps_line, by hand: 3 steps in 30 s are 10.0 s a step; a third of 3 steps is one, so each kind's
    training reward is the first step's against the last's; a share is the mean over the steps that log it."""
    arms = benchmark("agent_rl_arms")
    steps = [{"step": s, "loss": 0.1, "entropy": e, "elapsed_s": 10.0 * s, "frac_reward_zero_std": z,
              "kinds/one/reward": one, "kinds/one/informative": 1.0, "kinds/plus/reward": plus}
             for s, e, z, one, plus in [(1, 0.05, 0.5, 0.5, 0.25), (2, 0.04, 0.0, 0.4, 0.5), (3, 0.02, 0.25, 0.0, 1.0)]]
    steps[1]["kinds/sum/reward"] = 1.0  # a kind drawn only in the middle third: n/a at both ends
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps) + '{"step": 3, "checkpoint": "x"}\n')
    assert arms.steps_line(tmp_path) == (
        "3 steps; 10.0 s a step; entropy 0.050 -> 0.020 nats a token; groups alike 25%; kept n/a; informative: "
        "one 100%, plus n/a, sum n/a; training reward, first third of the steps -> last: one 0.50 -> 0.00, "
        "plus 0.25 -> 1.00, sum n/a -> n/a")
