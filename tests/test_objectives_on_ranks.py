"""DPO, ORPO, KTO and GRPO on several processes (gloo, on this CPU): each test launches real ranks through torchrun or
`tunebench launch` and compares them with one process at the same global batch, as tests/test_distributed.py does
for SFT and pretraining (whose helpers these use); and what cannot train sharded is refused.
"""

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_resumed
from test_distributed import ROWS, _env, _losses, _same_weights, _train_args, _tunebench, _weights
from tunebench.machine.distributed import World


@pytest.mark.parametrize("options, why", [
    ({"train.objective": "grpo", "objective.reward": ["gsm8k"]}, "--objective grpo samples"),  # auto's pick
    ({"evaluation.eval_generate": 2, "distributed.parallel": "fsdp"}, "--eval-generate needs the whole model"),
])
def test_what_cannot_run_sharded_is_refused_when_fsdp_is_picked(options, why):
    """GRPO samples, and --eval-generate generates, with a whole model on each rank: FSDP, asked for or picked by
    auto for a model that does not fit a rank, is refused with the fix (these compared the table's row, not its
    value, with "fsdp", and never fired)."""
    from types import SimpleNamespace

    from tunebench.core.errors import TunebenchError
    from tunebench.jobs.parts import finetune_model
    from tunebench.settings.finetune import load_config

    if "distributed.parallel" in options:  # asked for: refused at load, before any output
        with pytest.raises(TunebenchError, match=why):
            load_config(options={"adapter.method": "full", **options}, world_size=2)
    cfg = load_config(options={"adapter.method": "full", **options}, world_size=1)
    opened = SimpleNamespace(world=World(rank=0, size=2, local_size=2, backend="gloo"), device=torch.device("cpu"))
    with pytest.raises(TunebenchError, match=why):
        finetune_model.pick_parallel(cfg, opened, 10**12)  # a trillion parameters fit no rank: auto shards



def _preference_data(tmp_path, objective):
    from conftest import pairs_file

    if objective == "kto":
        data = tmp_path / "judged.jsonl"
        golden = json.loads((Path(__file__).parent / "golden" / "kto.json").read_text())
        data.write_text("".join(json.dumps(r) + "\n" for r in golden["rows"]))  # 10: 8 train, steps of 4, 4, 4
        return data
    return pairs_file(tmp_path)  # 6 pairs: 5 train, steps of 4 and 1 (rank 1's share of that one: a filler)


def test_preference_objectives_fully_fine_tuned_under_fsdp_match_one_process(tmp_path):
    """FSDP2 shards the policy's weights, gradients and AdamW moments; the reference (a frozen whole copy on each
    rank: FSDP refuses LoRA, whose reference is the base with the adapter off) scores each rank's pairs."""
    for objective in ("dpo", "orpo", "kto"):
        data = _preference_data(tmp_path, objective)
        one, two = tmp_path / f"{objective}-one", tmp_path / f"{objective}-two"
        args = {"effective": 4, "objective": objective, "method": "full", "lr": "1e-3"}
        _tunebench(_train_args(data, one, 4, **args))
        _tunebench(_train_args(data, two, 2, parallel="fsdp", **args), nproc=2)
        ours, theirs = _losses(two), _losses(one)
        assert sorted(ours) == [1, 2, 3], objective
        for step in ours:
            assert ours[step] == pytest.approx(theirs[step], abs=1e-6), (objective, step)
        _same_weights(_weights(two), _weights(one))
        plan = {d["setting"]: d["value"] for d in json.loads((two / "plan.json").read_text())["decisions"]}
        assert plan["parallel"] == "fsdp" and plan["world"] == 2


