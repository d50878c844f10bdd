"""GRPO: rewards, group advantages, the loss against TRL's GRPOTrainer (tests/golden/make_grpo_golden.py: the same
completions handed to both), sampling that depends on (seed, epoch, step) only, exact resume, and the command line."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_resumed, run_losses, sigterm_after_step
from tunebench.core.errors import TunebenchError
from tunebench.interfaces.cli import main
from tunebench.jobs import grpo as grpo_job
from tunebench.model import decoding
from tunebench.settings.finetune import load_config
from tunebench.settings.objectives import GRPO
from tunebench.training import grpo
from tunebench.training.grpo import rewards, rft

GOLDEN = json.loads((Path(__file__).parent / "golden" / "grpo.json").read_text())


def test_builtin_rewards_score_what_they_say():
    cols = {"answer": ["he had 3 + 4 = 7\n#### 7", "#### 12", "Paris", "Paris"]}
    completions = ["So the answer is 7.", "it is 1 or 2", "paris", "The capital is Paris."]
    score = {r.name: r.score([""] * 4, completions, cols) for r in rewards.parse(
        ["gsm8k", "format:^So", "exact", "contains"], None)}
    assert score == {"gsm8k": [1.0, 0.0, 0.0, 0.0], "format": [1.0, 0.0, 0.0, 0.0],
                     "exact": [0.0, 0.0, 0.0, 0.0], "contains": [0.0, 0.0, 0.0, 1.0]}


@pytest.mark.parametrize("specs, weights, message", [
    (["format:("], None, "the regex does not compile"),
    (["gsm8k", "gsm8k"], None, "names one reward twice"),
    (["nope"], None, "is not one of gsm8k, format, exact, contains nor path/to/file.py:function"),
    (["missing.py:fn"], None, "no file missing.py"),
])
def test_a_reward_that_cannot_be_built_is_refused_with_the_fix(specs, weights, message):
    with pytest.raises(TunebenchError, match=message):
        rewards.parse(specs, weights)


@pytest.mark.timeout(120, method="thread")  # a revert runs the pattern in `re` with the GIL held: ended, not hung
def test_a_reward_file_runs_in_a_process_of_its_own_under_a_limit_and_a_format_pattern_ends(tmp_path, monkeypatch):
    """N8: a --reward function that never returns ends the run in one line (it ran in the trainer, and hung it),
    and a format: pattern that cannot decide in time does not match."""
    import os
    import threading

    path = tmp_path / "mine.py"
    path.write_text("import os, time\n"
                    "def slow(completions, **kwargs):\n    time.sleep(60)\n    return [1.0] * len(completions)\n"
                    "def where(completions, **kwargs):\n    return [float(os.getpid())] * len(completions)\n")
    monkeypatch.setattr(rewards, "CALL_S", 1.0)
    slow, where = rewards.parse([f"{path}:slow", f"{path}:where"], None)
    assert where.score(["p"], ["c"], {}) != [float(os.getpid())]  # another process
    with pytest.raises(TunebenchError, match=r"reward slow \(.*mine.py\) gave no answer within 1 s on 1 completions"):
        slow.score(["p"], ["c"], {})
    fmt = rewards.parse(["format:^(a|aa)+$"], None)[0]
    got = []
    judge = threading.Thread(target=lambda: got.append(fmt.score([""] * 2, ["a" * 50 + "b", "aaa"], {})), daemon=True)
    judge.start()
    judge.join(60)  # the limit is PATTERN_S
    assert got == [[0.0, 1.0]]


def test_advantages_are_each_rewards_distance_from_its_groups_mean_in_group_stds():
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0],  # group 1
                           [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])  # group 2: no spread
    adv, total, zero = grpo.advantages(scores, torch.tensor([1.0, 0.5]), 4, "group")
    group = torch.tensor([1.0, 0.5, 1.5, 0.0])
    assert total[:4].tolist() == group.tolist()
    assert adv[:4] == pytest.approx(((group - group.mean()) / (group.std() + 1e-4)).tolist(), abs=1e-6)
    assert adv[4:].tolist() == [0.0] * 4 and zero.tolist() == [False] * 4 + [True] * 4
    adv, _, _ = grpo.advantages(scores, torch.tensor([1.0, 0.5]), 4, "none")
    assert adv[:4] == pytest.approx((group - group.mean()).tolist())


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_groups_that_teach_nothing_leave_the_update_with_the_same_loss_and_gradients(tiny, loss_type):
    """At beta 0 a group whose advantages are all 0 adds 0 to the loss and its gradient: its rows are left out of
    the forward and backward (counted in frac_groups_skipped), and the step's loss, gradients and every other stat
    are the ones all rows give; a micro batch of such groups alone still runs one row, to no effect."""
    from tunebench.data.prompts import PromptData
    from tunebench.training.objective import prepare

    model, tok = tiny.model, tiny.tokenizer
    data = PromptData([[5, 6, 7], [8, 9], [10, 11, 12, 13]], torch.arange(3).numpy(), 0)
    completions = [[20, 21, 2], [22, 2], [23, 24, 25, 2], [26, 2], [27, 28, 2], [29, 2]]
    groups = grpo.Groups([0, 1, 2], completions, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.7, -0.7]),
                         torch.arange(18, dtype=torch.float32).reshape(6, 3))
    settings = GRPO(num_generations=2, max_completion_length=8, loss_type=loss_type)
    objective = grpo.GRPOLoss(model, settings, [rewards.Reward("r", 1.0, lambda p, c, cols: [])])

    def step(keys, skip):
        batch, _, _ = prepare(grpo.rows_of(groups, keys, data, 2, tok.pad_token_id, "groups" if skip else ""),
                              torch.device("cpu"))
        model.zero_grad(set_to_none=True)
        loss, stats = objective(batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return batch, loss.detach(), stats, grads

    whole, skipped = step([0, 1, 2], False), step([0, 1, 2], True)
    assert whole[0]["input_ids"].shape[0] == 6 and skipped[0]["input_ids"].shape[0] == 4  # group 1 left out
    assert skipped[1] == pytest.approx(float(whole[1]), abs=1e-6)
    assert max(float(g.abs().max()) for g in whole[3].values()) > 0.1  # the other groups teach something
    torch.testing.assert_close(skipped[2][:-1], whole[2][:-1])  # kl and every completion's stats
    names = objective.stat_names
    assert names[-1] == "frac_groups_skipped" and (float(whole[2][-1]), float(skipped[2][-1])) == (0.0, 2.0)
    for name, grad in whole[3].items():  # to fp32 rounding: other batch shapes sum in another order (seen: 3e-7
        torch.testing.assert_close(skipped[3][name], grad, rtol=1e-5, atol=1e-6, msg=name)  # of gradients up to 1.1)
    alone = step([1], True)  # only the alike group: one row runs, adding nothing
    assert alone[0]["input_ids"].shape[0] == 1 and float(alone[1]) == 0.0 and float(alone[2][-1]) == 2.0
    assert all(float(g.abs().max()) == 0.0 for g in alone[3].values())


def test_a_later_update_of_a_draw_takes_its_ratio_against_the_draws_log_probabilities_and_clips(tiny):
    """--num-iterations: a micro batch carrying the log-probabilities its draw had (old_logps) gets the PPO ratio
    against them. Hand-computed: every ratio e^0.5 = 1.65 > 1 + epsilon; a positive advantage's token is clipped
    (-1.2 A, no gradient), a negative one's is not (-1.65 A); the dapo loss is their sum over the step's tokens
    times completions / tokens. With old_logps equal to this pass's the loss and gradients are the ratio-1 ones."""
    from tunebench.data.prompts import PromptData
    from tunebench.training.objective import prepare
    from tunebench.training.preference import token_logps

    model, tok = tiny.model, tiny.tokenizer
    data = PromptData([[5, 6, 7], [8, 9]], torch.arange(2).numpy(), 0)
    groups = grpo.Groups([0, 1], [[20, 21, 2], [22, 2], [23, 24, 25, 2], [26, 2]],
                         torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.zeros(4, 3))
    objective = grpo.GRPOLoss(model, GRPO(num_generations=2, max_completion_length=8, loss_type="dapo"),
                              [rewards.Reward("r", 1.0, lambda p, c, cols: [])])
    batch, _, _ = prepare(grpo.rows_of(groups, [0, 1], data, 2, tok.pad_token_id), torch.device("cpu"))
    with torch.no_grad():
        now = token_logps(model, batch, batch["loss_index"], None)

    def update(old, advantages):
        model.zero_grad(set_to_none=True)
        loss, _ = objective({**batch, "advantages": advantages} | ({} if old is None else {"old_logps": old}))
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    row = batch["loss_index"] // (batch["input_ids"].shape[1] - 1)
    adv = batch["advantages"][row]
    ratio = math.exp(0.5)
    per_token = torch.where(adv > 0, -(1 + 0.2) * adv, -ratio * adv)
    expected = float(per_token.sum() * batch["totals"][0] / batch["totals"][1])
    assert update(now - 0.5, batch["advantages"])[0] == pytest.approx(expected, rel=1e-5)
    clipped = update(now - 0.5, batch["advantages"].abs())  # every advantage positive: every token clipped
    assert all(float(g.abs().max()) == 0.0 for g in clipped[1].values())
    same, first = update(now, batch["advantages"]), update(None, batch["advantages"])
    assert same[0] == pytest.approx(first[0], abs=1e-6)
    for name, grad in first[1].items():
        torch.testing.assert_close(same[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # rows padded to a multiple of 16 (a CPU's bf16: fewer lengths, fewer kernels) train the same: the padding
    # is masked out of the attention and the loss
    rounded, _, _ = prepare(grpo.rows_of(groups, [0, 1], data, 2, tok.pad_token_id, "", 16, 64), torch.device("cpu"))
    assert rounded["input_ids"].shape[1] == 16 > batch["input_ids"].shape[1]
    model.zero_grad(set_to_none=True)
    padded, _ = objective(rounded)
    assert float(padded) == pytest.approx(first[0], rel=1e-5)


def test_each_draw_trains_num_iterations_steps_and_its_later_steps_move_the_ratio(tmp_path, monkeypatch, capsys):
    """--num-iterations 2 over 4 steps: 2 draws (steps 1 and 3), each trained on twice; a draw's second step logs
    its rewards again and a loss of its own (at ratio 1 a dapo loss is -sum(A) x completions / tokens, the same
    for both steps: the draw's log-probabilities reach the second), and the plan says so."""
    drawn = []
    real = grpo.Completions.seeded
    monkeypatch.setattr(grpo.Completions, "seeded", lambda self, seed: drawn.append(seed) or real(self, seed))
    out = tmp_path / "iterations"
    assert main(_sampled(tmp_path, out, **{"--num-iterations": 2, "--eval-fraction": 0})) == 0
    assert len(drawn) == 2 and drawn[0] != drawn[1]
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4]
    for first, again in ((1, 2), (3, 4)):
        for key in ("reward", "reward_std", "completions/mean_length"):
            assert rows[again][key] == rows[first][key], (again, key)
    assert any(rows[a]["loss"] != pytest.approx(rows[f]["loss"], abs=1e-7) for f, a in ((1, 2), (3, 4)))
    assert "each draw trained on for 2 steps, their ratios against its log-probabilities when drawn" in \
        capsys.readouterr().out


def _config(tmp_path, name, **extra):
    s = GOLDEN["settings"][name]
    (tmp_path / "rewards.py").write_text(GOLDEN["rewards"])
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": GOLDEN["prompt"]}) + "\n" for _ in range(8)))
    return load_config(options={
        "model.name": "tiny", "data.path": str(data), "data.template": GOLDEN["template"], "data.max_length": 256,
        "data.eval_fraction": 0.0, "adapter.method": "grpo", "adapter.r": 8, "adapter.lora_alpha": 16,
        "adapter.lora_dropout": 0.0, "adapter.reward": [f"{tmp_path / 'rewards.py'}:length",
                                                        f"{tmp_path / 'rewards.py'}:five"],
        "adapter.reward_weights": GOLDEN["weights"], "adapter.num_generations": GOLDEN["group"],
        "adapter.max_completion_length": GOLDEN["max_completion_length"], "adapter.temperature": GOLDEN["temperature"],
        "adapter.beta": s["beta"], "adapter.loss_type": s["loss_type"], "adapter.scale_rewards": s["scale_rewards"],
        "train.effective_batch_size": 1, "train.micro_batch_size": 1, "train.max_steps": GOLDEN["steps"],
        "train.lr": GOLDEN["lr"], "train.schedule": "linear", "train.warmup_ratio": 0.0, "train.weight_decay": 0.0,
        "train.max_grad_norm": 1.0, "train.precision": "fp32", "train.seed": GOLDEN["seed"],
        "train.output_dir": str(tmp_path / name), "train.progress": False, **extra})


@pytest.mark.parametrize("name", ["dapo", "dr_grpo", "grpo"])
def test_losses_rewards_and_kl_match_trls_grpo_trainer_on_the_same_completions(tmp_path, monkeypatch, tiny, name):
    tok = tiny.tokenizer
    table = [[tok(c + tok.eos_token, add_special_tokens=False)["input_ids"] for c in group]
             for group in GOLDEN["completions"]]
    calls = []

    real = decoding.decode

    def fixed(model, ids, mask, max_new_tokens, eos, pad, *args, repeat=1, **kwargs):
        if repeat == 1:  # the held-out reward's greedy completions
            return real(model, ids, mask, max_new_tokens, eos, pad, *args, **kwargs)
        assert ids.shape[0] == 1 and repeat == GOLDEN["group"]  # a step's group: TRL's completions
        calls.append(repeat)
        rows = table[len(calls) - 1]
        width = max(map(len, rows))
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows])

    monkeypatch.setattr(decoding, "decode", fixed)
    grpo_job.run(_config(tmp_path, name))
    steps = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    golden = GOLDEN[name]
    assert len(calls) == len(steps) == len(golden) == GOLDEN["steps"]
    for ours, theirs in zip(steps, golden):
        for key, value in theirs.items():
            assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (ours["step"], key)
    if GOLDEN["settings"][name]["beta"]:
        assert golden[-1]["kl"] > 0.1  # the policy really moved from its reference


