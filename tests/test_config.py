import dataclasses
import re

import pytest

from tunebench.core.errors import TunebenchError
from tunebench.settings.finetune import load_config, replace


def test_defaults_are_the_study_recipe():
    cfg = load_config()
    assert (cfg.adapter.r, cfg.adapter.lora_alpha, cfg.adapter.lora_dropout) == (8, 16, 0.1)
    assert cfg.data.max_length is None  # auto: the rows' 99th percentile (the study's matrices ask for 128)
    assert load_config(options={"data.max_length": "auto"}).data.max_length is None
    assert load_config(options={"data.max_length": "256"}).data.max_length == 256
    assert cfg.effective_batch_size == 8 and cfg.batch.micro_batch_size is None  # None: the micro batch is measured


def test_precedence_yaml_then_options_then_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  lr: 1e-3\n  seed: 7\ndata:\n  max_length: 64\n")
    cfg = load_config(y, {"train.seed": "9"}, ["data.max_length=32"])
    assert cfg.optimizer.lr == 1e-3  # YAML's '1e-3' string coerced to float
    assert cfg.schedule.seed == 9
    assert cfg.data.max_length == 32


@pytest.mark.parametrize("key, hint", [("optimizer.learning_rat", "optimizer.lr"), ("train.bach_size", "batch."),
                                       ("lora.r", "adapter.r")])
def test_unknown_key_names_nearest(key, hint):
    with pytest.raises(TunebenchError, match=f"unknown config key '{key}'.*did you mean '{hint}"):
        load_config(overrides=[f"{key}=1"])