@pytest.mark.parametrize("objective", ["dpo", "orpo", "kto"])
def test_preference_objectives_on_two_ranks_match_one_process(tmp_path, objective):
    """DPO and ORPO on 2 ranks x micro 1 x accumulation 2, KTO on 2 ranks x micro 2, take one process's micro-4
    steps: the loss normalised over the whole step's pairs (or judged completions), the reference pass under DDP,
    KTO's KL reference point over the global micro-step (its mismatched rows drawn across the ranks, the sums
    all-reduced), and a short last step whose rows one rank cannot share (a filler with no units); the held-out
    figures reduced across ranks. KTO accumulates too: 2 ranks x micro 1 x 2 take one process's micro 2 x 2."""
    data = _preference_data(tmp_path, objective)
    one, two = tmp_path / "one", tmp_path / "two"
    _tunebench(_train_args(data, one, 4, effective=4, objective=objective))
    # DPO's and ORPO's math has no micro batch: their ranks accumulate here; KTO's z is its micro batch's (below)
    _tunebench(_train_args(data, two, 2 if objective == "kto" else 1, effective=4, objective=objective), nproc=2)
    ours, theirs = _losses(two), _losses(one)
    assert sorted(ours) == [1, 2, 3]
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], abs=1e-6), step
    if objective == "dpo":
        assert ours[1] == pytest.approx(np.log(2), abs=1e-6)  # the policy is its reference at the first step
    if objective == "kto":  # its KL point over accumulation x ranks: a global micro-step of 2 rows both ways
        acc_one, acc_two = tmp_path / "acc-one", tmp_path / "acc-two"
        _tunebench(_train_args(data, acc_one, 2, effective=4, objective=objective))
        _tunebench(_train_args(data, acc_two, 1, effective=4, objective=objective), nproc=2)
        assert _losses(acc_two) == pytest.approx(_losses(acc_one), abs=1e-6)
        assert any(abs(_losses(acc_one)[s] - theirs[s]) > 1e-5 for s in theirs)  # z moved with the micro batch
    if objective == "kto":  # its KL reference point over the same global micro-step at every size
        # saved by 2 ranks after step 2, resumed in 1 process and on 4 ranks: the same data position, the same step 3.
        # KTO's alone: DPO's resumes took the same path (the preference batches' position, the checkpoint) without
        # the all-reduced KL point, and cost ~50 s (DPO 69 s, ORPO 19 s) for nothing KTO's does not prove
        moved, four = tmp_path / "two-then-one", tmp_path / "two-then-four"
        _tunebench(_train_args(data, moved, 2, effective=4, objective=objective, max_steps=2), nproc=2)
        shutil.copytree(moved, four)
        _tunebench(_train_args(data, moved, 4, effective=4, objective=objective, resume="auto"))
        _tunebench(_train_args(data, four, 1, effective=4, objective=objective, resume="auto"), nproc=4)
        assert _losses(moved) == pytest.approx(theirs, abs=1e-6)
        assert _losses(four) == pytest.approx(theirs, abs=1e-6)
    _same_weights(_weights(two), _weights(one))
    rows = {name: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for name, run in (("one", one), ("two", two))}
    figures = ("kl", "rewards/chosen", "rewards/rejected") if objective == "kto" else \
        ("rewards/accuracies", "rewards/margins", "logps/chosen")
    for a, b in zip(*(([r for r in rows[n] if "loss" in r]) for n in ("one", "two"))):
        for key in figures:
            # the loss above to 1e-6; the rewards, sums over whole replies after two AdamW steps whose gradients the
            # ranks add in another order, to float rounding (seen: 2.7e-6 relative)
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    mine, one_process = (json.loads((run / "summary.json").read_text()) for run in (two, one))
    held = [k for k, v in one_process.items() if k.startswith("eval_") and isinstance(v, float) and "time" not in k]
    assert "eval_loss" in held and mine["world_size"] == 2
    for key in held:  # the held-out pairs' (or completions') loss and rewards, summed over the ranks' shares
        assert mine[key] == pytest.approx(one_process[key], rel=1e-5, abs=1e-6), key


