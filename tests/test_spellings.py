"""The documents' own spellings: what the study's scripts, the CPU training guide and the performance
guides tell a user to type works as written."""

import csv
from pathlib import Path

import pytest

from tunebench.interfaces import cli
from tunebench.jobs import compare, hw
from tunebench.settings import finetune as config
from tunebench.settings import pretrain as pretrain_config

STUDY = Path(compare.__file__).resolve().parents[1] / "examples" / "study_results.csv"


def test_report_takes_the_studys_results_csv_and_output_dir(tmp_path, capsys):
    # generate_comparison_report.py --results_csv cpu_gpu_comparison/timing_results.csv --output_dir ...
    assert cli.main(["report", "--results_csv", str(STUDY), "--output_dir", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "report.html").is_file()
    # the study's own rows, read here: its 8-core CPU finding, the speedup computed from the CSV, not the report
    with STUDY.open() as f:
        cpu8 = {r["experiment"]: float(r["duration_seconds"]) for r in csv.DictReader(f) if r["device_name"] == "CPU 8-core"}
    slow, fast = cpu8["cpu_bs1_ga8_8core"], cpu8["cpu_bs4_ga2_8core"]
    assert (f"On CPU 8-core, bs4_ga2 is fastest ({fast:,.0f} s), {slow / fast:.2f}x faster than bs1_ga8 ({slow:,.0f} s)"
            in (tmp_path / "rep" / "report.md").read_text())
    assert cli.main(["report"]) == 2 and "give CSVs (or --results_csv FILE)" in capsys.readouterr().err


def test_pretrain_takes_the_guides_config_and_output_dir(monkeypatch, tmp_path, capsys):
    # python scripts/train.py --config configs/cpu_small_model.yaml --output_dir ./output/cpu_small
    seen = {}
    monkeypatch.setattr("tunebench.jobs.pretrain.run", lambda cfg: seen.setdefault("cfg", cfg))
    (tmp_path / "corpus.txt").write_text("some text to learn from\n" * 50)
    assert cli.main(["pretrain", "--config", "configs/cpu_small_model.yaml", "--output_dir",
                     str(tmp_path / "cpu_small"), "--data", str(tmp_path / "corpus.txt")]) == 0
    cfg = seen["cfg"]
    assert cfg.output.output_dir == str(tmp_path / "cpu_small")
    assert cfg == pretrain_config.load("cpu_small_model", {"training.checkpoint_dir": str(tmp_path / "cpu_small"),
                                                           "data.train_file": str(tmp_path / "corpus.txt")})
    assert "using tunebench's shipped cpu_small_model" in capsys.readouterr().out
    assert cli.main(["pretrain", "cpu_small_model", "--config", "cpu_medium_model"]) == 2


def test_train_takes_max_samples_with_an_underscore():
    args = cli.build_parser().parse_args(["train", "--max_samples", "1000", "--output_dir", "x"])
    cfg = cli.train_config(args)
    assert cfg.data.max_samples == 1000 and cfg.output.output_dir == "x"


@pytest.mark.parametrize("guide,ours", [("gpu_4090", "gpu-24gb"), ("gpu_3090", "gpu-24gb"),
                                        ("gpu_low_mem", "gpu-8-12gb"), ("cpu", "cpu")])
def test_the_guides_hardware_profiles_and_its_hydra_override(guide, ours):
    by_flag = cli.train_config(cli.build_parser().parse_args(["train", "--profile", guide]))
    by_hydra = cli.train_config(cli.build_parser().parse_args(["train", f"hardware={guide}"]))
    assert by_flag == by_hydra == config.load_config(profile=ours)
    with pytest.raises(Exception, match="give the hardware profile once"):
        cli.train_config(cli.build_parser().parse_args(["train", "--profile", "cpu", f"hardware={guide}"]))


def test_the_hardware_guides_keys_are_translated_at_load():
    """`training.batch_size=... optimization.compile=true model.use_gradient_checkpointing=true`, the guide's
    Hydra overrides, reach both jobs as their own keys (aliases at load, not fields of the schema)."""
    guide = ["training.batch_size=4", "optimization.compile=true", "model.use_gradient_checkpointing=true",
             "optimization.gradient_accumulation_steps=2"]
    cfg = config.load_config(overrides=guide)
    assert (cfg.batch.micro_batch_size, cfg.hardware.compile, cfg.hardware.gradient_checkpointing,
            cfg.batch.grad_accum_steps, cfg.effective_batch_size) == (4, "on", "on", 2, 8)
    pre = pretrain_config.load(None, {"data.train_file": "x.txt"}, guide)
    assert (pre.batch.micro_batch_size, pre.hardware.compile, pre.hardware.gradient_checkpointing,
            pre.batch.grad_accum_steps) == (4, "on", "on", 2)


def test_the_cpu_guides_world_size_is_the_number_of_processes_it_is_started_with(monkeypatch, tmp_path):
    """TrainingConfig(world_size=4, distributed_backend="gloo") was refused as an unknown argument. A config
    cannot start processes: the run is checked against the number it was started with."""
    from tunebench.interfaces.api import DataConfig, PretrainConfig, TrainingConfig

    cfg = PretrainConfig(training=TrainingConfig(device="cpu", distributed_backend="gloo", world_size=4, batch_size=1,
                                                 gradient_accumulation_steps=4),
                         data=DataConfig(train_file=str(tmp_path / "x.txt")))
    with pytest.raises(config.TunebenchError, match=r"world_size is 4, and this run was started as 1 .*"
                                                     r"tunebench launch --nproc-per-node 4 -- pretrain"):
        pretrain_config.validate(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")  # one of the 4 ranks torchrun started
    pretrain_config.validate(cfg)


def test_hw_recommends_a_command_and_writes_system_info(tmp_path, capsys):
    assert cli.main(["hw"]) == 0
    said = capsys.readouterr().out
    profile, _ = hw.profile_for(__import__("tunebench.machine.hardware", fromlist=["detect"]).detect())
    assert f"tunebench train --profile {profile} --precision " in said and "--batch-size auto" in said
    assert cli.main(["hw", "--text", str(tmp_path / "system_info.txt")]) == 0
    text = (tmp_path / "system_info.txt").read_text()
    for key in ("date: ", "cpu: ", "ram: ", "cuda: ", "torch: ", "transformers: ", "recommended precision: "):
        assert key in text, key


def _matrix(tmp_path, dataset):
    m = tmp_path / "m.yaml"
    m.write_text(f"base: {{model.name: tiny, data.path: {dataset}, train.max_steps: 2, train.effective_batch_size: 4}}\n"
                 "experiments:\n  - {name: bs4, set: {train.micro_batch_size: 4}}\n")
    return m


@pytest.mark.usefixtures("children_in_process")
def test_a_run_draws_its_own_picture(tmp_path, dataset, capsys):
    """tunebench report RUN_DIR: loss, lr, tokens/s, CPU and memory charts, the memory report, the settings
    with reasons and the summary; compare writes one per run and links it from its own report."""
    compare.run(str(_matrix(tmp_path, dataset)), str(tmp_path / "r.csv"), str(tmp_path / "runs"), 1, {})
    run_dir = next((tmp_path / "runs").glob("*/"))
    with open(tmp_path / "r.csv", newline="") as f:
        row = next(csv.DictReader(f))
    # it_per_s: optimizer steps over training time, which duration_seconds gives rounded to the millisecond: the
    # rate lies between the steps over the rounding's two ends (a relative bound fails a fast machine's short run)
    steps, seconds = int(row["steps"]), float(row["duration_seconds"])
    assert steps / (seconds + 0.0005) * (1 - 1e-9) <= float(row["it_per_s"]) <= steps / max(seconds - 0.0005, 1e-9)
    html = (run_dir / "report" / "report.html").read_text()
    for chart in ("loss", "learning_rate", "tokens_per_s"):  # this run is too short for the 1 s monitor
        assert f"id='{chart}'" in html, chart
    for section in ("Memory", "Settings, and why", "Summary", "micro_batch_size", "peak / total"):
        assert section in html, section
    assert "date: " in (run_dir / "system_info.txt").read_text()
    assert cli.main(["report", str(tmp_path / "r.csv"), "-o", str(tmp_path / "rep")]) == 0
    assert (run_dir / "report" / "report.html").resolve().as_uri() in (tmp_path / "rep" / "report.html").read_text()
    assert cli.main(["report", str(run_dir), "-o", str(tmp_path / "one")]) == 0
    assert (tmp_path / "one" / run_dir.name / "report.html").is_file()


def test_a_run_report_draws_gpus_and_survives_a_torn_line(tmp_path):
    import json

    from tunebench.jobs import run_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 3 - i / 10, "lr": 1e-3,
                                                           "tokens_per_s": 100 + i}) + "\n" for i in range(1, 6))
                                       + '{"step": 6, "lo')
    (run / "monitor.jsonl").write_text("".join(json.dumps({"time": 100.0 + i, "cpu_percent": 50, "process_rss_mb": 900,
                                                           "ram_used_mb": 2000, "gpu0_util_percent": 80 + i,
                                                           "gpu0_memory_mb": 5000}) + "\n" for i in range(4)))
    (run / "plan.json").write_text(json.dumps({"hardware": {"ram_total_mb": 16000, "gpus": [
        {"index": 0, "name": "NVIDIA H100", "memory_mb": 81000}]}, "decisions": []}))
    html = run_report.write(run).read_text()
    for chart in ("loss", "learning_rate", "tokens_per_s", "cpu", "memory", "gpu0"):
        assert f"id='{chart}'" in html, chart
    assert "NVIDIA H100" in html and "not finished" in html
    assert "6.2%" in html  # GPU memory peak 5000 of 81000 MB


