"""Rejection-sampling fine-tuning (training/grpo/rft.py): what is kept and how much each kept completion weighs,
computed by hand; its loss against the next-token loss of the kept completions; one run from the command line,
stopped and resumed exactly."""

import json
import math
import os
import re
import sys

import numpy as np
import pytest
import torch

from conftest import assert_resumed, run_losses, sigterm_after_step
from tunebench.core import startup
from tunebench.core.errors import TunebenchError
from tunebench.data.prompts import PromptData
from tunebench.interfaces.cli import main
from tunebench.settings import objectives
from tunebench.settings.finetune import load_config
from tunebench.training import grpo
from tunebench.training.grpo import rewards, rft
from tunebench.training.objective import prepare


def _drawn(rewards_, completions):
    return grpo.Drawn(completions, torch.tensor(rewards_).reshape(-1, 1), torch.ones(len(completions)),
                      torch.zeros(len(completions)))


def test_kept_completions_pass_the_min_reward_once_each_and_each_kind_carries_an_equal_share():
    completions = [[1], [2], [2], [3], [4], [5]]
    scores = [1.0, 1.0, 1.0, 0.0, 0.5, math.nan]  # two prompts of 3; the third of the first repeats the second
    kept = rft.Kept(objectives.RFT(num_generations=3, reward=("gsm8k",)))
    weight, total, zero = kept.of(_drawn(scores, completions), torch.ones(1), [])
    assert weight.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]  # above 0, once each; no reward: not kept
    assert torch.isnan(total[5]) and zero.tolist() == [True] * 3 + [False] * 3
    at_least = rft.Kept(objectives.RFT(num_generations=3, reward=("gsm8k",), min_reward=1.0))
    assert at_least.of(_drawn(scores, completions), torch.ones(1), [])[0].tolist() == [1, 1, 0, 0, 0, 0]
    # kinds: the first prompt's kind 0 keeps 2, the second's kind 1 keeps 1: 3 kept, 2 kinds -> 3/4 and 3/2 each
    weight = kept.of(_drawn(scores, completions), torch.ones(1), [0, 0, 0, 1, 1, 1])[0]
    assert weight.tolist() == pytest.approx([0.75, 0.75, 0.0, 0.0, 1.5, 0.0]) and float(weight.sum()) == 3.0
    masks = kept.masks(_drawn(scores, completions), weight)
    assert masks == [[1], [1], [0], [0], [1], [0]]  # the step's mean is over the kept tokens


def test_the_rft_loss_is_the_next_token_loss_of_the_kept_completions(tiny):
    model, tok = tiny.model, tiny.tokenizer
    data = PromptData([[5, 6, 7], [8, 9]], np.arange(2), 0)
    completions = [[20, 21, 2], [22, 2], [23, 24, 25, 2], [26, 2]]
    s = objectives.RFT(num_generations=2, reward=("gsm8k",))
    credit = rft.Kept(s)
    drawn = _drawn([1.0, 0.0, 1.0, 1.0], completions)
    weight, total, _ = credit.of(drawn, torch.ones(1), [])
    groups = grpo.Groups([0, 1], completions, weight, torch.zeros(4, 3), credit.masks(drawn, weight))
    batch, n_loss, _ = prepare(grpo.rows_of(groups, [0, 1], data, 2, tok.pad_token_id, credit.skip),
                               torch.device("cpu"))
    assert batch["input_ids"].shape[0] == 3 and n_loss == 4  # the unkept row left out; four completions counted
    loss_fn = rft.RFTLoss(model, s, [rewards.Reward("r", 1.0, lambda p, c, cols: [])])
    loss, stats = loss_fn(batch)
    with torch.no_grad():  # by hand: each kept completion's tokens' -log p, over the kept tokens (3 + 4 + 2)
        nll = []
        for prompt, reply in (([5, 6, 7], [20, 21, 2]), ([8, 9], [23, 24, 25, 2]), ([8, 9], [26, 2])):
            ids = torch.tensor([prompt + reply])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            nll += [-float(logp[len(prompt) - 1 + t, reply[t]]) for t in range(len(reply))]
    assert float(loss.detach()) / n_loss == pytest.approx(sum(nll) / 9, rel=1e-5)  # the loop divides by completions
    assert float(stats[-1]) == 1.0  # one completion left out
    assert loss_fn.stat_finish({"kl": 0.0, "reward": 0.75, "frac_groups_skipped": 0.25}, 4) == {
        "reward": 0.75, "frac_kept": 0.75}