def test_each_objective_trains_on_two_ranks_at_the_defaults(tmp_path):
    """Nothing pinned but the model, the data, the length and the effective batch (the pairs file has 5 training
    rows): rank 0 measures alone (the attention kernel through
    the objective's own loss, the micro batch) while the other ranks wait for its answer. KTO's reference point
    all-reduced inside rank 0's probe step and both ranks hung for good (issue 81); every other rank test pins the
    settings, so none measured on ranks."""
    from conftest import pairs_file

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _grpo_args(tmp_path, tmp_path / "unused", 2)  # writes q.jsonl
    data = {"sft": rows, "dpo": pairs_file(tmp_path), "orpo": pairs_file(tmp_path),
            "kto": _preference_data(tmp_path, "kto"), "grpo": tmp_path / "q.jsonl", "rft": tmp_path / "q.jsonl"}
    for objective, path in data.items():
        out = tmp_path / objective
        extra = ["--reward", "format:\\d", "--num-generations", "2", "--max-completion-length", "8"] \
            if objective in ("grpo", "rft") else []
        _tunebench(["train", "--model", "tiny", "--objective", objective, "--data", str(path), "--max-steps", "2",
                    "--effective-batch-size", "4", "--output-dir", str(out), "--no-progress", *extra], nproc=2, timeout=180)
        plan = {d["setting"]: d for d in json.loads((out / "plan.json").read_text())["decisions"]}
        assert plan["world"]["value"] == 2 and plan["attention"]["reason"].startswith("measured"), objective
        assert sorted(_losses(out)) == [1, 2], objective


# GRPO's completions fixed by their prompt (not by the seed, which differs by rank), so 2 ranks and 1 process learn
# from the same ones; the script replaces the sampler and runs the command line as `python -m tunebench` would.
FIXED_GRPO = """import sys, zlib
import torch
from tunebench.interfaces import cli
from tunebench.model import decoding

sampled = decoding.decode

def fixed(model, ids, mask, max_new_tokens, eos, pad, *args, repeat=1, **kwargs):
    if repeat == 1:  # the held-out reward's greedy completions
        return sampled(model, ids, mask, max_new_tokens, eos, pad, *args, **kwargs)
    out = []
    for row, real in zip(ids, mask.bool()):
        g = torch.Generator().manual_seed(zlib.crc32(str(row[real].tolist()).encode()))
        for _ in range(repeat):
            n = int(torch.randint(1, max_new_tokens, (1,), generator=g))
            out.append(torch.randint(3, 60, (n,), generator=g).tolist() + [eos])
    width = max(map(len, out))
    return torch.tensor([r + [pad] * (width - len(r)) for r in out])

decoding.decode = fixed
sys.exit(cli.main(sys.argv[1:]))
"""


def _grpo_args(tmp_path, out, micro, *extra):
    # 18 prompts: 9 train, steps of 4, 4 and 1 (rank 1's share of that one: a filler); 9 held out, decoded in
    # batches of 8 and 1 (rank 0 takes the first, rank 1 the second)
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}) + "\n"
                            for a in range(1, 7) for b in range(1, 4)))
    lengths = tmp_path / "lengths.py"  # `answer` scores the prompt, not the completion: the held-out figures differ
    lengths.write_text("def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
                       "def answer(completions, answer, **kwargs):\n    return [float(a.split()[-1]) for a in answer]\n")
    return ["train", "--model", "tiny", "--method", "grpo", "--reward", f"{lengths}:length", "--reward", "format:\\d",
            "--reward", f"{lengths}:answer", "--reward-weights", "0.1", "1", "0.01", "--data", str(data),
            "--num-generations", "3",
            "--max-completion-length", "8", "--batch-size", str(micro), "--effective-batch-size", "4",
            "--eval-fraction", "0.5", "--precision", "fp32", "--lora-dropout", "0", "--attention", "sdpa",
            "--compile", "off", "--lr", "3e-3", "--schedule", "constant", "--warmup-ratio", "0", "--no-progress",
            "--threads", "1", "--max-steps", "3", "--output-dir", str(out), *extra]