def _gsm8k_prompts(tmp_path) -> Path:
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}",
                                        "kind": "small" if a + b <= 4 else "large"}) + "\n"
                            for a in range(1, 5) for b in range(1, 4)))
    return path


def _sampled(tmp_path, out, **extra):
    return ["train", "--model", "tiny", "--method", "grpo", "--reward", "gsm8k", "--reward", "format:\\d",
            "--reward-weights", "1", "0.5", "--data", str(_gsm8k_prompts(tmp_path)), "--num-generations", "3",
            "--max-completion-length", "8", "--effective-batch-size", "2", "--max-steps", "4", "--precision", "fp32",
            "--no-progress", "--output-dir", str(out), *[str(x) for kv in extra.items() for x in kv]]


def test_the_sampled_completions_depend_on_seed_and_step_not_the_micro_batch_and_a_resume_is_exact(tmp_path):
    """The same run as 1 x (2 prompts) and as 2 x (1 prompt), and stopped by SIGTERM at step 2 and resumed: the
    same rewards, losses and adapter (sampling is seeded by (seed, epoch, step) and made for the whole step), with
    the groups that scored alike drawn again (--resample-alike, seeded by the step and the round)."""
    one, two, stopped = tmp_path / "one", tmp_path / "two", tmp_path / "stopped"
    common = {"--eval-fraction": 0.25, "--resample-alike": 2}
    assert main(_sampled(tmp_path, one, **{"--batch-size": 2, **common})) == 0
    assert main(_sampled(tmp_path, two, **{"--batch-size": 1, **common})) == 0
    with sigterm_after_step(2):
        assert main(_sampled(tmp_path, stopped, **{"--batch-size": 2, **common})) == 130
    assert main(_sampled(tmp_path, stopped, **{"--batch-size": 2, **common, "--resume": "auto"})) == 0
    assert_resumed(stopped, 2)

    def rows(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    base = {r["step"]: r for r in rows(one) if "loss" in r}
    assert sorted(base) == [1, 2, 3, 4]
    for other in (two, stopped):
        theirs = {r["step"]: r for r in rows(other) if "loss" in r}
        for step, r in base.items():
            for key in ("reward", "reward_std", "completions/mean_length", "rewards/format/mean"):
                assert theirs[step][key] == pytest.approx(r[key], abs=1e-6), (other.name, step, key)
            assert theirs[step]["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-6)
    from safetensors.torch import load_file
    a, b = load_file(one / "adapter_model.safetensors"), load_file(stopped / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((one / "summary.json").read_text())
    assert summary["objective"] == "grpo" and summary["generated_tokens"] > 0
    assert summary["groups_redrawn"] >= summary["groups_refilled"] >= 0 and summary["groups_redrawn"] > 0
    assert summary["generation_tokens_per_s"] > 0 and summary["update_tokens_per_s"] > 0
    assert math.isfinite(summary["eval_reward_before"]) and math.isfinite(summary["eval_reward"])


def test_grpo_from_the_command_line_prints_its_settings_and_the_held_out_reward(tmp_path, capsys, monkeypatch):
    from tunebench.machine.monitor import CoreShare

    # a run whose cores others took more than a fifth of teaches the next run nothing, and the suite's other worker
    # may take them: read as none, as what the second run below tests is the learning
    monkeypatch.setattr(CoreShare, "shared", lambda self: 0.0)
    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))  # an empty cache: the first run of its shape
    out = tmp_path / "run"
    assert main(_sampled(tmp_path, out, **{"--eval-fraction": 0.25, "--precision": "bf16", "--beta": 0.04,
                                           "--kind-column": "kind"})) == 0
    printed = capsys.readouterr().out
    assert re.search(r"time_estimate +not yet +its steps sample \(GRPO, RFT\)", printed)  # no probe times the sampling
    # planned: the loss's log-probabilities at the widest rows' completions, and the step's 2 prompts x 3 episodes'
    # caches while they are decoded
    assert re.search(r"memory_plan .* the larger of the training pass \(activations .* \+ log-probabilities [\d.]+ "
                     r"[MG]B \([\d,]+ loss positions x the vocabulary\)\) and sampling's KV caches [\d.]+ [MG]B \(6 "
                     r"episodes x \d+ tokens\)", printed)
    assert re.search(r"seconds a step +not predicted, measured [\d.]+ s", printed) is None  # said only when predicted
    assert "rewards: gsm8k x 1, format x 0.5" in printed
    assert re.search(r"objective +grpo +3 completions a prompt of up to 8 tokens at temperature 1 .*beta 0.04; "
                     r"reference: the base: the adapter at its starting values", printed)
    assert re.search(r"held-out reward before training: [\d.]+, gsm8k [\d.]+, format [\d.]+ on 3 prompts", printed)
    assert "sampling: " in printed and "generated tokens/s" in printed
    split = re.search(r"step time: prefill ([\d.]+)s, decode ([\d.]+)s, tools ([\d.]+)s, scoring ([\d.]+)s, "
                      r"update ([\d.]+)s", printed)
    assert split and float(split[2]) > 0 and float(split[3]) == 0  # no environment: no tools
    assert sorted(run_losses(out)) == [1, 2, 3, 4]
    first = next(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line)
    assert {"reward", "reward_std", "kl", "frac_reward_zero_std", "completions/mean_length", "rewards/gsm8k/mean",
            "rewards/format/mean"} <= set(first)
    # the collapse watch: the sampling's entropy (nats: above 0, at most the vocabulary's log) and each kind's figures
    assert 0 < first["entropy/first_token"] <= math.log(512) and 0 < first["entropy"] <= math.log(512)
    kinds = {k for k in first if k.startswith("kinds/")}
    assert kinds and kinds <= {f"kinds/{k}/{v}" for k in ("small", "large") for v in ("reward", "informative", "count")}
    assert main(["report", str(out)]) == 0  # the run's report draws the rewards, the KL, the entropy and the kinds
    assert {"grpo_rewards.png", "grpo_kl.png", "grpo_entropy.png", "grpo_kinds.png"} <= {
        f.name for f in (out / "report").iterdir()}
    assert "GRPO: the mean reward of each step's completions" in (out / "report" / "report.md").read_text()
    # the next run of the shape predicts its time from what this one took a step
    step_s = json.loads((out / "summary.json").read_text())["plan_check"]["seconds_a_step"]["measured"]
    again = tmp_path / "again"
    assert main(_sampled(tmp_path, again, **{"--eval-fraction": 0.25, "--precision": "bf16", "--beta": 0.04,
                                             "--max-steps": 2, "--time-budget": "30m"})) == 0
    rows = {d["setting"]: d for d in json.loads((again / "plan.json").read_text())["decisions"]}
    # a time budget is a deadline for steps that sample (no probe gives their time): the steps asked stay the most
    assert re.match(r"at most 2: --time-budget 30m ends the run after the step that finishes past \d+ s of training",
                    rows["total_steps"]["reason"]) and rows["total_steps"]["value"] == 2
    estimate = rows["time_estimate"]
    assert estimate["reason"].startswith(f"2 steps at {step_s:.1f} s a step, what the last run at micro ")
    assert rows["pad_to_multiple_of"]["value"] == 16  # bf16 on a CPU: the groups' rows rounded as SFT's are
    check = json.loads((again / "summary.json").read_text())["plan_check"]
    assert check["seconds_a_step"]["predicted"] == step_s and check["train_time_s"]["predicted"] == round(2 * step_s, 2)


@pytest.mark.parametrize("options, message", [
    ({"adapter.num_generations": 1}, "--num-generations must be 2 or more"),
    ({"objective.resample_alike": -1}, "--resample-alike must be 0 .off. or more"),
    ({"adapter.loss_type": "bnpo"}, "objective.loss_type .bnpo. is not one of dapo, grpo, dr_grpo"),
    ({"adapter.temperature": 0.0}, "--temperature must be above 0"),
    ({"evaluation.eval_generate": 4}, "GRPO's prompts have none"),
    ({"adapter.reward": []}, "needs at least one --reward"),
    ({"adapter.reward": ["gsm8k", "format:x"], "adapter.reward_weights": [1.0]}, "gives 1 weight.s. for 2 reward"),
])
def test_grpo_settings_are_checked_at_load(options, message):
    with pytest.raises(TunebenchError, match=message):
        load_config(options={"adapter.method": "grpo", "adapter.reward": ["gsm8k"]} | options)


def test_grpo_settings_belong_to_grpo_and_default_to_trls():
    with pytest.raises(TunebenchError, match="--num-generations is GRPO's and RFT's, and this run's objective is sft"):
        load_config(options={"adapter.num_generations": 4})
    o = load_config(options={"adapter.method": "grpo", "objective.reward": "gsm8k"}).objective
    assert (o.beta, o.num_generations, o.temperature, o.epsilon, o.epsilon_high, o.loss_type, o.scale_rewards,
            o.reward) == (0.0, 8, 1.0, 0.2, 0.2, "dapo", "group", ("gsm8k",))


def test_a_users_reward_gets_the_prompts_as_the_model_saw_them_and_the_rows_columns(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def seen(prompts, completions, answer, **kwargs):\n"
        "    assert len(prompts) == len(completions) == len(answer)\n"
        "    for p, a in zip(prompts, answer):\n"
        "        assert p.startswith('Q: What is ') and p.endswith('\\nA:'), p\n"
        "        assert a.startswith('#### ') and a[5:].isdigit(), a\n"
        "    return [float(len(c) % 2) for c in completions]\n")
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--method", "grpo", "--reward", f"{tmp_path / 'mine.py'}:seen",
                 "--data", str(_gsm8k_prompts(tmp_path)), "--template", "Q: {instruction}\nA:", "--num-generations",
                 "2", "--max-completion-length", "4", "--effective-batch-size", "2", "--max-steps", "2",
                 "--eval-fraction", "0", "--no-progress", "--output-dir", str(out)]) == 0
    assert sorted(run_losses(out)) == [1, 2]


