"""Each objective is a slice with typed settings (settings/objectives.py): what runs made before the slices saved
(their identity, their config.yaml, their checkpoints) still reads and resumes.

tests/fixtures/before_slices was written by commit 1fbf9e0, before the objective's settings became typed: three
tiny runs stopped at step 2 (DPO, KTO, GRPO: their checkpoints and config.yaml) and the identity a resume
compares, for eight configurations.
"""

import json
import shutil
from pathlib import Path

import pytest

from tunebench.interfaces.cli import main
from tunebench.jobs.parts import finetune_model
from tunebench.settings.finetune import load_config

BEFORE = Path(__file__).parent / "fixtures" / "before_slices"
IDENTITIES = json.loads((BEFORE / "identities.json").read_text())
COMMON = ["--model", "tiny", "--effective-batch-size", "2", "--batch-size", "2", "--precision", "fp32",
          "--attention", "eager", "--compile", "off", "--no-progress"]
RUNS = {"dpo": ["--method", "dpo", "--data", "pairs.jsonl"],
        "kto": ["--method", "kto", "--data", "judged.jsonl"],
        "grpo": ["--method", "grpo", "--reward", "gsm8k", "--reward", "format:\\d", "--reward-weights", "1", "0.5",
                 "--num-generations", "2", "--max-completion-length", "8", "--data", "q.jsonl"]}


@pytest.mark.parametrize("name", sorted(IDENTITIES))
def test_a_runs_identity_and_config_are_what_they_were_before_the_slices(name):
    case = IDENTITIES[name]
    cfg = load_config(options=case["options"])
    # the config.yaml such a run wrote (every objective key, None where not its own) loads to the same settings
    old = load_config(options={f"{s}.{k}": v for s, keys in case["config"].items() for k, v in keys.items()
                               if not (s == "data" and k == "sources")})
    assert old == cfg
    if name == "grpo-env":  # since 2026-12-05 an environment's runs weigh failures 0.5 unless told: a new identity,
        # and the same one as before where the run is told 1 (so such a checkpoint resumes with --negative-weight 1)
        moved = {**case["identity"], "adapter": {**case["identity"]["adapter"], "negative_weight": 0.5}}
        assert finetune_model.identity(cfg) == moved
        cfg = load_config(options={**case["options"], "objective.negative_weight": 1})
    assert finetune_model.identity(cfg) == case["identity"]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_checkpoint_saved_before_the_slices_resumes_where_it_stopped(tmp_path, monkeypatch, capsys, name):
    """The run goes on from step 2 (only step 3 is trained: a rerun would log steps 1 to 3)."""
    shutil.copytree(BEFORE, tmp_path / "runs")
    monkeypatch.chdir(tmp_path / "runs")  # the identity holds the data path as it was given
    assert load_config(f"{name}/config.yaml").objective.name == name
    assert main(["train", *COMMON, *RUNS[name], "--max-steps", "3", "--resume", "auto", "--output-dir", name]) == 0
    assert f"resume: continuing from {name}/checkpoints/step-00000002 (step 2)" in capsys.readouterr().out
    steps = [json.loads(line) for line in Path(name, "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [3]


def test_each_objective_holds_only_its_own_settings_with_their_defaults():
    """The tagged union: one type per objective (SFT holds nothing, GRPO its 19 keys), built from the flat section
    users spell; another objective's key is refused in one line, and GRPO's episode keys default where there is an
    environment only."""
    import dataclasses

    from tunebench.core.errors import TunebenchError
    from tunebench.settings import objectives

    own = {name: objectives.own_keys(kind) for name, kind in objectives.BY_NAME.items()}
    assert own["sft"] == () and own["dpo"] == ("beta",) and own["orpo"] == ("orpo_lambda",)
    assert own["kto"] == ("beta", "desirable_weight", "undesirable_weight") and len(own["grpo"]) == 21
    assert set(own["rft"]) == set(own["grpo"]) - {"beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards",
                                                  "turn_credit", "resample_alike", "weigh_kinds",
                                                  "num_iterations", "negative_weight"} | {
        "min_reward"}
    dpo = load_config(options={"train.objective": "dpo"}).objective
    assert type(dpo) is objectives.DPO and dpo.beta == 0.1 and not hasattr(dpo, "num_generations")
    assert dataclasses.asdict(dpo) == {"name": "dpo", "beta": 0.1}  # what config.yaml saves of it
    grpo = load_config(options={"train.objective": "grpo", "objective.reward": "gsm8k", "objective.epsilon": 0.3})
    assert (grpo.objective.epsilon_high, grpo.objective.max_turns, grpo.objective.samples) == (0.3, None, True)
    env = load_config(options={"train.objective": "grpo", "objective.environment": "builtin:lookup"}).objective
    assert (env.max_turns, env.tool_timeout) == (4, 10.0)
    with pytest.raises(TunebenchError, match="--num-generations is GRPO's and RFT's, and this run's objective is kto"):
        load_config(options={"train.objective": "kto", "objective.num_generations": 4})
    with pytest.raises(TunebenchError, match="objective.name 'ppo' is not one of sft, dpo, orpo, kto, grpo"):
        load_config(options={"train.objective": "ppo"})