def test_rft_settings_are_its_own_and_checked_at_load():
    own = objectives.own_keys(objectives.RFT)
    assert "min_reward" in own and "beta" not in own and "num_generations" in own
    with pytest.raises(TunebenchError, match="--beta is DPO's and KTO's and GRPO's, and this run's objective is rft"):
        load_config(options={"train.objective": "rft", "objective.reward": "gsm8k", "objective.beta": 0.1})
    with pytest.raises(TunebenchError, match="--objective rft needs at least one --reward"):
        load_config(options={"train.objective": "rft"})
    with pytest.raises(TunebenchError, match="--min-reward is RFT's"):
        load_config(options={"train.objective": "grpo", "objective.reward": "gsm8k", "objective.min_reward": 1})


def _prompts(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}",
                                        "kind": "small" if a + b <= 4 else "large"}) + "\n"
                            for a in range(1, 5) for b in range(1, 4)))
    return path


def _rft(tmp_path, out, *extra):
    return ["train", "--model", "tiny", "--objective", "rft", "--reward", "format:\\d", "--data",
            str(_prompts(tmp_path)), "--num-generations", "4", "--max-completion-length", "8",
            "--effective-batch-size", "2", "--max-steps", "4", "--precision", "fp32", "--kind-column", "kind",
            "--balance-kinds", "on", "--eval-fraction", "0.25", "--no-progress", "--output-dir", str(out), *extra]


def test_rft_from_the_command_line_trains_on_what_it_kept_and_resumes_exactly(tmp_path, capsys, monkeypatch):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    trims = []  # who handed the heap's free pages back: each step's draw does, before and after (grpo/steps.py)
    monkeypatch.setattr(startup, "release_freed", lambda: trims.append(sys._getframe(1).f_code.co_filename))
    assert main(_rft(tmp_path, whole)) == 0
    monkeypatch.undo()
    assert sum(f.endswith(os.path.join("grpo", "steps.py")) for f in trims) == 2 * 4  # 4 steps, a draw each
    printed = capsys.readouterr().out
    assert re.search(r"objective +rft +4 completions a prompt of up to 8 tokens sampled each step at temperature 1 "
                     r".*those whose reward is above 0 kept .*each kind of kind an equal share; each step's prompts one of each "
                     r"kind of kind in turn", printed)
    first = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines() if '"loss"' in line][0]
    assert first["kinds/small/count"] == first["kinds/large/count"] == 0.5  # one prompt of each kind a step
    steps = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 4 and all("kl" not in r and 0 <= r["frac_kept"] <= 1 for r in steps)
    assert any(r["frac_kept"] > 0 for r in steps) and {"kinds/small/reward", "entropy"} <= set(steps[0])
    # judged the way it was trained: its held-out prompts answered greedily, scored by its rewards, per kind
    assert main(["eval", "--adapter", str(whole), "--base", "--output-dir", str(tmp_path / "judged")]) == 0
    scores = json.loads((tmp_path / "judged" / "scores.json").read_text())
    assert scores["rows"] == f"the held-out prompts of {whole}" and set(scores) == {"rows", "base", "whole"}
    for label in ("base", "whole"):
        got = scores[label]
        assert got["prompts"] == 3 and 0 <= got["reward"] <= 1 and "rewards/format/mean" in got
        assert len({row for row, _ in got["by_row"]}) == 3  # each row's reward, for a paired comparison
        assert sum(r for _, r in got["by_row"]) / 3 == pytest.approx(got["reward"])
        assert sum(got.get(f"kinds/{k}/prompts", 0) for k in ("small", "large")) == 3
    with pytest.raises(TunebenchError, match="learned from rewards .rft.: eval answers its held-out prompts"):
        main(["eval", "--adapter", str(whole), "--generate", "2", "--debug"])
    with sigterm_after_step(2):
        assert main(_rft(tmp_path, stopped)) == 130
    assert main(_rft(tmp_path, stopped, "--resume", "auto")) == 0
    assert_resumed(stopped, 2)
    assert run_losses(stopped) == pytest.approx(run_losses(whole), rel=1e-5)