def test_the_guides_python_api_as_written(tmp_path):
    from tunebench import DataConfig, ModelConfig, TrainingConfig
    from tunebench.settings.pretrain import PretrainConfig, validate

    config = TrainingConfig(device="cuda", force_cpu=True)
    assert config.get_effective_device() == "cpu"
    assert TrainingConfig(device="cpu").get_effective_device() == "cpu"
    training_config = TrainingConfig(report_to=["tensorboard"], logging_dir=str(tmp_path / "logs"),
                                      dataloader_prefetch_factor=2, distributed_backend="gloo")
    training_config.batch_size = 1  # the configs are mutable, as the guide's are
    assert training_config.report_to == "tensorboard" and training_config.batch_size == 1
    (tmp_path / "corpus.txt").write_text("text\n")
    base_config = PretrainConfig(ModelConfig(), training_config,
                                 DataConfig(train_file=str(tmp_path / "corpus.txt"), cache_dir=str(tmp_path / "cache")))
    config = base_config.copy()
    config.training.learning_rate = 0.001  # the guide's search loop
    assert base_config.training.learning_rate == 3e-4 and config.training.learning_rate == 1e-3
    validate(config)
    with pytest.raises(Exception, match="'training.backend' and 'training.distributed_backend' both set distributed.backend"):
        validate(PretrainConfig(training=TrainingConfig(backend="nccl", distributed_backend="gloo"),
                                data=DataConfig(train_file=str(tmp_path / "corpus.txt"))))
    assert TrainingConfig(report_to=["mlflow", "tensorboard"]).report_to == "mlflow,tensorboard"
    with pytest.raises(Exception, match="comet: not one of tensorboard, mlflow, wandb, trackio"):
        TrainingConfig(report_to=["comet"])