def test_prompts_come_as_text_chat_messages_gsm8k_questions_or_instruction_rows(tmp_path):
    from tunebench.data import prompts
    from tunebench.settings.finetune import DataConfig

    def read(*rows):
        path = tmp_path / "p.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        found = prompts.load(DataConfig(path=str(path)))
        return found.prompts, found.columns

    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a reply given with it"}]
    assert read({"prompt": "hi", "answer": "1"}, {"prompt": chat, "answer": "2"}) == (
        [[{"role": "user", "content": "hi"}], chat[:1]], [{"answer": "1"}, {"answer": "2"}])
    assert read({"question": "2+2?", "answer": "#### 4"})[0] == [[{"role": "user", "content": "2+2?"}]]
    assert read({"instruction": "do", "input": "x", "output": "y"})[0] == [[{"role": "user", "content": "do\n\nx"}]]
    assert read({"messages": chat})[0] == [chat[:1]]
    with pytest.raises(TunebenchError, match="has no prompt column .it has text."):
        read({"text": "plain"})


def test_balanced_steps_take_each_kind_in_turn_and_every_prompt_once():
    """--balance-kinds: kinds a (5 prompts), b (3), c (1) in steps of 3: while each kind has prompts every step
    holds all three, then the rest interleave; each prompt once an epoch; the same for the same seed and epoch."""
    from tunebench.data import batching

    kind_of = {i: k for i, k in enumerate("aaaaabbbc")}
    steps = batching.balanced_steps(np.arange(9), {i: "abc".index(k) for i, k in kind_of.items()}, 3, 5, 0)
    assert sorted(sum(steps, [])) == list(range(9)) and [len(s) for s in steps] == [3, 3, 3]
    assert sorted(kind_of[i] for i in steps[0]) == ["a", "b", "c"]  # the first round: one of each
    assert sorted(kind_of[i] for i in steps[1]) == ["a", "a", "b"] or sorted(kind_of[i] for i in steps[1]) == [
        "a", "b", "b"]  # c is spent: a and b in turn
    assert steps == batching.balanced_steps(np.arange(9), {i: "abc".index(k) for i, k in kind_of.items()}, 3, 5, 0)
    assert steps != batching.balanced_steps(np.arange(9), {i: "abc".index(k) for i, k in kind_of.items()}, 3, 5, 1)
    with pytest.raises(TunebenchError, match="--balance-kinds interleaves"):
        load_config(options={"adapter.method": "grpo", "adapter.reward": ["gsm8k"], "objective.balance_kinds": True})


