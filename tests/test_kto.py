"""KTO from single judgements: rows from a file (TRL's unpaired format) and from the A/B store, the loss and
metrics against TRL's KTOTrainer (tests/golden/make_kto_golden.py), its micro batch, and the command line."""

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import run_losses
from test_preference import vote_store
from tunebench.core.errors import TunebenchError
from tunebench.data import judged
from tunebench.interfaces.cli import main
from tunebench.jobs import finetune
from tunebench.settings.finetune import DataConfig, load_config

GOLDEN = json.loads((Path(__file__).parent / "golden" / "kto.json").read_text())


def judged_file(tmp_path, rows=None) -> Path:
    path = tmp_path / "judged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows or GOLDEN["rows"]))
    return path


def test_an_ab_store_gives_the_chosen_answer_desirable_both_bad_answers_undesirable_and_skips_ties(tmp_path):
    examples = judged.from_store(str(vote_store(tmp_path)))
    got = [(p[0]["content"], c, label) for p, c, label in zip(examples.prompts, examples.completions, examples.labels)]
    assert got == [("p-a", "answer A 0", True), ("p-a", "answer B 0", False),
                   ("p-b", "answer A 1", False), ("p-b", "answer B 1", True),
                   ("p-both_bad", "answer A 3", False), ("p-both_bad", "answer B 3", False)]
    assert examples.skipped == {"ties": 1}
    assert "6 judged completion(s) (2 desirable, 4 undesirable)" in examples.describe()


def test_labels_take_trls_booleans_and_their_spellings_and_refuse_anything_else(tmp_path):
    rows = [{"prompt": "q", "completion": "a", "label": v} for v in (True, 0, "1", "false")]
    examples = judged.from_records(rows, DataConfig(), "f")
    assert examples.labels == [True, False, True, False]
    with pytest.raises(TunebenchError, match="row 2: label 'maybe' is not true or false"):
        judged.from_records([rows[0], {"prompt": "q", "completion": "a", "label": "maybe"}], DataConfig(), "f")
    with pytest.raises(TunebenchError, match="looks like preference pairs: use --method dpo"):
        judged.from_records([{"prompt": "q", "chosen": "a", "rejected": "b"}], DataConfig(), "f")


def test_a_micro_batch_is_its_rows_in_file_order_then_each_prompt_with_the_previous_rows_completion(tmp_path, tiny):
    cfg = DataConfig(path=str(judged_file(tmp_path)), template=GOLDEN["template"], max_length=256)
    data = judged.tokenize(judged.load(cfg), tiny.tokenizer, cfg)
    batch = judged.collate(data, [2, 0, 1], tiny.tokenizer.pad_token_id)
    assert batch["label"].tolist() == [True, False, True]
    rounded = judged.collate(data, [2, 0, 1], tiny.tokenizer.pad_token_id, multiple=16, cap=256)  # a CPU's bf16
    width = batch["input_ids"].shape[1]
    assert rounded["input_ids"].shape[1] == -(-width // 16) * 16 and torch.equal(rounded["input_ids"][:, :width],
                                                                                   batch["input_ids"])
    assert not rounded["attention_mask"][:, width:].any() and (rounded["labels"][:, width:] == -100).all()
    ids, t = batch["input_ids"], data.tokenized

    def part(k, loss):
        a, b = t.offsets[k], t.offsets[k + 1]
        return t.ids[a:b][t.mask[a:b] == loss].tolist()

    for row, k in enumerate([0, 1, 2]):
        n = len(part(k, 0)) + len(part(k, 1))
        assert ids[row, :n].tolist() == part(k, 0) + part(k, 1)
        other = [2, 0, 1][row]  # the previous row's completion, cyclically
        kl = part(k, 0) + part(other, 1)
        assert ids[3 + row, :len(kl)].tolist() == kl
        assert (batch["labels"][3 + row, len(part(k, 0)):len(kl)] != -100).all()
    assert batch["counts"].tolist() == [3]


def test_on_several_ranks_a_rows_mismatched_completion_is_drawn_from_the_global_micro_step(tmp_path, tiny):
    """Rank 1 of 2 holds rows 1 and 3 of the global micro-step [0, 1, 2, 3]: their KL rows take the completions of
    rows 0 and 2, as one process holding all four would, not of each other."""
    cfg = DataConfig(path=str(judged_file(tmp_path)), template=GOLDEN["template"], max_length=256)
    data = judged.tokenize(judged.load(cfg), tiny.tokenizer, cfg)
    pad = tiny.tokenizer.pad_token_id
    whole, mine = judged.collate(data, [0, 1, 2, 3], pad), judged.collate(data, [3, 1], pad, [2, 0, 3, 1])
    for row, k in enumerate([1, 3]):
        n = int(mine["attention_mask"][2 + row].sum())
        assert n == int(whole["attention_mask"][4 + k].sum())
        assert mine["input_ids"][2 + row, :n].tolist() == whole["input_ids"][4 + k, :n].tolist()
    assert mine["counts"].tolist() == [2]


