import ast
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_module
from tunebench.core import startup
from tunebench.interfaces import cli
from tunebench.interfaces.cli import main


def tb(*args, check=True):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "tunebench", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def tb_here(*args, check=True):
    """`tunebench ARGS` through cli.main in this process (what it prints, captured): for the round trips whose
    subject is the jobs, not the process; `tb` above starts the real command where the process is the point."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    proc = subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"exit {code}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_train_generate_merge_eval_end_to_end(tmp_path, dataset):
    out = tmp_path / "run"
    proc = tb_here("train", "--model", "tiny", "--data", dataset, "--output-dir", out, "--max-length", 256,
              "--batch-size", 2, "--max-steps", 4, "--eval-steps", 2, "--no-progress", "train.seed=3")
    assert "trainable parameters: 3,584" in proc.stdout
    assert re.search(r"precision\s+\w+\s+\S", proc.stdout) and re.search(r"grad_accum_steps\s+4\s", proc.stdout)
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json", "config.yaml",
                 "plan.json", "metrics.jsonl", "summary.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in steps if "loss" in r]
    evals = [r for r in steps if "eval_loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    # summary.json agrees with what was logged step by step
    # 11 training rows, 8 a step: each epoch is a step of 8 and a short one of 3, so 4 steps = 2 x 11 examples
    assert summary["steps"] == 4 and summary["samples"] == 22
    assert summary["tokens"] == train_rows[-1]["tokens"]
    assert summary["train_loss"] == pytest.approx(sum(r["loss"] for r in train_rows) / 4)
    assert summary["final_train_loss"] == train_rows[-1]["loss"]
    assert summary["eval_loss"] == evals[-1]["eval_loss"] and summary["eval_loss_before"] == evals[0]["eval_loss"]
    assert summary["perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
    # train_time_s is rounded to the millisecond, samples_per_s is not: they agree within that rounding (a
    # relative bound failed once, when four tiny steps took 67 ms)
    assert summary["samples"] / summary["samples_per_s"] == pytest.approx(summary["train_time_s"], abs=5e-4 + 1e-9)
    assert summary["tokens_per_s"] == pytest.approx(train_rows[-1]["tokens_per_s"])  # warm-up steps excluded, both
    # each step's learning rate is the schedule's at that step, from the rate and warm-up the plan names
    import torch

    from tunebench.training import optim
    plan = {d["setting"]: d for d in json.loads((out / "plan.json").read_text())["decisions"]}
    lr = float(plan["lr"]["value"])
    schedule, warmup = re.search(r"; (\w+) after (\d+) warm-up steps", plan["lr"]["reason"]).groups()
    expected = optim.scheduler(torch.optim.SGD([torch.zeros(1)], lr=lr), schedule, int(warmup), 4)
    for row in train_rows:
        assert row["lr"] == pytest.approx(expected.get_last_lr()[0], rel=1e-6), row["step"]
        expected.optimizer.step()
        expected.step()
    assert len({r["lr"] for r in train_rows}) > 1  # it moves
    # the machine in the run's plan.json is what `tunebench hw --json` reports
    record = json.loads(tb_here("hw", "--json").stdout)
    ran, now = json.loads((out / "plan.json").read_text())["hardware"], record["hardware"]
    moving = {"ram_available_mb", "cpu_mhz"}  # read at that moment: they move between two processes
    assert {k: v for k, v in ran.items() if k not in moving} == {k: v for k, v in now.items() if k not in moving}
    assert ran.keys() == now.keys() and ran["physical_cores"] >= 1
    decided = {d["setting"]: d["value"] for d in record["decisions"]}
    assert {k: plan[k]["value"] for k in ("device", "precision")} == {k: decided[k] for k in ("device", "precision")}

    from peft import PeftModel

    from tunebench.model import models
    PeftModel.from_pretrained(models.resolve("tiny").model, str(out))  # the adapter is standard PEFT

    merged = tmp_path / "merged"
    tb_here("merge", "--adapter", out, "--output-dir", merged)
    assert (merged / "model.safetensors").is_file() and (merged / "config.json").is_file()
    greedy = ("--prompt", "hi", "--max-new-tokens", 8, "--raw", "--precision", "fp32")  # bf16 would round apart
    said = tb_here("generate", "--adapter", out, *greedy).stdout
    assert said == tb_here("generate", "--model", merged, *greedy).stdout
    assert said.rstrip("\n"), repr(said)  # the 8 new tokens' text: two empty outputs would be equal too
    ev = json.loads(tb_here("eval", "--model", merged, "--data", dataset, "--max-length", 256).stdout)
    ev_adapter = json.loads(tb_here("eval", "--adapter", out, "--data", dataset, "--max-length", 256).stdout)
    assert ev["rows"] == 12 and ev["eval_loss"] == pytest.approx(ev_adapter["eval_loss"], rel=1e-4)


def test_study_flags_yaml_and_qlora(tmp_path, dataset):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  lr: 1e-3\n  progress: false\ndata:\n  eval_fraction: 0.25\n")
    out = tmp_path / "study"
    tb_here("train", cfg, "--model_name", "tiny", "--data", dataset, "--num_epochs", 1, "--batch_size", 2,
       "--gradient_accumulation_steps", 2, "--max_length", 256, "--output_dir", out, "--use_4bit",
       "--save_steps", 2)
    saved = (out / "config.yaml").read_text()
    assert "method: qlora" in saved and "quantization: 4bit" in saved and "lr: 0.001" in saved
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["method"] == "qlora"  # 9 rows / (2 x 2) per step


def test_bad_input_exits_with_one_line_no_traceback(tmp_path):
    proc = tb("train", "--model", "tiny", "--data", tmp_path / "missing.csv", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "not found" in proc.stderr
    debug = tb("train", "--model", "tiny", "--data", tmp_path / "missing.csv", "--debug", check=False)
    assert "Traceback" in debug.stderr


def test_a_refused_setting_is_said_before_the_libraries_load(tmp_path, dataset):
    """train, pretrain and launch check every setting before a job loads torch, transformers and peft (7-9 s of a
    2-core machine's start-up): a refused one is one line in about a second. Under launch it is checked at the
    launched world size before torchrun starts a rank, so no rank loads them either (the launcher's own line)."""
    probe = ("import sys\nfrom tunebench.interfaces import cli\ncode = cli.main(sys.argv[1:])\n"
             "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))\nsys.exit(code)\n")
    data = ["--model", "tiny", "--data", str(dataset), "--output-dir", str(tmp_path / "out")]
    for argv, said, loaded in (
            (["train", *data, "--batch-size", "0"], "must be a positive number", "[]"),
            (["pretrain", "cpu_small_model", "--max-steps", "0"], "must be a positive number", "[]"),
            (["launch", "--nproc-per-node", "2", "--", "train", *data, "--batch-size", "2", "--effective-batch-size",
              "6"], "is not a multiple of 2 rank(s) x --batch-size 2", "['torch']")):  # torchrun's own torch
        done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 2 and said in done.stderr, (argv, done.stderr[-2000:])
        assert done.stderr.strip().count("\n") == 0, done.stderr  # one line: no rank started to add its own
        assert done.stdout.strip().splitlines()[-1] == loaded, (argv, done.stdout)  # nothing more was imported
    assert not (tmp_path / "out").exists()


def _bad_inputs(tmp_path, dataset):
    latin = tmp_path / "latin.csv"
    latin.write_bytes("instruction,response\ncaf\xe9,ok\n".encode("latin-1"))
    cols = tmp_path / "cols.csv"
    cols.write_text("prompt_text,reply\nq,a\n")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    d = str(dataset)
    return [
        (["--data", str(tmp_path / "none.csv")], "not found"),
        (["--data", str(latin)], "not UTF-8"),
        (["--data", str(cols)], "cannot tell the dataset format"),
        (["--data", str(cols), "--format", "instruction"], "lacks column"),
        (["--data", d, "--max-length", "4"], "empty after tokenization"),
        (["--data", d, "--model", "someone/unknown-model"], "offline"),
        (["--data", d, "--output-dir", str(blocker / "sub")], "cannot write to --output-dir"),
        (["--data", d, "--target-modules", "qkv"], "no linear module named 'qkv'"),
        (["--data", d, "--batch-size", "0"], "must be a positive number"),
        (["--data", d, "--batch-size", "-2"], "must be a positive number"),
        (["--data", d, "train.lerning_rate=1"], "did you mean 'optimizer.lr'"),
        (["--data", d, "--device", "cuda"], "no CUDA GPU"),
        (["--data", d, "--liger", "on"], "--liger on cannot be honoured: Liger's kernels are Triton kernels for CUDA"),
        (["--data", d, "--attention", "flash_attention_2", "--batch-size", "1"], "--attention flash_attention_2 cannot run here"),
        (["--data", d, "--liger", "maybe"], "hardware.liger 'maybe' is not one of auto, on, off"),
        (["--data", d, "--resume", str(tmp_path)], "not a tunebench checkpoint"),
        (["--data", d, "--bogus-flag"], "unrecognized argument"),
    ]


def test_each_bad_input_names_the_problem(tmp_path, dataset, capsys):
    for args, message in _bad_inputs(tmp_path, dataset):
        code = main(["train", "--model", "tiny", "--output-dir", str(tmp_path / "o"), "--no-progress", *args])
        err = capsys.readouterr().err.strip()
        assert code == 2, (args, err)
        assert message in err, (args, err)
        assert err.count("\n") == 0 and err.startswith("tunebench: error:"), (args, err)


def test_eval_checks_its_data_options_like_train(capsys):
    assert main(["eval", "--model", "tiny", "--max-length", "0"]) == 2
    assert "max_length (--max-length) must be a positive number" in capsys.readouterr().err


def test_merge_never_overwrites(tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("precious")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    assert main(["merge", "--adapter", str(adapter), "--output-dir", str(full)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (full / "keep.txt").read_text() == "precious"


def test_chat_answers_each_line_until_an_empty_one(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "tunebench", "chat", "--model", "tiny", "--max-new-tokens", "3"],
                          input="hello\n/reset\nagain\n\n", capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("bot> ") == 2 and "chatting with preset tiny" in proc.stdout


def test_hw_json_is_the_record_runs_save():
    proc = tb("hw", "--json")
    record = json.loads(proc.stdout)
    assert {"hardware", "decisions", "peak_tflops"} <= set(record)
    assert record["hardware"]["physical_cores"] >= 1
    assert {d["setting"] for d in record["decisions"]} >= {"device", "precision", "torch_threads", "compile"}


@pytest.mark.skipif(not startup.on_glibc(), reason="glibc's malloc tunables: Linux with glibc only")
def test_the_command_keeps_freed_memory_and_leaves_a_users_malloc_settings_alone():
    """startup.keep_freed_memory (the command calls it first) starts the process again, once, with glibc's
    tunables: a 64 MB block made and freed over and over is then served from memory kept, without the kernel
    faulting its pages in again; by default glibc unmaps it each time and all 16,384 pages fault anew. Malloc
    settings already in GLIBC_TUNABLES are left as they are. The settings row says which. In a child: the
    setting is the whole process's."""
    code = """
import os, resource, sys, torch
from tunebench.machine import hardware
from tunebench.core import startup
print("start", flush=True)
if sys.argv[1] != "default":
    startup.keep_freed_memory()
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(2**24).fill_(1.0)  # 64 MB, freed at once
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
row = [d.value for d in hardware.plan("cpu", "fp32", hardware.detect()).decisions if d.setting == "allocator"]
print(repr((faults, os.environ.get("GLIBC_TUNABLES"), row)))
"""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    mine = "glibc.malloc.tcache_count=7"
    for mode, tunables, value in (("keep", None, "reuse"), ("default", None, "C default"),
                                  ("user", mine, "GLIBC_TUNABLES")):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True,
                             env={**env, **({"GLIBC_TUNABLES": tunables} if tunables else {})}).stdout.splitlines()
        faults, seen, row = ast.literal_eval(out[-1])
        assert row == [value]
        if mode == "keep":
            assert out[:2] == ["start", "start"] and len(out) == 3 and seen == startup.KEEP_FREED  # again, once
            assert max(faults[1:]) < 100, faults
        else:  # 16,384 pages fault anew; where transparent huge pages are `always`, 32 huge ones may
            assert out[:1] == ["start"] and seen == tunables and min(faults) > (16 if _huge_pages() else 10_000), faults


def _huge_pages() -> bool:
    """Transparent huge pages back every large anonymous mapping (`always`), so a 64 MB block faults as 2 MB pages."""
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def test_the_command_pauses_collection_until_its_training_loop_and_leaves_callers_alone(tmp_path, dataset,
                                                                                        monkeypatch):
    """cli.entry (the `tunebench` command) turns the collector off for start-up, and the training loop
    turns it back on with what exists frozen. A program that calls a job keeps its collector as it was,
    even one that turned it off itself."""
    import gc

    from conftest import tiny_run_config
    from tunebench.jobs import finetune

    real_run, seen, kept = finetune.run, [], []
    monkeypatch.setattr(finetune, "run", lambda cfg: seen.append(gc.isenabled()))
    monkeypatch.setattr(startup, "keep_freed_memory", lambda: kept.append(True))  # this process's allocator stays
    monkeypatch.setattr(sys, "argv", ["tunebench", "train", "--model", "tiny", "--data", str(dataset)])
    try:
        assert cli.entry() == 0 and seen == [False] and kept == [True]  # off when the job starts, until its loop
        real_run(tiny_run_config(dataset, tmp_path / "run", **{"train.max_steps": 1}))
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()
    real_run(tiny_run_config(dataset, tmp_path / "run2", **{"train.max_steps": 1}))  # called, not the command
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        real_run(tiny_run_config(dataset, tmp_path / "run3", **{"train.max_steps": 1}))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_ctrl_c_leaves_a_checkpoint_the_next_run_resumes_from(tmp_path, dataset):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the run finishes its step, saves a
    checkpoint, says how to resume and exits 130; --resume auto goes on from that step."""
    import signal
    import time

    from tunebench.training import checkpoint

    out = tmp_path / "run"
    args = ["train", "--model", "tiny", "--data", str(dataset), "--output-dir", str(out), "--max-length", "64",
            "--batch-size", "1", "--effective-batch-size", "1", "--precision", "fp32", "--compile", "off",
            "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-m", "tunebench", *args, "--max-steps", "100000"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.is_file() and '"step": 2,' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "SIGINT: saving a checkpoint after this step" in stdout
    step = int(re.search(r"interrupted at step (\d+); a checkpoint was saved: rerun with --resume auto", stderr)[1])
    assert "Traceback" not in stderr and step >= 2
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == [f"step-{step:08d}"]
    tb(*args, "--max-steps", step + 1, "--resume", "auto")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-2:] == [step, step + 1]  # one more step, after the saved one
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 1


def test_report_to_tensorboard_writes_events_tensorboards_reader_loads(tmp_path, dataset):
    """--report-to tensorboard: the event files hold every logged loss and eval loss, at its step, as
    TensorBoard's own reader (EventAccumulator) reads them, equal to metrics.jsonl's."""
    needs_module("tensorboard", "TensorBoard's reader is in the test extra: pip install -e '.[test]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    tb("train", "--model", "tiny", "--data", dataset, "--output-dir", out, "--max-length", 64, "--batch-size", 2,
       "--max-steps", 4, "--eval-steps", 2, "--no-progress", "--report-to", "tensorboard", "--precision", "fp32")
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for tag, key in (("train/loss", "loss"), ("eval/eval_loss", "eval_loss")):
        logged = [(r["step"], r[key]) for r in rows if key in r]
        scalars = events.Scalars(tag)
        assert [e.step for e in scalars] == [step for step, _ in logged], tag
        assert [e.value for e in scalars] == pytest.approx([value for _, value in logged], rel=1e-6), tag
    assert len(events.Scalars("train/loss")) == 4


@dataclasses.dataclass(frozen=True)
class _LouderGRPO(__import__("tunebench.settings.objectives", fromlist=["GRPO"]).GRPO):
    """GRPO with one setting more, as a contributor would add it: a field and its documentation, nothing else."""

    loudness: float = 1.0
    """how loud each completion is read"""


def test_every_objective_setting_is_declared_once_and_brings_its_flag_help_and_reference_row():
    """Every setting is declared once, in the objective type that holds it, with its documentation; the section
    users spell (settings.finetune.ObjectiveKeys) is made from the types, and each of its keys is a --flag in both
    spellings (cli_parser.objective_flags) whose help is that documentation, and a row of the configuration
    reference. A documented field added to a type brings its key, flag and help, each objective's words prefixed
    by whose they are."""
    from tunebench.interfaces import cli_parser
    from tunebench.settings import objectives, schema
    from tunebench.settings.finetune import ObjectiveKeys

    flat = {f.name for f in dataclasses.fields(ObjectiveKeys)}
    assert flat == {"name"} | {k for kind in objectives.KINDS for k in objectives.own_keys(kind)}
    parser = cli_parser.build_parser()
    reference = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "configuration.md").read_text()
    for key in sorted(flat - {"name"}):
        for flag in (f"--{key.replace('_', '-')}", f"--{key}"):
            assert getattr(parser.parse_args(["train", flag, "1"]), f"objective.{key}") in ("1", ["1"]), flag
        assert cli_parser.train_help(f"objective.{key}").strip(), key
        assert f"| `objective.{key}` |" in reference, key
    assert parser.parse_args(["train", "--objective", "dpo"]).__dict__["objective.name"] == "dpo"
    assert schema.docs(ObjectiveKeys)["beta"] == ("DPO and KTO: how far the model may move from its reference; GRPO: "
                                                  "the weight of the KL term against the policy the run started from "
                                                  "(0, TRL's: no KL term, no reference pass)")

    louder = objectives.flat_section(tuple(_LouderGRPO if k is objectives.GRPO else k for k in objectives.KINDS))
    assert {f.name: f.default for f in dataclasses.fields(louder)}["loudness"] is None
    assert schema.docs(louder)["loudness"] == "GRPO: how loud each completion is read"
    assert (("--loudness",), "objective.loudness") in cli_parser.objective_flags(louder)
    assert schema.docs(louder)["num_generations"] == schema.docs(ObjectiveKeys)["num_generations"]


def test_a_command_keeps_library_notices_a_user_cannot_act_on_out_of_its_output(monkeypatch):
    """The kernels hub client (installed with transformers 5.25) warns that it cannot check a kernel's publisher
    offline, the way tunebench always runs: the README's first command printed it in a fresh environment."""
    import logging

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the command's environment defaults stay in this test
    os.environ.pop("HF_HUB_OFFLINE", None)
    hub = logging.getLogger("kernels._internals.hf_hub")
    try:
        cli._quiet_libraries(allow_download=False)
        assert not hub.isEnabledFor(logging.WARNING) and hub.isEnabledFor(logging.ERROR)
        assert os.environ["HF_HUB_OFFLINE"] == "1"
    finally:
        logging.getLogger("kernels").setLevel(logging.NOTSET)


def test_an_evaluation_reads_in_the_words_of_the_runs_objective_not_of_the_figures_its_record_holds():
    """The closing line words an eval as the run's objective type says (eval_words): an SFT run whose held-out set
    records a figure a preference run would (a source named 'rewards', say) still reads as loss and perplexity."""
    from tunebench.settings import objectives

    record = {"eval_loss": 0.6931, "perplexity": 2.0, "eval_rewards/accuracies": 0.75, "eval_rewards/margins": 0.125,
              "eval_pairs": 4, "eval_kl": 0.01, "eval_rewards/chosen": 0.5, "eval_examples": 6}
    assert objectives.SFT().describe_eval(record) == "loss 0.6931, perplexity 2.00"
    assert objectives.DPO().describe_eval(record) == objectives.ORPO().describe_eval(record) == \
        "loss 0.6931, reward accuracy 0.750, margin 0.1250 on 4 held-out pairs"
    assert objectives.KTO().describe_eval(record) == \
        "loss 0.6931, KL 0.0100, desirable reward 0.5000 on 6 held-out completions"  # no undesirable one held out


def test_an_objectives_own_settings_say_each_objectives_default_from_the_one_table():
    """DPO's beta, GRPO's group size and the rest default per objective (each objective's settings type,
    settings/objectives.py); their --help and the configuration reference say so from those types, not from prose
    that can drift from them."""
    from tunebench.interfaces.cli_parser import train_help
    from tunebench.settings.finetune import ObjectiveKeys
    from tunebench.settings.objectives import default_text

    assert default_text("beta") == "0.1 for DPO and KTO, 0.0 for GRPO"
    assert default_text("num_generations") == "8 for GRPO and RFT" and default_text("orpo_lambda") == "0.1 for ORPO"
    for key in (f.name for f in dataclasses.fields(ObjectiveKeys)):
        text = default_text(key)
        if text:
            assert train_help(f"objective.{key}").endswith(f"(default {text})"), key