def test_weigh_kinds_gives_each_kind_that_teaches_an_equal_share_of_the_update():
    """--weigh-kinds, hand-worked: groups of 2; prompts 0 and 1 of kind a and 2 of kind b teach (rewards 1 and 0),
    3 of kind b scores alike. 3 groups teach, 2 kinds: a's groups x 3/4, b's x 3/2, so each kind's credit sums to
    the same; the silent group stays 0; per-turn credit is scaled alike; off, the advantages are GRPO's own. On by
    default where the rows carry a kind column, off without one."""
    from types import SimpleNamespace

    from tunebench.training.grpo import steps as steps_
    from tunebench.training.grpo import watch as watch_

    kinds = watch_.Kinds.of("kind", [{"kind": k} for k in "aabb"])
    scores = torch.tensor([[1.0], [0.0]] * 3 + [[0.0], [0.0]])
    drawn = grpo.Drawn([[k, j] for k in range(4) for j in range(2)], scores, torch.ones(8), torch.zeros(8))

    def credit(weigh: bool) -> list[float]:
        s = GRPO(num_generations=2, reward=("exact",), kind_column="kind", weigh_kinds=weigh)
        draws = SimpleNamespace(on=SimpleNamespace(s=s, data=SimpleNamespace(source=lambda k: k)), weights=torch.ones(1))
        return steps_.StepRows(draws, kinds).groups_of([0, 1, 2, 3], drawn).advantages.tolist()

    plain = 0.5 / (0.5 ** 0.5 + 1e-4)  # (1 - 0.5) / (Bessel's std of 1 and 0 + 1e-4)
    assert credit(False) == pytest.approx([plain, -plain] * 3 + [0.0, 0.0])
    weighed = credit(True)
    assert weighed == pytest.approx([0.75 * plain, -0.75 * plain] * 2 + [1.5 * plain, -1.5 * plain, 0.0, 0.0])
    assert sum(map(abs, weighed[:4])) == pytest.approx(sum(map(abs, weighed[4:])))
    assert rft.balanced([True, True], [0, 0]).tolist() == [1.0, 1.0]  # one kind among the groups: unchanged
    groups = grpo.Groups([0], [[1, 2], [3]], torch.tensor([1.0, -1.0]), torch.zeros(2, 1),
                         token_advantages=[[0.5, 1.0], [-1.0]])
    groups.scale(torch.tensor([2.0, 2.0]))
    assert groups.advantages.tolist() == [2.0, -2.0] and groups.token_advantages == [[1.0, 2.0], [-2.0]]
    assert GRPO(reward=("exact",), kind_column="kind").weigh_kinds and not GRPO(reward=("exact",)).weigh_kinds
    with pytest.raises(TunebenchError, match="--weigh-kinds gives each kind"):
        load_config(options={"adapter.method": "grpo", "adapter.reward": ["gsm8k"], "objective.weigh_kinds": True})