def test_force_cpu_prefetch_and_cache_dir_reach_the_run(tmp_path, capsys):
    """A tiny pretraining run with the guide's settings: force_cpu and the prefetch factor are in the
    settings table with their reasons, the token cache is in cache_dir."""
    from tunebench import DataConfig, ModelConfig, TrainingConfig, pretrain, train_tokenizer
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 300)
    train_tokenizer([str(corpus)], vocab_size=300, output_dir=tmp_path / "tok")
    pretrain(ModelConfig(vocab_size=300, d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=32, dropout=0.0),
             TrainingConfig(device="cuda", force_cpu=True, max_steps=2, batch_size=2, dataloader_prefetch_factor=2,
                            checkpoint_dir=str(tmp_path / "run"), progress=False, save_steps=None, eval_steps=None,
                            precision="fp32"),
             DataConfig(train_file=str(corpus), tokenizer=str(tmp_path / "tok"), max_length=32,
                        cache_dir=str(tmp_path / "cache")))
    said = capsys.readouterr().out
    assert "training.force_cpu: the CPU, whatever device 'cuda' says" in said
    assert "dataloader_prefetch_factor 2 not needed" in said
    assert any((tmp_path / "cache").rglob("*")), "the token cache went elsewhere"


def test_the_guides_example_pipeline_runs(tmp_path, monkeypatch, capsys):
    """The example as `python examples/train_small_model.py ...` runs it (as __main__, its own argv), in this
    process: a new Python would add only its start-up."""
    import runpy
    import sys

    root = Path(__file__).resolve().parents[1]
    script = str(root / "examples" / "train_small_model.py")
    monkeypatch.setattr(sys, "argv", [script, "--steps", "8", "--output-dir", str(tmp_path / "small"), "--device", "cpu"])
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # a script may end with sys.exit(main()): 0 or None is success
        assert not e.code, e.code
    out = capsys.readouterr().out
    for line in ("tokenizer: ", "device: cpu", "pretrained: eval loss", "fine-tuned: eval loss", "pretrained says:",
                 "fine-tuned says:"):
        assert line in out, line
    assert (tmp_path / "small" / "lora" / "adapter_model.safetensors").is_file()