def _steps(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.mark.parametrize("loss_type, beta", [("dapo", "0"), ("grpo", "0.04"), ("dr_grpo", "0")])
def test_grpo_on_two_ranks_matches_one_process_on_the_same_completions(tmp_path, loss_type, beta):
    """Each rank generates its own prompts' groups (a group whole on one rank, its advantages its own); the loss
    is normalised over the whole step's completions or completion tokens as the loss type says, the rewards and
    the share of groups that taught nothing summed over the ranks; a short last step leaves rank 1 a filler."""
    script = tmp_path / "fixed.py"
    script.write_text(FIXED_GRPO)
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--loss-type", loss_type, "--beta", beta)
    for out, micro, launch in ((one, 4, [sys.executable]), (two, 2, [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])):
        done = subprocess.run([*launch, str(script), *_grpo_args(tmp_path, out, micro, *extra)], capture_output=True,
                              text=True, env=_env(), timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
    ours, theirs = _steps(two), _steps(one)
    assert sorted(ours) == [1, 2, 3]
    for step, r in theirs.items():
        assert ours[step]["loss"] == pytest.approx(r["loss"], abs=1e-6), step
        for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "rewards/length/mean",
                    "kl"):
            assert ours[step][key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), (step, key)
    assert theirs[2]["reward_std"] > 0 and (theirs[3]["kl"] > 0) == (beta != "0")  # the steps taught something
    ours_w = _weights(two)
    for name, theirs_w in _weights(one).items():
        # within 2% of one lr step (3e-3): with beta, a few elements whose gradient is rounding noise (the KL term
        # is 0 at the first step) take Adam steps that turn another summation order into ~1e-5 (seen: 3.6e-5 in 2
        # of 512 elements; one process at micro 1 against micro 4: 1.6e-4); a loss normalised per rank, say,
        # moves most elements by a large part of a step
        torch.testing.assert_close(ours_w[name], theirs_w, rtol=1e-4, atol=6e-5, msg=name)
    mine, one_process = (json.loads((run / "summary.json").read_text()) for run in (two, one))
    assert mine["world_size"] == 2 and mine["generated_tokens"] == one_process["generated_tokens"]
    for key in ("eval_reward_before", "eval_reward", "eval_rewards/answer/mean", "eval_rewards/length/mean"):
        # the 9 held-out prompts' greedy completions: 8 decoded by rank 0 and 1 by rank 1, read together
        assert mine[key] == pytest.approx(one_process[key], abs=1e-6), key


# A reward that writes the prompts of each training step it scores (a group: the prompt num_generations times) to the
# file SCORED names, and kills rank 0 with SIGKILL once the checkpoint KILL_AFTER names is on disk (a real kill: no
# handler runs, the step in flight is lost). A --reward file runs in a process of its own, the rank's child: the
# rank is its parent.
RECORDER = """import json, os, signal

def seen(prompts, completions, **kwargs):
    rank = os.environ.get("RANK", "0")
    if rank == "0" and os.path.isdir(os.environ.get("KILL_AFTER", "/nonexistent")):
        os.kill(os.getppid(), signal.SIGKILL)
    if len(prompts) % 3 == 0 and prompts[0] == prompts[1]:
        with open(os.environ["SCORED"], "a") as f:
            f.write(json.dumps({"rank": rank, "prompts": prompts[::3]}) + "\\n")
    return [0.0] * len(prompts)
"""


def _scored(path, skip_first=0):
    """The prompts a run's training steps scored, each rank's first `skip_first` steps left out."""
    calls, seen = [], {}
    for line in path.read_text().splitlines():
        call = json.loads(line)
        seen[call["rank"]] = seen.get(call["rank"], 0) + 1
        if seen[call["rank"]] > skip_first:
            calls += call["prompts"]
    return sorted(calls)


def test_grpo_killed_on_two_ranks_resumes_on_two_one_and_four(tmp_path):
    """Sampled for real: a 2-rank run killed with SIGKILL in step 3 resumes on 2 ranks to the uninterrupted run's
    rewards and losses (each rank draws as it did), and on 1 and on 4 ranks from the same data position: steps 3
    and 4 learn from the same prompts (a short last step, then the next epoch's first)."""
    recorder = tmp_path / "seen.py"
    recorder.write_text(RECORDER)

    def run(out, nproc, *extra, **env):
        args = _grpo_args(tmp_path, out, 4 // nproc, "--reward", f"{recorder}:seen", "--reward-weights", "0.1", "1",
                          "0.01", "0", "--max-steps", "4", "--save-steps", "1", *extra)
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
        return subprocess.run([sys.executable, *launch, "-m", "tunebench", *args], capture_output=True, text=True,
                              env={**_env(), "SCORED": str(out) + ".scored", **env}, timeout=300)

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run(whole, 2).returncode == 0
    done = run(killed, 2, KILL_AFTER=str(killed / "checkpoints" / "step-00000002"))
    assert done.returncode != 0 and "SIGKILL" in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in (killed / "checkpoints").glob("step-*"))[-1] == "step-00000002"
    for nproc in (1, 4):
        shutil.copytree(killed, tmp_path / f"on-{nproc}")
    expected = _scored(Path(f"{whole}.scored"), skip_first=2)  # steps 3 and 4 (each rank had prompts in 1 and 2)
    for out, nproc in ((killed, 2), (tmp_path / "on-1", 1), (tmp_path / "on-4", 4)):
        Path(f"{out}.scored").unlink(missing_ok=True)
        resumed = run(out, nproc, "--resume", "auto")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert _scored(Path(f"{out}.scored")) == expected, nproc
        assert_resumed(out, 2, resumed.stdout)
        steps = _steps(out)
        assert sorted(steps) == [1, 2, 3, 4] and json.loads((out / "summary.json").read_text())["world_size"] == nproc
        for step in (1, 2):  # before the kill: the 2-rank run's own figures
            assert steps[step]["reward"] == pytest.approx(_steps(whole)[step]["reward"], abs=1e-6)
    for step, r in _steps(whole).items():  # on 2 ranks again, the uninterrupted run's draws, rewards and losses
        assert _steps(killed)[step]["reward"] == pytest.approx(r["reward"], abs=1e-6), step
        assert _steps(killed)[step]["loss"] == pytest.approx(r["loss"], abs=1e-6), step
    assert _steps(whole)[3]["reward_std"] > 0 or _steps(whole)[4]["reward_std"] > 0  # sampling made groups differ