def test_unknown_yaml_section(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("trian:\n  lr: 1\n")
    with pytest.raises(TunebenchError, match="unknown config key 'trian.lr'; did you mean 'optimizer.lr'"):
        load_config(y)


def test_bad_types_and_values():
    with pytest.raises(TunebenchError, match="not a whole number"):
        load_config(options={"train.micro_batch_size": "four"})
    with pytest.raises(TunebenchError, match="micro_batch_size.*positive"):
        load_config(options={"train.micro_batch_size": "0"})
    with pytest.raises(TunebenchError, match="is not one of"):
        load_config(options={"adapter.method": "adalora"})


def test_batch_settings_that_cannot_agree_are_refused():
    # (that a run keeps the effective batch is checked on what it trains on: test_robustness's samples test)
    with pytest.raises(TunebenchError, match="not a multiple"):
        load_config(options={"train.micro_batch_size": 3})
    with pytest.raises(TunebenchError, match="set only two"):
        load_config(options={"train.micro_batch_size": 2, "train.grad_accum_steps": 2, "train.effective_batch_size": 16})


def test_three_batch_flags_run_as_given_when_they_agree_at_the_world_size_and_are_refused_when_not(monkeypatch):
    """Whether --effective-batch-size was given is what the config holds, never inferred from its value: 8 is
    the default and still a request. And the three are checked at the world the run trains in."""
    from tunebench.settings import pretrain as pretrain_config
    with pytest.raises(TunebenchError, match=r"--batch-size 2 x --grad-accum 2 != --effective-batch-size 8"):
        load_config(options={"train.micro_batch_size": 2, "train.grad_accum_steps": 2, "train.effective_batch_size": 8})
    assert load_config(options={"train.micro_batch_size": 2, "train.grad_accum_steps": 2}).effective_batch_size == 4
    assert load_config().effective_batch_size == 8 and load_config().batch.effective_batch_size is None
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank under `tunebench launch --nproc-per-node 2`
    cfg = load_config(options={"train.micro_batch_size": 1, "train.grad_accum_steps": 1, "train.effective_batch_size": 2})
    assert cfg.batch_ask().check(2) == 2  # 1 x 1 x 2 ranks
    with pytest.raises(TunebenchError, match=r"x 2 ranks != --effective-batch-size 4"):
        load_config(options={"train.micro_batch_size": 1, "train.grad_accum_steps": 1, "train.effective_batch_size": 4})
    grpo = {"train.objective": "grpo", "objective.reward": ["gsm8k"], "adapter.method": "full"}
    with pytest.raises(TunebenchError, match="FSDP shards it; use --parallel ddp"):  # at load, before any output
        load_config(options={**grpo, "distributed.parallel": "fsdp"})
    assert load_config(options=grpo).objective.name == "grpo"  # every objective runs on ranks, GRPO with DDP
    monkeypatch.delenv("WORLD_SIZE")
    keys = {"data.train_file": "x.txt", "training.batch_size": 2, "training.gradient_accumulation_steps": 2}
    with pytest.raises(TunebenchError, match="set only two"):  # pretraining's keys, by the same rule
        pretrain_config.load(options={**keys, "training.effective_batch_size": 8})
    assert pretrain_config.load(options={**keys, "training.effective_batch_size": 4}).effective_batch_size == 4
    assert pretrain_config.load(options=keys).effective_batch_size == 4


def test_quantization_implies_qlora_and_full_refuses_it():
    assert load_config(options={"adapter.quantization": "4bit"}).adapter.method == "qlora"
    with pytest.raises(TunebenchError, match="frozen base"):
        load_config(options={"adapter.quantization": "4bit", "adapter.method": "full"})


def test_replace_validates():
    cfg = load_config()
    assert replace(cfg, **{"train.lr": 1e-3}).optimizer.lr == 1e-3
    with pytest.raises(TunebenchError, match="lr"):
        replace(cfg, **{"train.lr": -1})


def test_both_jobs_share_one_definition_of_each_common_section():
    """The eight shared sections are one set of dataclasses; only model and data (and train's adapter and
    objective) differ."""
    from tunebench.settings import pretrain as pretrain_config
    from tunebench.settings import schema
    train, pre = load_config(), pretrain_config.load(None, {"data.train_file": "x.txt"})
    for section, cls in schema.SHARED.items():
        assert type(getattr(train, section)) is cls and type(getattr(pre, section)) is cls, section
    names = [{f.name for f in dataclasses.fields(type(cfg))} for cfg in (train, pre)]
    assert names[0] - names[1] == {"adapter", "objective"} and names[1] - names[0] == set()
    assert type(train.model) is not type(pre.model) and type(train.data) is not type(pre.data)


def test_a_fields_documentation_is_its_help():
    from tunebench.interfaces.cli_parser import build_parser
    from tunebench.settings import schema

    helps = {a.dest: a.help for p in build_parser()._subparsers._group_actions[0].choices.values() for a in p._actions}
    assert helps["schedule.warmup_steps"] == schema.help_for("schedule.warmup_steps") == "steps of linear warm-up"
    for key in ("hardware.precision", "batch.grad_accum_steps", "output.resume", "distributed.world_size"):
        assert schema.help_for(key), f"{key} has no documentation"


@pytest.mark.parametrize("options, expected", [
    ({"train.lr": 1e-3}, ("optimizer", "lr", 1e-3)),  # tunebench's flat section before the shared ones
    ({"training.learning_rate": 1e-3}, ("optimizer", "lr", 1e-3)),  # the CPU guide's
    ({"training.num_epochs": 2}, ("schedule", "epochs", 2.0)),
    ({"training.checkpoint_dir": "out"}, ("output", "output_dir", "out")),
    ({"training.use_amp": False}, ("hardware", "precision", "fp32")),
    ({"training.bf16": True}, ("hardware", "precision", "bf16")),
    ({"optimization.compile": True}, ("hardware", "compile", "on")),  # the hardware guide's Hydra key
    ({"model.use_gradient_checkpointing": True}, ("hardware", "gradient_checkpointing", "on")),
    ({"training.distributed_backend": "gloo"}, ("distributed", "backend", "gloo")),
])
def test_other_documents_spellings_are_translated_at_load(options, expected):
    section, name, value = expected
    assert getattr(getattr(load_config(options=options), section), name) == value


def test_two_spellings_of_one_key_in_one_place_must_agree_and_a_later_layer_wins(tmp_path):
    with pytest.raises(TunebenchError, match="'training.use_amp' and 'hardware.precision' both set hardware.precision"):
        load_config(options={"training.use_amp": True, "hardware.precision": "fp32"})
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  lr: 0.001\n")
    assert load_config(y, {"optimizer.lr": 0.002}).optimizer.lr == 0.002  # the command line over the file


def test_deeply_nested_yaml_and_json_get_one_line_not_a_recursion_error(tmp_path):
    from tunebench.data.readers import read_records

    y = tmp_path / "deep.yaml"
    y.write_text("train: " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(TunebenchError, match="nests lists or mappings too deep"):
        load_config(y)
    for name, text in (("deep.json", "[" * 200000 + "]" * 200000), ("deep.jsonl", '{"a": ' + "[" * 200000 + "]" * 200000 + "}\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(TunebenchError, match="too deep to read"):
            read_records(str(tmp_path / name))


@pytest.mark.parametrize("template, message", [
    ("### Q:\n{instruction:>999999999}\n### A:\n", "has the field {instruction:>999999999}"),  # a GB a prompt
    ("{instruction!r}", "has the field {instruction!r}"),
    ("{question}", "has the field {question}"),
    ("{instruction", "is not a prompt format"),
])
def test_a_prompt_format_holds_instruction_alone(template, message):
    with pytest.raises(TunebenchError, match=re.escape(message)):
        load_config(options={"data.template": template})
    assert load_config(options={"data.template": "{{json}} {instruction}"}).data.template == "{{json}} {instruction}"


def test_auto_is_none_and_an_earlier_runs_config_still_loads(tmp_path):
    """The micro batch's auto is None (no second field beside a phantom size); config.yaml of earlier runs holds
    batch.autotune_batch beside the size it was written with, and true there still means auto."""
    assert load_config(options={"train.micro_batch_size": "auto"}).batch.micro_batch_size is None
    assert load_config(options={"train.micro_batch_size": 2}).batch.micro_batch_size == 2
    old = tmp_path / "config.yaml"
    old.write_text("batch:\n  micro_batch_size: 4\n  autotune_batch: true\n  effective_batch_size: 8\n")
    assert load_config(str(old)).batch.micro_batch_size is None
    old.write_text("batch:\n  micro_batch_size: 2\n  autotune_batch: false\n  effective_batch_size: 8\n")
    cfg = load_config(str(old))
    assert cfg.batch.micro_batch_size == 2 and cfg.batch_ask().micro == 2
    from tunebench.settings.yamlfiles import write_config

    write_config(cfg, tmp_path / "again.yaml")  # read, never written
    assert "autotune_batch" not in (tmp_path / "again.yaml").read_text()
    assert load_config(str(tmp_path / "again.yaml")).batch.micro_batch_size == 2


def test_the_objective_keys_are_read_as_every_earlier_config_spelled_them(tmp_path):
    """The objective has its own section; adapter.objective and adapter.beta (dotted, nested in YAML, a run's old
    config.yaml), train.objective and a top-level `objective: dpo` still set it, and a run's resume identity keeps
    the shape its checkpoints saved before the split (the adapter's keys and the objective's, in one mapping)."""
    from tunebench.jobs.parts.finetune_model import identity
    from tunebench.settings.finetune import ObjectiveKeys

    dotted = load_config(options={"adapter.objective": "dpo", "adapter.beta": 0.3})
    (tmp_path / "old.yaml").write_text("adapter:\n  method: lora\n  objective: kto\n  beta: 0.2\n"
                                       "  desirable_weight: 2.0\n")
    (tmp_path / "top.yaml").write_text("objective: orpo\n")
    (tmp_path / "new.yaml").write_text("objective:\n  name: dpo\n  beta: 0.3\n")
    old, top, new = (load_config(tmp_path / f"{n}.yaml") for n in ("old", "top", "new"))
    assert (dotted.objective.name, dotted.objective.beta) == ("dpo", 0.3) and dotted.objective == new.objective
    assert (old.objective.name, old.objective.beta, old.objective.desirable_weight) == ("kto", 0.2, 2.0)
    assert top.objective.name == "orpo" and load_config(options={"train.objective": "grpo",
                                                                 "train.reward": "gsm8k"}).objective.name == "grpo"
    saved = identity(dotted)["adapter"]
    assert saved["objective"] == "dpo" and saved["beta"] == 0.3 and saved["r"] == 8 and "name" not in saved
    assert set(saved) == {f.name for f in dataclasses.fields(type(dotted.adapter))} | {
        "objective" if f.name == "name" else f.name for f in dataclasses.fields(ObjectiveKeys)} - {
        "environment", "max_turns", "tool_timeout", "kind_column", "min_reward", "turn_credit", "resample_alike", "balance_kinds",
        "weigh_kinds", "num_iterations", "negative_weight"}  # unset, or as runs
    # before them trained: left out, as checkpoints before them hold none
    assert set(dataclasses.asdict(dotted.adapter)).isdisjoint(dataclasses.asdict(dotted.objective))