def test_negative_weight_scales_only_the_credit_below_zero():
    """--negative-weight 0.5, hand-worked: a group of 4 scoring 1, 0, 0, 0 has mean 0.25 and Bessel's std 0.5, so
    GRPO's advantages are 0.75 / 0.5001 and -0.25 / 0.5001; the failures' halve, the success's stays; per-turn
    credit below 0 halves alike, above 0 stays; 1 is GRPO's own (the default without an environment; with one, 0.5,
    unless told 1); below 0 and infinity are refused."""
    from tunebench.training.grpo import Advantages

    drawn = grpo.Drawn([[1], [2], [3], [4]], torch.tensor([[1.0], [0.0], [0.0], [0.0]]), torch.ones(4),
                       torch.zeros(4), turn_rewards=[{0: 0.0, 1: 1.0}, {0: 0.0, 1: 0.0}, {0: 1.0}, {0: 0.0}],
                       turn_of=[[0, 1], [0, 1], [0], [0]])

    def credit(weight: float) -> tuple[list[float], list[list[float]]]:
        s = GRPO(num_generations=4, reward=("exact",), negative_weight=weight)
        return Advantages(s).of(drawn, torch.ones(1), [])[0].tolist(), Advantages(s).per_token(drawn)

    std = 0.5 + 1e-4
    assert credit(1.0)[0] == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])
    assert credit(0.5)[0] == pytest.approx([0.75 / std, -0.125 / std, -0.125 / std, -0.125 / std])
    assert credit(0.0)[0] == pytest.approx([0.75 / std, 0.0, 0.0, 0.0])
    plain, halved = credit(1.0)[1], credit(0.5)[1]
    assert any(a < 0 for row in plain for a in row) and any(a > 0 for row in plain for a in row)
    assert halved == [[a / 2 if a < 0 else a for a in row] for row in plain]
    assert GRPO(reward=("exact",)).negative_weight == 1.0 and GRPO(environment="builtin:lookup").negative_weight == 0.5
    assert GRPO(environment="builtin:lookup", negative_weight=1.0).negative_weight == 1.0
    for bad, said in ((-1, "--negative-weight must be 0"), (float("inf"), "must be a finite number")):
        with pytest.raises(TunebenchError, match=said):
            load_config(options={"adapter.method": "grpo", "adapter.reward": ["gsm8k"], "objective.negative_weight": bad})


