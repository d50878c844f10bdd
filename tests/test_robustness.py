"""Bad input refused early, figures that are what they say, threads that fit the machine, resume that
follows the new run: the correctness and robustness pass over fine-tuning."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROWS, tiny_run_config
from tunebench.core.errors import TunebenchError
from tunebench.data import batching, formats
from tunebench.data.tokenize import render_prompt, segments
from tunebench.interfaces.cli import main
from tunebench.jobs import finetune
from tunebench.jobs.generate import trained_template
from tunebench.jobs.parts import runner
from tunebench.machine import hardware, metrics, monitor
from tunebench.model import models
from tunebench.settings.finetune import DataConfig
from tunebench.training import loop, objective


def _cfg(data, out, **extra):
    return tiny_run_config(data, out, **{"train.max_steps": 4, **extra})


def _csv(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _early_bad_inputs(tmp_path, dataset):
    good = "".join(f"q{i},a{i}\n" for i in range(12))
    made_with_r4 = tmp_path / "r4"
    finetune.run(_cfg(dataset, made_with_r4, **{"train.max_steps": 1, "adapter.r": 4}))
    return [
        (["--data", _csv(tmp_path, "open.csv", "instruction,response\nhi,there\n\"unterminated,quote\nx,y\n")],
         "line 3: a quoted field opens there and never closes"),
        (["--data", _csv(tmp_path, "wide.csv", "instruction,response\n" + good + "a,b,c\n")],
         "line 14 has 3 fields, the header has 2"),
        (["--data", _csv(tmp_path, "blank.csv", "instruction,response\n,\n,\n")], "has no usable rows"),
        (["--data", _csv(tmp_path, "few.csv", "instruction,response\n,\nq,a\nr,b\n")],
         "leaves 1 training row(s) (2 usable, 1 empty, 1 held out for eval), fewer than one effective batch of 8"),
        (["--data", str(dataset), "--resume", str(tmp_path)], "not a tunebench checkpoint"),
        (["--data", str(dataset), "--resume", str(next((made_with_r4 / "checkpoints").iterdir()))],
         "made with different adapter"),
        (["--data", str(dataset), "--model", "someone/unknown-model"], "offline"),
        (["--data", str(dataset), "--model", str(tmp_path)], "directory without config.json"),
    ]


def test_bad_input_is_refused_before_the_model_loads(tmp_path, dataset, capsys, monkeypatch):
    cases = _early_bad_inputs(tmp_path, dataset)

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(models, "resolve", no_loading)
    for args, message in cases:
        code = main(["train", "--model", "tiny", "--output-dir", str(tmp_path / "o"), "--no-progress", *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and message in err, (args, err)
        assert err.count("\n") == 0, err


def test_empty_rows_are_dropped_and_counted():
    rows = [{"instruction": "q", "response": "a"}, {"instruction": "", "response": "a"},
            {"instruction": "q", "response": "  "}, {"instruction": "q2", "response": "a2"}]
    fmt, messages = formats.records_to_messages(rows, DataConfig(), "x")
    kept = [m for m in messages if not formats.is_empty(m)]
    assert [m[0]["content"] for m in kept] == ["q", "q2"]
    chat = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": "yo"}]]
    assert [formats.is_empty(m) for m in chat] == [True, False]
    assert formats.is_empty([{"role": "text", "content": " \n"}])


def test_empty_rows_are_reported_and_the_rest_train(tmp_path, capsys):
    text = "instruction,response\n" + ",\n" + "".join(f"q{i},a{i}\n" for i in range(12)) + "q,\n"
    summary = finetune.run(_cfg(_csv(tmp_path, "d.csv", text), tmp_path / "o", **{"train.max_steps": 1}))
    out = capsys.readouterr().out
    assert "2 of 14 rows dropped: empty prompt or response (row 1, 14)" in out
    assert "10 train / 2 eval rows" in out  # 12 usable rows, 20% held out
    assert summary["steps"] == 1


def test_resuming_with_more_steps_follows_the_new_schedule(tmp_path, dataset):
    from tunebench.training import optim
    out = tmp_path / "longer"
    finetune.run(_cfg(dataset, out, **{"train.warmup_ratio": 0.0}))
    first = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    finetune.run(_cfg(dataset, out, **{"train.warmup_ratio": 0.0, "train.max_steps": 8, "train.resume": "auto"}))
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    resumed = {r["step"]: r["lr"] for r in records[len(first):]}
    fresh = optim.scheduler(torch.optim.SGD([torch.zeros(1)], lr=1e-2), "cosine", 0, 8)
    expected = []
    for _ in range(8):
        expected.append(fresh.get_last_lr()[0])
        fresh.step()
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, lr in resumed.items():
        assert lr == pytest.approx(expected[step - 1], rel=1e-9), step
    assert resumed[5] == pytest.approx(0.5 * 1e-2)  # half-way down the new cosine, not the old one's end


def _hw(physical=8, logical=16, usable=None, quota=None):
    return hardware.Hardware("cpu", physical, logical, frozenset(), 8000, 8000, "Linux",
                             usable_cpus=usable, cpu_quota=quota)


@pytest.mark.parametrize("hw, asked, env, threads, reason", [
    (_hw(), None, {}, 8, "8 physical cores"),
    (_hw(), None, {"OMP_NUM_THREADS": "3"}, 3, "OMP_NUM_THREADS=3"),
    (_hw(), 5, {"OMP_NUM_THREADS": "3"}, 5, "asked for (--threads)"),
    (_hw(usable=4), None, {}, 2, "CPU affinity allows 4 of 16 CPUs"),
    (_hw(physical=64, logical=64, quota=2.0), None, {}, 2, "cgroup CPU quota allows 2 CPUs"),
    (_hw(physical=64, logical=64, quota=0.5), None, {}, 1, "cgroup CPU quota allows 0.5 CPUs"),
])
def test_threads_follow_the_request_the_environment_affinity_and_quota(hw, asked, env, threads, reason):
    d = hardware.plan("cpu", "fp32", hw, threads=asked, env=env).decision("torch_threads")
    assert d.value == threads and reason in d.reason


def test_more_threads_than_usable_cpus_is_refused():
    with pytest.raises(TunebenchError, match="--threads 20 is more than the 16 CPUs this process may use; pass "
                                             "--threads 16 or less"):
        hardware.plan("cpu", "fp32", _hw(), threads=20, env={})


def test_a_bad_omp_num_threads_is_refused():
    with pytest.raises(TunebenchError, match="OMP_NUM_THREADS='many' is not a positive whole number"):
        hardware.plan("cpu", "fp32", _hw(), env={"OMP_NUM_THREADS": "many"})


@pytest.mark.parametrize("files, quota", [
    ({"cpu_max": "200000 100000"}, 2.0), ({"cpu_max": "max 100000"}, None), ({"cpu_max": "150000 100000"}, 1.5),
    ({"cfs_quota": "-1", "cfs_period": "100000"}, None), ({"cfs_quota": "400000", "cfs_period": "100000"}, 4.0),
    ({"cpu_max": "garbage"}, None),
])
def test_cgroup_quota_files_parse(files, quota):
    assert hardware.parse_cpu_quota(**files) == quota


def test_threads_asked_for_are_what_the_run_uses(tmp_path, dataset, monkeypatch):
    used = []
    real = loop.optimizer_steps

    def spy(*args, **kwargs):
        used.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "optimizer_steps", spy)
    before = torch.get_num_threads()
    try:
        finetune.run(_cfg(dataset, tmp_path / "t", **{"train.threads": 1, "train.max_steps": 1}))
    finally:
        torch.set_num_threads(before)
    plan = json.loads((tmp_path / "t" / "plan.json").read_text())
    assert used == [1]
    assert {"setting": "torch_threads", "value": 1, "reason": "asked for (--threads)"} in plan["decisions"]
    settings = {d["setting"] for d in plan["decisions"]}
    assert "dataloader_workers" not in settings  # nothing read it


@pytest.mark.alone  # another worker's test could be the busiest process
def test_other_load_sees_a_busy_process_beside_this_one():
    import subprocess
    import sys
    import time

    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        time.sleep(1.0)
        _, busiest = monitor.other_load(own_threads=0)
    finally:
        spin.kill()
    assert busiest is not None and f"(pid {spin.pid})" in busiest, busiest


def test_slowdown_is_said_once_with_the_other_processes_load(capsys):
    logged = []
    watch = runner.SlowdownWatch(1000.0, lambda threads: (1.8, "python (pid 7) at 0.9 CPUs"), 2, logged.append,
                                 warmup=2, window=3)
    for step in range(1, 7):
        watch(step, 1.0, 900)  # at speed
    assert not logged
    for step in range(7, 20):
        watch(step, 1.0, 250)  # a quarter of the probe's speed
    assert len(logged) == 1
    message = logged[0]["warning"]
    assert "the last 3 steps ran at 467 positions/s, 47% of the 1,000 the probe measured" in message
    assert ("other processes want 1.8 CPUs beside this run's 2 threads (load average 3.8; busiest: python (pid 7) "
            "at 0.9 CPUs)") in message
    assert "warning: slowdown" in capsys.readouterr().out


def test_slowdown_without_a_probe_is_measured_against_the_runs_own_pace():
    logged = []
    watch = runner.SlowdownWatch(None, lambda threads: (0.0, None), 2, logged.append, warmup=0, window=2)
    for step, positions in enumerate([1000, 1000, 1000, 600, 600, 300, 300], 1):
        watch(step, 1.0, positions)
    assert len(logged) == 1 and logged[0]["step"] == 6
    assert "450 positions/s, 45% of the 1,000 this run reached earlier" in logged[0]["warning"]
    assert "no other process is busy (load average 2.0 for 2 threads)" in logged[0]["warning"]


def test_example_lengths_of_packed_and_padded_batches():
    from tunebench.data.tokenize import Tokenized

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 40, size=9)
    ids = rng.integers(0, 50, size=int(lengths.sum())).astype(np.int32)
    data = Tokenized(ids, np.ones_like(ids, dtype=np.int8), np.concatenate([[0], np.cumsum(lengths)]), "text", 0, np.arange(len(lengths)))
    rows = list(range(9))
    packed = batching.collate_packed(data, rows, 0, capacity=64)
    assert packed["input_ids"].shape[0] < 9
    assert sorted(loop.example_lengths(packed).tolist()) == sorted(lengths.tolist())
    padded = batching.collate(data, rows, 0)
    assert loop.example_lengths(padded).tolist() == lengths.tolist()


@pytest.mark.parametrize("packing", ["off", "on"])
def test_samples_count_examples_and_flops_use_their_own_lengths(tmp_path, dataset, packing):
    out = tmp_path / packing
    summary = finetune.run(_cfg(dataset, out, **{"data.packing": packing, "train.micro_batch_size": 2,
                                                 "train.effective_batch_size": 4, "train.max_steps": 2}))
    assert summary["samples"] == 2 * 4  # examples, however they were laid out in rows
    # attention FLOPs over each example's own length: sum L^2 / sum L over the examples trained on
    plan = json.loads((out / "plan.json").read_text())
    layout = next(d["value"] for d in plan["decisions"] if d["setting"] == "batch layout")
    assert (layout == "packed") == (packing == "on")
    from tunebench.data.tokenize import load_tokenized, split

    cfg = _cfg(dataset, out)
    tok = models.byte_tokenizer()
    data = load_tokenized(cfg.data, tok, None)
    train_idx, _ = split(len(data), cfg.data.eval_fraction, cfg.schedule.seed, None)
    grouped = data.lengths() if layout == "length-grouped" else None
    order = batching.epoch_order(train_idx, 2, cfg.schedule.seed, 0, lengths=grouped)[:4]
    seen = np.array([len(data.example(i)[0]) for b in order for i in b])
    model = models.resolve("tiny").model
    matmul, layers, width = metrics.flop_dims(model)
    dense = 4 * matmul + 6 * summary["trainable_parameters"]
    assert summary["tokens"] == seen.sum()
    assert summary["flops_per_token"] == pytest.approx(dense + 12 * layers * width * (seen ** 2).sum() / seen.sum())


def test_pin_memory_decision_is_what_prepare_is_given(tmp_path, dataset, monkeypatch):
    given = []
    real = loop.prepare

    def spy(batch, device, pin_memory=None):
        given.append(pin_memory)
        return real(batch, device, pin_memory)

    monkeypatch.setattr(loop, "prepare", spy)
    finetune.run(_cfg(dataset, tmp_path / "p", **{"train.max_steps": 1}))
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    decided = next(d["value"] for d in plan["decisions"] if d["setting"] == "pin_memory")
    from_loop = [g for g in given if g is not None]  # eval and probes leave it to the default
    assert from_loop and decided is False and set(from_loop) == {decided}


def test_eval_runs_on_the_planned_device_and_precision(tmp_path, dataset, capsys):
    from tunebench.jobs import evaluate

    data = DataConfig(path=str(dataset))
    result = evaluate.run("tiny", None, data, batch_size=4, where=evaluate.Placement("cpu", "fp32"))
    assert (result["device"], result["precision"], result["rows"]) == ("cpu", "fp32", len(ROWS))
    tok = models.byte_tokenizer()
    from tunebench.data.tokenize import load_tokenized

    tokenized = load_tokenized(data, tok, None)
    batches = batching.eval_batches(tokenized, np.arange(len(tokenized)), 4, tok.pad_token_id)
    direct = objective.evaluate(objective.CausalLMLoss(models.resolve("tiny").model), batches, torch.device("cpu"))
    assert result["eval_loss"] == pytest.approx(direct["eval_loss"], rel=1e-6)
    assert main(["eval", "--model", "tiny", "--data", str(dataset), "--device", "cuda"]) == 2
    assert "--device cuda was asked for, but no CUDA GPU is visible" in capsys.readouterr().err


@pytest.mark.parametrize("template, chat", [("auto", True), ("auto", False), ("Q: {instruction}\nA: ", True)])
def test_generate_prompts_the_way_training_formatted(template, chat):
    tok = models.byte_tokenizer()
    if not chat:
        tok.chat_template = None
    messages = [{"role": "user", "content": "where is my order?"}, {"role": "assistant", "content": "here"}]
    trained_prefix = segments(messages, tok, DataConfig(template=template))[0][0]
    assert render_prompt(messages[:1], tok, template) == trained_prefix


def test_generate_reads_the_runs_template(tmp_path, dataset):
    out = tmp_path / "tpl"
    finetune.run(_cfg(dataset, out, **{"train.max_steps": 1, "data.template": "Q: {instruction}\nA: "}))
    assert trained_template(str(out)) == "Q: {instruction}\nA: "
    assert trained_template(str(tmp_path / "nothing"), None) == "auto"


def test_a_child_is_started_without_a_process_of_its_own_between_fork_and_exec(tmp_path, monkeypatch):
    """children.start's preexec_fn (die_with_parent) runs in the forked child before exec: libc's prctl is looked up
    in the parent first, so the child never runs find_library (it starts `ldconfig -p`, a process of its own, a
    long window where a signal lands in the half-made child)."""
    import ctypes.util
    import os
    import sys

    from tunebench.core import startup
    from tunebench.jobs import children

    calls = tmp_path / "find_library.txt"
    real = ctypes.util.find_library

    def noted(name):
        with open(calls, "a") as f:  # the child inherits this function: its calls are written under its own pid
            f.write(f"{os.getpid()}\n")
        return real(name)

    monkeypatch.setattr(ctypes.util, "find_library", noted)
    startup.libc_prctl.cache_clear()
    try:
        proc = children.start("train", tiny_run_config(tmp_path / "d.jsonl", tmp_path / "run"), tmp_path / "run",
                              log=tmp_path / "log.txt", program=[sys.executable, "-c", "pass"])
        assert proc.wait(60) == 0
    finally:
        startup.libc_prctl.cache_clear()
    assert calls.read_text().split() == [str(os.getpid())]  # once, in this process


def test_a_child_run_never_imports_a_planted_tunebench_from_the_folder_the_server_started_in(tmp_path, monkeypatch):
    """Issue 98 N1: `python -m tunebench` puts the current folder first on sys.path; a tunebench/__init__.py
    planted in the folder the studio (or compare) was started from ran as its user on every Start."""
    from conftest import tiny_run_config
    from tunebench.jobs import children

    planted = tmp_path / "cwd" / "tunebench"
    planted.mkdir(parents=True)
    marker = tmp_path / "planted-ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    proc = children.start("no-such-job", tiny_run_config(tmp_path / "d.jsonl", tmp_path / "run"), tmp_path / "run",
                          log=tmp_path / "log.txt")
    assert proc.wait(120) == 2 and not marker.exists()  # the real tunebench refused the job, the planted file never ran


def test_a_child_run_starts_in_its_run_folder_with_the_paths_it_was_given_made_whole(tmp_path, monkeypatch):
    """Issue 98 N1, its second half: a child starts in the run folder tunebench made, not the folder the server
    was started from; what its configuration (and PYTHONPATH) named relative to that folder is made absolute first,
    so it still names the same files; names that are no path there (a preset, a built-in reward) stay names."""
    import yaml

    from conftest import tiny_run_config
    from tunebench.jobs import children

    here = tmp_path / "server"
    (here / "rewards").mkdir(parents=True)
    (here / "tiny").mkdir()  # a folder named as the preset: the preset is still meant
    (here / "d.jsonl").write_text("{}\n")
    (here / "rewards" / "mine.py").write_text("def score(**_): return [0.0]\n")
    monkeypatch.chdir(here)
    monkeypatch.setenv("PYTHONPATH", "src")
    cfg = tiny_run_config("d.jsonl", "runs/a", **{"objective.name": "grpo",
                                                  "objective.reward": ["rewards/mine.py:score", "gsm8k"]})
    show = "import os, sys; print(os.getcwd()); print(os.environ['PYTHONPATH'])"
    proc = children.start("train", cfg, Path("runs/a"), log=tmp_path / "log.txt", program=[sys.executable, "-c", show])
    assert proc.wait(60) == 0
    cwd, pythonpath = (tmp_path / "log.txt").read_text().splitlines()[:2]
    assert Path(cwd) == here / "runs" / "a" and pythonpath == str(here / "src")
    asked = yaml.safe_load((here / "runs" / "a" / "asked.yaml").read_text())
    assert asked["data"]["path"] == str(here / "d.jsonl") and asked["output"]["output_dir"] == str(here / "runs" / "a")
    assert asked["objective"]["reward"] == [f"{here / 'rewards' / 'mine.py'}:score", "gsm8k"]
    assert asked["model"]["name"] == "tiny"  # a preset, a folder of its name here or not

    # MLflow without a URI keeps its runs in the current folder: the child is told the store it would have found here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    show = "import os; print(os.environ['MLFLOW_TRACKING_URI'])"
    proc = children.start("train", tiny_run_config("d.jsonl", "runs/b", **{"logging.report_to": "mlflow"}),
                          Path("runs/b"), log=tmp_path / "log-b.txt", program=[sys.executable, "-c", show])
    assert proc.wait(60) == 0 and str(here / "mlflow.db") in (tmp_path / "log-b.txt").read_text()
