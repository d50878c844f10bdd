"""Several datasets in one run: parsing, the mixture's weights, per-dataset splits and eval losses."""

import json

import numpy as np
import pytest
import yaml

from tunebench.core.errors import TunebenchError
from tunebench.data import batching, mixture
from tunebench.interfaces import cli
from tunebench.jobs import finetune
from tunebench.settings.finetune import load_config, parse_source


def test_the_mixture_follows_its_weights_within_every_stretch_of_steps():
    a, b = np.arange(0, 100), np.arange(100, 150)
    rows = mixture.mixture([a, b], [0.7, 0.3], seed=3)
    assert len(rows) == 150 and (rows < 100).sum() == 105  # 70% of the 150 rows both hold
    assert set(rows[rows >= 100]) <= set(b) and len(set(rows[rows >= 100])) == 45  # b: a seeded subset of 45
    steps = batching.epoch_steps(rows, 10, seed=3, epoch=0)
    shares = [np.mean(np.asarray(s) < 100) for s in steps]
    windows = [np.mean(shares[i:i + 5]) for i in range(0, len(shares) - 4, 5)]
    assert all(abs(w - 0.7) <= 0.15 for w in windows), windows
    again = mixture.mixture([a, b], [0.7, 0.3], seed=3)
    assert np.array_equal(rows, again) and not np.array_equal(rows, mixture.mixture([a, b], [0.7, 0.3], seed=4))
    assert mixture._shares(10, [0.5, 0.25, 0.25]) == [5, 3, 2] and sum(mixture._shares(7, [0.3, 0.3, 0.4])) == 7


def test_a_small_dataset_is_repeated_to_its_share():
    rows = mixture.mixture([np.arange(10), np.arange(10, 100)], [0.5, 0.5], seed=0)
    assert (rows < 10).sum() == 50 and np.bincount(rows[rows < 10]).min() == 5


@pytest.mark.parametrize("text,expected", [("a.csv:0.7", ("a.csv", 0.7)), ("a.csv", ("a.csv", None)),
                                           ("runs/x:y/data.csv", ("runs/x:y/data.csv", None)), ("a:1", ("a", 1.0))])
def test_a_weight_is_read_only_from_a_number_after_the_last_colon(text, expected):
    assert parse_source(text) == expected


def test_the_command_line_and_yaml_give_the_same_sources(tmp_path):
    args = cli.build_parser().parse_args(["train", "--data", "a.jsonl:0.7", "--data", "b.jsonl:0.3"])
    cfg = cli.train_config(args)
    assert cfg.data.sources == (("a.jsonl", 0.7), ("b.jsonl", 0.3))
    single = cli.train_config(cli.build_parser().parse_args(["train", "--data", "a.jsonl"]))
    assert single.data.path == "a.jsonl" and single.data.sources == ()
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"data": {"sources": [{"path": "a.jsonl", "weight": 0.7},
                                                                           {"path": "b.jsonl", "weight": 0.3}]}}))
    assert load_config(tmp_path / "c.yaml").data.sources == cfg.data.sources
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(cfg.to_dict()))  # what a child run is handed
    assert load_config(tmp_path / "d.yaml").data.sources == cfg.data.sources


@pytest.mark.parametrize("sources,message", [
    (["a.jsonl:0"], "a weight above 0"), (["a.jsonl:0.5", "a.jsonl:0.5"], "names a dataset twice"),
    ([{"path": "a.jsonl", "weight": "x"}], "must be a number"), ([{"file": "a.jsonl"}], "not a path with a weight"),
])
def test_bad_sources_are_refused_at_load(sources, message):
    with pytest.raises(TunebenchError, match=message):
        load_config(options={"data.sources": sources})
    with pytest.raises(TunebenchError, match="both name the data"):
        load_config(options={"data.sources": ["a.jsonl:1"], "data.path": "b.jsonl"})


def test_a_two_dataset_run_reports_eval_loss_and_scores_per_dataset(tmp_path):
    support, math_ = tmp_path / "support.jsonl", tmp_path / "gsm8k.jsonl"
    support.write_text("".join(json.dumps({"instruction": f"help {i}", "response": f"sure {i}"}) + "\n"
                               for i in range(24)))
    math_.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"}) + "\n"
                             for i in range(24)))
    out = tmp_path / "run"
    summary = finetune.run(load_config(options={
        "model.name": "tiny", "data.sources": [f"{support}:0.7", f"{math_}:0.3"], "data.eval_fraction": 0.25,
        "train.max_steps": 2, "train.micro_batch_size": 4, "train.output_dir": str(out), "train.progress": False,
        "train.eval_generate": 2, "train.eval_max_new_tokens": 4}))
    per = {k: summary[k] for k in ("eval_loss/support", "eval_loss/gsm8k")}
    assert all(v > 0 for v in per.values()) and min(per.values()) <= summary["eval_loss"] <= max(per.values())
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line][-1]
    assert last["eval_loss/gsm8k"] == summary["eval_loss/gsm8k"]
    assert summary["exact_match/gsm8k"] is not None and "exact_match/support" not in summary
    assert summary["exact_match"] is None  # not every reference is GSM8K-style