def test_a_group_that_scored_alike_is_drawn_again_until_it_teaches_up_to_the_rounds_asked():
    """DAPO's dynamic sampling for the step's own prompts, hand-worked: prompt 0's group scores alike at the step's
    seed and differs at round 1's, prompt 1's differs at once, prompt 2's never does. Round 1 draws 0 and 2 again
    and 0's fresh group takes its place; round 2 draws 2 alone; 1's completions are never touched."""
    from types import SimpleNamespace

    import numpy as np

    class Fake:
        def __init__(self, rounds):
            self.on = SimpleNamespace(s=SimpleNamespace(num_generations=2, resample_alike=rounds), refills=[0, 0])
            self.weights, self.calls = torch.ones(1), []

        def draw(self, keys, seed):
            self.calls.append((list(keys), seed))
            differs = [k == 1 or (k == 0 and seed != 7) for k in keys]
            scores = torch.tensor([[v] for d in differs for v in ((1.0, 0.0) if d else (0.0, 0.0))])
            return grpo.Drawn([[k, seed, j] for k in keys for j in range(2)], scores, torch.ones(len(scores)),
                              torch.zeros(len(scores)))

    def seed(r):
        return int(np.random.SeedSequence([7, r]).generate_state(1)[0])

    fake = Fake(2)
    drawn = grpo.refill(fake, fake.draw([0, 1, 2], 7), [0, 1, 2], 7)
    assert fake.calls == [([0, 1, 2], 7), ([0, 2], seed(1)), ([2], seed(2))]
    assert drawn.completions == [[0, seed(1), 0], [0, seed(1), 1], [1, 7, 0], [1, 7, 1], [2, 7, 0], [2, 7, 1]]
    assert drawn.scores.flatten().tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0] and fake.on.refills == [3, 1]
    off = Fake(0)
    assert grpo.refill(off, off.draw([0, 1, 2], 7), [0, 1, 2], 7).completions[0] == [0, 7, 0] and len(off.calls) == 1


def test_each_rank_draws_with_a_seed_of_its_own_and_rank_0_as_one_process():
    """Ranks sample different prompts of a step, but a group on one rank must not repeat another rank's draws: the
    step's seed takes the rank (rank 0's is one process's). That the job passes each rank's own is seen in a
    two-rank run's draws (test_episodes' test_episodes_train_on_two_ranks_each_drawing_episodes_of_its_own)."""
    import numpy as np

    assert grpo.step_seed(42, 0, 3, 0) == int(np.random.SeedSequence([42, 0, 3]).generate_state(1)[0])
    assert len({grpo.step_seed(42, 0, 3, rank) for rank in range(4)}) == 4
    assert grpo.step_seed(42, 1, 3, 0) != grpo.step_seed(42, 0, 3, 0) != grpo.step_seed(42, 0, 4, 0)