@pytest.mark.usefixtures("children_in_process")
def test_compare_runs_preference_and_grpo_rows_on_two_ranks_beside_sft(tmp_path):
    """A matrix whose SFT row runs in one process and whose DPO and GRPO rows set nproc 2: each results row says its
    objective and processes, DPO its held-out reward accuracy, GRPO its held-out reward; the report lists them."""
    from conftest import pairs_file
    from tunebench.jobs import compare, report

    pairs = pairs_file(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _grpo_args(tmp_path, tmp_path / "unused", 2)  # writes q.jsonl and lengths.py
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(
        f"base: {{model.name: tiny, data.path: '{rows}', train.max_steps: 2, train.effective_batch_size: 4, "
        "hardware.precision: fp32, train.compile: 'off', data.eval_fraction: 0.2}\n"
        "experiments:\n  - {name: sft}\n"
        f"  - {{name: dpo, nproc: 2, set: {{data.path: '{pairs}', objective.name: dpo}}}}\n"
        f"  - {{name: grpo, nproc: 2, set: {{data.path: '{tmp_path / 'q.jsonl'}', objective.name: grpo, "
        f"objective.reward: ['{tmp_path / 'lengths.py'}:length'], objective.num_generations: 2, "
        "objective.max_completion_length: 8}}\n")
    out = tmp_path / "results.csv"
    compare.run(str(matrix), str(out), str(tmp_path / "runs"), 1, {})
    with out.open() as f:
        got = {r["experiment"]: r for r in csv.DictReader(f)}
    assert {r["status"] for r in got.values()} == {"ok"}, [r["message"] for r in got.values()]
    assert [(got[n]["objective"], got[n]["processes"]) for n in ("sft", "dpo", "grpo")] == [
        ("sft", "1"), ("dpo", "2"), ("grpo", "2")]
    assert got["dpo"]["reward_accuracy"] != "" and got["grpo"]["reward"] != "" and got["sft"]["reward"] == ""
    text = (report.write([str(out)], str(tmp_path / "report")).parent / "report.md").read_text()
    runs = text.split("## All runs")[1]
    assert all(f"| {n} |" in runs for n in ("sft", "dpo", "grpo")) and "| objective |" in runs
    assert "grpo" in text.split("## Held-out reward (GRPO), before training and after")[1].split("##")[0]
