"""A run directory read back as what it is (rundir.RunDir): its kind, base model, prompt format and config."""

import json

import pytest

from conftest import ROWS, tiny_run_config
from tunebench.core.errors import TunebenchError
from tunebench.data import formats
from tunebench.data.tokenize import load_tokenized
from tunebench.jobs import evaluate, finetune, merge
from tunebench.model import inference
from tunebench.settings.finetune import BUILTIN_DATA, DataConfig
from tunebench.settings.rundir import RunDir


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory):
    """A LoRA run on two datasets (a mixture), and the files."""
    root = tmp_path_factory.mktemp("mix")
    a, b = root / "a.jsonl", root / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    b.write_text("".join(json.dumps({"instruction": r["response"], "response": r["instruction"]}) + "\n" for r in ROWS))
    out = root / "run"
    finetune.run(tiny_run_config(a, out, **{"data.sources": [f"{a}:0.5", f"{b}:0.5"], "data.path": BUILTIN_DATA,
                                            "train.max_steps": 2, "data.template": "Q: {instruction}\nA: "}))
    return out, a, b


def test_a_runs_kind_base_and_prompt_format_come_from_its_files(mixture_run, tmp_path):
    out, _, _ = mixture_run
    run = RunDir(out)
    assert run.kind() == "adapter" and run.peft_type() == "LORA"
    assert run.base_model() == "tiny" and run.template() == "Q: {instruction}\nA: "
    assert run.train_config().data.sources and run.summary_file.is_file() and run.checkpoints.is_dir()
    merged = merge.merge(str(out), str(tmp_path / "merged"))
    assert RunDir(merged).kind() == "model" and RunDir(merged).template() is None
    assert RunDir(tmp_path).kind() == "none"


def test_eval_answers_a_mixture_runs_own_held_out_rows_of_each_dataset(mixture_run):
    """held_out read the run's data.path only, so a mixture's held-out rows looked like data never trained on."""
    out, a, b = mixture_run
    cfg = RunDir(out).train_config()
    for path in (a, b):
        data = DataConfig(path=str(path), max_length=256)
        examples = formats.load_examples(data)
        tokenized = load_tokenized(data, inference.load_for_inference(None, str(out)).tokenizer, None, examples)
        rows, where = evaluate.held_out(examples, tokenized, data, str(out))
        assert where == f"the held-out rows of {out}"
        assert 0 < len(rows) < len(ROWS) and len(rows) == round(len(ROWS) * cfg.data.eval_fraction)


def test_a_run_config_is_read_by_the_safe_loader(tmp_path):
    """base_of read config.yaml with yaml.safe_load, which expands nested aliases (a few lines, gigabytes)."""
    (tmp_path / "config.yaml").write_text("a: &a [x, x]\nb: &b [*a, *a]\nmodel: {name: *b}\n")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny"}))
    with pytest.raises(TunebenchError, match="config.yaml"):
        inference.trained_on(str(tmp_path))


def test_a_runs_summary_reads_back_typed_and_writes_the_same_json(mixture_run, tmp_path):
    """summary.json read through RunDir is a Summary: the figures every run has as fields, the keyed families
    (each dataset's eval loss here) as extras under their own names, and the same JSON when written back."""
    from tunebench.settings.rundir import Summary

    out, _, _ = mixture_run
    raw = json.loads((out / "summary.json").read_text())
    summary = RunDir(out).summary()
    assert isinstance(summary, Summary) and summary.to_dict() == raw
    assert summary.steps == 2 and summary.method == "lora" and summary.device == "cpu"
    assert summary.micro_batch_size * summary.grad_accum_steps == summary.effective_batch_size
    assert {k for k in summary.extra if k.startswith("eval_loss/")} == {k for k in raw if k.startswith("eval_loss/")}
    assert summary.get("eval_loss") == raw["eval_loss"] and summary.get("perplexity") == raw["perplexity"]
    assert RunDir(tmp_path).summary() is None  # not finished