def _golden_config(tmp_path, **extra):
    weights = GOLDEN["weights"]
    return load_config(options={
        "model.name": "tiny", "data.path": str(judged_file(tmp_path)), "data.template": GOLDEN["template"],
        "data.max_length": 256, "data.eval_fraction": 0.0, "adapter.method": "kto",
        "adapter.r": 8, "adapter.lora_alpha": 16, "adapter.lora_dropout": 0.0,
        "train.effective_batch_size": len(GOLDEN["rows"]), "train.max_steps": GOLDEN["steps"], "train.lr": GOLDEN["lr"],
        "train.schedule": "linear", "train.warmup_ratio": 0.0, "train.weight_decay": 0.0, "train.max_grad_norm": 1.0,
        "train.precision": "fp32", "train.beta": GOLDEN["beta"], "adapter.desirable_weight": weights[0],
        "adapter.undesirable_weight": weights[1], "train.seed": GOLDEN["seed"], "train.output_dir": str(tmp_path / "kto"),
        "train.progress": False, **extra})


def test_losses_and_metrics_match_trls_kto_trainer(tmp_path, capsys):
    """TRL steps over the ten rows as one batch in file order; tunebench's KTO micro batch is the effective batch
    (never measured), and its rows are collated in file order whatever the epoch's shuffle."""
    summary = finetune.run(_golden_config(tmp_path))
    assert re.search(r"micro_batch_size +10 +the effective batch: KTO estimates its KL", capsys.readouterr().out)
    assert summary["micro_batch_size"] == 10 and summary["objective"] == "kto"
    records = [json.loads(line) for line in (tmp_path / "kto" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    golden = GOLDEN["kto"]
    assert len(steps) == len(golden)
    for ours, theirs in zip(steps, golden):
        for name, value in theirs.items():
            assert ours[name] == pytest.approx(value, rel=1e-4, abs=1e-5), (ours["step"], name)
    assert golden[-1]["loss"] < golden[0]["loss"] - 0.1  # the reference really trained
    w = GOLDEN["weights"]  # the policy is its reference at the start: every loss is half its weight
    assert golden[0]["loss"] == pytest.approx((0.5 * w[0] + 0.5 * w[1]) / 2, abs=1e-6)


def test_a_smaller_micro_batch_is_taken_as_asked_and_said_to_change_the_kl_estimate(tmp_path, capsys):
    finetune.run(_golden_config(tmp_path, **{"train.micro_batch_size": 5, "train.max_steps": 2}))
    out = capsys.readouterr().out
    assert re.search(r"micro_batch_size +5 +asked for; KTO estimates its KL reference point", out)
    assert re.search(r"grad_accum_steps +2 +effective batch 10 = 5 x 2", out)


def test_kto_weights_belong_to_kto_and_must_be_positive():
    with pytest.raises(TunebenchError, match="--desirable-weight is KTO's, and this run's objective is dpo"):
        load_config(options={"adapter.method": "dpo", "adapter.desirable_weight": 2.0})
    with pytest.raises(TunebenchError, match="must be positive, got 1.0 and 0.0"):
        load_config(options={"adapter.method": "kto", "adapter.undesirable_weight": 0.0})
    cfg = load_config(options={"adapter.method": "kto"})
    o = cfg.objective
    assert (cfg.adapter.method, o.name, o.beta, o.desirable_weight, o.undesirable_weight) == ("lora", "kto", 0.1, 1.0,
                                                                                             1.0)


def test_kto_on_an_ab_store_from_the_command_line(tmp_path, capsys):
    store = vote_store(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--method", "kto", "--data", str(store), "--max-steps", "2",
                 "--effective-batch-size", "4", "--eval-fraction", "0", "--precision", "bf16", "--no-progress",
                 "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "data: 6 judged completion(s) (2 desirable, 4 undesirable) from" in printed and "skipped: 1 ties" in printed
    assert sorted(run_losses(out)) == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["examples_skipped"] == {"ties": 1} and summary["beta"] == 0.1
    assert (out / "adapter_model.safetensors").exists()
    assert main(["report", str(out)]) == 0
    assert "KTO: the mean implied reward" in (out / "report" / "report.md").read_text()


def test_a_thumbs_up_or_down_in_chat_is_a_judgement_kto_trains_on(tmp_path):
    from conftest import needs_module

    needs_module("gradio", "the web app is in the test extra: pip install -e '.[test]'")
    from tunebench.interfaces.web import chat_ab

    db = vote_store(tmp_path)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"},
               {"role": "user", "content": "and?"}, {"role": "assistant", "content": "no."}]
    assert "liked (desirable" in chat_ab.chat_feedback(db, "model-x", history, 1, True, 0.7, 0.9, 64)
    assert "disliked (undesirable" in chat_ab.chat_feedback(db, "model-x", history, 3, False, 0.7, 0.9, 64)
    with pytest.raises(TunebenchError, match="not an answer of the model"):
        chat_ab.chat_feedback(db, "model-x", history, 2, True, 0.7, 0.9, 64)
    examples = judged.from_store(str(db))
    got = list(zip(examples.prompts, examples.completions, examples.labels))
    assert got[-2:] == [(history[:1], "hello!", True), (history[:3], "no.", False)]
    assert len(got) == 8  # the six judgements of the votes before them