def test_a_failed_compile_falls_back_to_eager_with_the_reason(tmp_path, dataset, monkeypatch):
    """The guide's "Compilation failed": the run goes on eagerly, and the settings table says why."""
    import json

    from tunebench.jobs import finetune
    from tunebench.settings.finetune import load_config
    from tunebench.training.autotune import compiler

    def broken(*args, **kwargs):
        raise RuntimeError("Compilation failed: no working C compiler found")

    def compile_blocks(model, mode="default"):
        assert mode == "reduce-overhead"  # --compile-mode reaches the compiler
        for layer in model.base_model.model.model.layers:
            layer._compiled_call_impl = broken
        return len(model.base_model.model.model.layers)

    monkeypatch.setattr(compiler, "compile_blocks", compile_blocks)
    summary = finetune.run(load_config(options={
        "model.name": "tiny", "data.path": str(dataset), "train.max_steps": 2, "train.micro_batch_size": 4,
        "train.output_dir": str(tmp_path / "run"), "train.progress": False, "train.compile": "on",
        "train.compile_mode": "reduce-overhead"}))
    assert summary["steps"] == 2
    row = next(d for d in json.loads((tmp_path / "run" / "plan.json").read_text())["decisions"]
               if d["setting"] == "compile")
    assert row["value"] is False and "compiling failed (RuntimeError: Compilation failed: no working C" in row["reason"]
    assert "running eagerly" in row["reason"]


def test_prepare_writes_seeded_splits_and_says_what_it_dropped(tmp_path, capsys):
    import json

    from tunebench.model import models
    rows = [{"instruction": f"question {i}", "response": "answer " + "x" * (i * 3)} for i in range(40)]
    rows += [{"instruction": "question 3", "response": "answer " + "x" * 9},  # a duplicate of row 3
             {"instruction": "", "response": "no prompt"}]
    src = tmp_path / "raw.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # prepare_custom_dataset.py --dataset_name ... --max_samples 1000 --output_dir ./small_dataset
    assert cli.main(["prepare", "--data", str(src), "--max_samples", "30", "--output_dir", str(tmp_path / "small"),
                     "--model", "tiny", "--max-length", "64"]) == 0
    said = capsys.readouterr().out
    summary = json.loads((tmp_path / "small" / "summary.json").read_text())
    assert summary["kept"] == 40 and summary["dropped"] == {"empty prompt or response": 1,
                                                             "duplicate of an earlier row": 1}
    train = [json.loads(x) for x in (tmp_path / "small" / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (tmp_path / "small" / "eval.jsonl").read_text().splitlines()]
    assert (len(train), len(held)) == (27, 3) and not {r["instruction"] for r in train} & {r["instruction"] for r in held}
    tok = models.tokenizer_for("tiny")
    from tunebench.data.tokenize import tokenize_messages
    from tunebench.settings.finetune import load_config

    cfg = load_config(options={"data.max_length": 10**9}).data
    lengths = tokenize_messages([[{"role": "user", "content": r["instruction"]},
                                  {"role": "assistant", "content": r["response"]}] for r in train + held],
                                tok, cfg, "instruction").lengths()
    assert summary["rows_over_max_length"] == int((lengths > 64).sum()) > 0
    assert summary["tokens_per_row"]["max"] == int(lengths.max())
    assert "1 empty prompt or response, 1 duplicate of an earlier row" in said and "exceed --max-length 64" in said
    again = tmp_path / "again"
    assert cli.main(["prepare", "--data", str(src), "--max_samples", "30", "--output_dir", str(again),
                     "--model", "tiny", "--max-length", "64"]) == 0
    assert (again / "train.jsonl").read_text() == (tmp_path / "small" / "train.jsonl").read_text()  # seeded
    assert cli.main(["prepare", "--dataset_name", "no/such-dataset", "--output_dir", str(tmp_path / "x")]) == 2
    assert "is not in the Hugging Face cache" in capsys.readouterr().err and not (tmp_path / "x").exists()
