"""`tunebench tune`: the search space, and a search that runs trials as processes, resumes, survives a
crashing trial, and writes a best YAML that reproduces its trial."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tunebench.core.errors import TunebenchError
from tunebench.jobs import finetune, search, search_space
from tunebench.settings.finetune import load_config


def _space(tmp_path, text):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return str(path)


def test_a_space_holds_choices_and_ranges(tmp_path):
    params = {p.key: p for p in search_space.load_space(_space(tmp_path, """
train.lr: {low: 1.0e-5, high: 1.0e-3, log: true}
adapter.r: [4, 8, 16]
train.warmup_ratio: {low: 0.0, high: 0.1}
train.effective_batch_size: {low: 4, high: 16, step: 4}
"""))}
    assert params["train.lr"].log and not params["train.lr"].integer and params["train.lr"].low == 1e-5
    assert params["adapter.r"].choices == (4, 8, 16)
    assert params["train.effective_batch_size"].integer and params["train.effective_batch_size"].step == 4
    assert not params["train.warmup_ratio"].integer
    shipped = search_space.load_space("customer_support_lora")
    search_space.check("train", None, {}, shipped)  # every choice of the shipped space is a valid run


@pytest.mark.parametrize("text, message", [
    ("train.lr: {low: 1.0e-3, high: 1.0e-5}", "needs low < high"),
    ("train.lr: {low: 0, high: 1.0e-3, log: true}", "low must be above 0"),
    ("train.lr: {low: 0.1, high: 0.2, scale: log}", "unknown field"),
    ("train.lr: 0.001", "must be a list of values"),
    ("adapter.r: []", "needs a list of plain values"),
    ("", "names no options"),
])
def test_a_bad_space_is_one_line_that_names_the_key(tmp_path, text, message):
    with pytest.raises(TunebenchError, match=message):
        search_space.load_space(_space(tmp_path, text))


def test_every_choice_is_checked_before_any_trial(tmp_path):
    with pytest.raises(TunebenchError, match=r"adapter.method='adalora' is not a valid run"):
        search_space.check("train", None, {}, search_space.load_space(_space(tmp_path, "adapter.method: [lora, adalora]")))
    with pytest.raises(TunebenchError, match="unknown config key 'train.learning_rat'"):
        search_space.check("train", None, {}, search_space.load_space(_space(tmp_path, "train.learning_rat: [0.1]")))
    with pytest.raises(TunebenchError, match="both searched and set"):
        search_space.check("train", None, {"train.lr": 1e-3}, search_space.load_space(_space(tmp_path, "train.lr: [0.1]")))
    with pytest.raises(TunebenchError, match="eval_fraction is 0"):
        search_space.check("train", None, {"data.eval_fraction": 0}, search_space.load_space(_space(tmp_path, "train.lr: [0.1]")))
    with pytest.raises(TunebenchError, match="not found"):
        search_space.load_space("no_such_space")


def _base(dataset):
    return {"model.name": "tiny", "data.path": str(dataset), "data.max_length": 256, "data.eval_fraction": 0.2,
            "train.micro_batch_size": 2}


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def figure(row: dict, key: str) -> float:
    """A trial's figure; a trial that has none fails the test with which trial it was and why."""
    if row.get(key) in (None, ""):
        pytest.fail(f"{row['experiment']} has no {key} (status {row['status']}: {row['message'] or 'no message'}; "
                    f"its run: {row['run_dir']})", pytrace=False)
    return float(row[key])


@pytest.mark.usefixtures("children_in_process")
def test_a_search_resumes_after_an_interrupt_and_its_best_yaml_reproduces_the_trial(tmp_path, dataset):
    space = _space(tmp_path, "train.lr: {low: 1.0e-3, high: 1.0e-2, log: true}\ntrain.effective_batch_size: [2, 4]\n")
    out = tmp_path / "tune"
    args = ["--space", space, "--budget-tokens", "160", "-o", str(out), "--sampler", "random", "--pruner", "none"]
    items = [f"{k}={v}" for k, v in _base(dataset).items()]
    # First run: SIGTERM while the second trial runs; the first is kept, the second is marked interrupted.
    proc = subprocess.Popen([sys.executable, "-m", "tunebench", "tune", *items, *args, "--trials", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (out / "trials" / "trial-001" / "log.txt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # at once: the trial has just started, however fast this machine trains it
    # Past children.stop's 120 s grace, which a trial saving its checkpoint may take. The hang this wait once hid
    # was the search's own: Optuna's heartbeat thread left beating by a SIGTERM inside its start
    # (test_a_sigterm_as_the_heartbeat_starts_leaves_no_heartbeat_beating).
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stdout + stderr
    assert "rerun the same command to resume" in stderr
    assert [r["experiment"] for r in _rows(out / "results.csv")] == ["trial-0"]
    from tunebench.core import runlock

    # the trial's process is gone (its run directory's lock with it): stopped by the search, or, had the signal
    # landed while the search was starting it, by its own SIGTERM when the search died (die_with_parent)
    deadline = time.time() + 60
    while runlock.holder(out / "trials" / "trial-001") is not None and time.time() < deadline:
        time.sleep(0.2)
    assert runlock.holder(out / "trials" / "trial-001") is None

    # The same command again resumes: one trial done, one to run (the interrupted one does not count).
    overrides = dict(_base(dataset))
    summary = search.run(search.Search("train", None, overrides, space, 2, str(out), "random", "none", 160))
    assert summary["trials"] == 2
    rows = _rows(out / "results.csv")
    assert [r["experiment"] for r in rows] == ["trial-0", "trial-2"] and {r["status"] for r in rows} == {"ok"}
    import optuna

    study = optuna.load_study(study_name="tunebench", storage=f"sqlite:///{out / 'study.sqlite'}")
    interrupted, rerun_trial = study.trials[1], study.trials[2]
    assert interrupted.user_attrs["interrupted"] and rerun_trial.params == interrupted.params  # run again
    # Equal token budget: a trial at effective batch 2 runs twice the steps of one at 4, on the same rows.
    assert {int(r["samples"]) for r in rows} == {int(rows[0]["samples"])}
    again = search.run(search.Search("train", None, overrides, space, 2, str(out), "random", "none", 160))  # nothing left to do
    assert again["best_trial"] == summary["best_trial"] and not (out / "trials" / "trial-003").exists()
    assert (out / "report" / "report.html").is_file() and (out / "report" / "optimization_history.png").is_file()

    best = next(r for r in rows if r["experiment"] == f"trial-{summary['best_trial']}")
    assert float(best["eval_loss"]) == pytest.approx(summary["best_eval_loss"])
    cfg = load_config(summary["best_yaml"])  # runs as is
    assert cfg.output.output_dir == str(out / "best-run")
    rerun = finetune.run(cfg)
    assert rerun["eval_loss"] == pytest.approx(summary["best_eval_loss"], rel=1e-4)

    with pytest.raises(TunebenchError, match="another space"):  # same directory, another search
        search.run(search.Search("train", None, overrides, _space(tmp_path, "train.lr: [0.001, 0.002]\n"), 2, str(out)))


@pytest.mark.usefixtures("children_in_process")
def test_a_crashing_trial_is_recorded_as_failed_and_the_search_goes_on(tmp_path, dataset, capsys):
    out = tmp_path / "tune"
    base = dict(_base(dataset), **{"model.name": str(tmp_path / "no-such-model")})
    summary = search.run(search.Search("train", None, base, _space(tmp_path, "train.lr: [0.001, 0.002]\n"), 2, str(out), "random",
                         "none", max_steps=2))
    rows = _rows(out / "results.csv")
    assert [r["status"] for r in rows] == ["error", "error"] and "no-such-model" in rows[0]["message"]
    assert summary["trials"] == 2 and summary["best_yaml"] is None and not (out / "best.yaml").exists()
    assert "failed (error)" in capsys.readouterr().out
    # Every choice failing alike is a setting every trial shares: asked for more, the search says so
    # rather than running a failed choice again.
    with pytest.raises(TunebenchError, match="the last 2 trials all failed the same way"):
        search.run(search.Search("train", None, base, _space(tmp_path, "train.lr: [0.001, 0.002]\n"), 6, str(out), "random",
                   "none", max_steps=2))
    assert len(_rows(out / "results.csv")) == 2


def test_the_cli_refuses_a_budget_and_steps_together(tmp_path, capsys):
    from tunebench.interfaces.cli import main

    assert main(["tune", "--space", "customer_support_lora", "--budget-tokens", "10", "--max-steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tunebench: error: argument --max-steps: not allowed with argument --budget-tokens; see "
                   "`tunebench tune --help`"]  # the parser's own refusal, before anything loads
    with pytest.raises(TunebenchError, match="--budget-tokens and --max-steps both set a trial's length"):
        search.run(search.Search("train", None, {}, "customer_support_lora", 1, str(tmp_path / "t"), budget_tokens=10, max_steps=2))


def test_a_running_trials_evals_are_read_as_quarters_of_its_budget(tmp_path):
    """The pruner compares trials at the same share of their budget, whatever their step counts."""
    run = tmp_path / "trial"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"decisions": [{"setting": "total_steps", "value": 12}]}))
    lines = [{"step": 0, "eval_loss": 3.0}, {"step": 1, "loss": 2.9}, {"step": 3, "eval_loss": 2.5},
             {"step": 6, "eval_loss": 2.2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 9, "eval_l')
    found, seen = search.evals_of(run, 0)
    assert found == [(1, 2.5), (2, 2.2)] and seen == 4  # before training: not a point; a half-written line waits
    with (run / "metrics.jsonl").open("a") as f:
        f.write('oss": 2.0}\n')
    assert search.evals_of(run, seen) == ([(3, 2.0)], 5)


@pytest.mark.usefixtures("children_in_process")
def test_a_pretraining_search_writes_a_best_yaml_that_pretrain_runs(tmp_path):
    from tunebench.data import tokenizer_training as tokenizer
    from tunebench.jobs import pretrain
    from tunebench.settings import pretrain as pretrain_config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times.\n"
                              for i in range(400)))
    tokenizer.train([str(corpus)], 100, "char", tmp_path / "tok", quiet=True)
    base = {"data.train_file": str(corpus), "data.tokenizer": str(tmp_path / "tok"), "model.vocab_size": 100,
            "model.d_model": 32, "model.n_heads": 4, "model.n_layers": 1, "model.d_ff": 64, "model.max_seq_len": 32,
            "data.max_length": 32, "data.max_eval_blocks": 8, "training.batch_size": 2,
            "training.precision": "fp32"}
    space = _space(tmp_path, "training.learning_rate: {low: 1.0e-3, high: 1.0e-2, log: true}\n")
    summary = search.run(search.Search("pretrain", None, base, space, 2, str(tmp_path / "tune"), "random", "none",
                         budget_tokens=32 * 2 * 8))
    rows = _rows(tmp_path / "tune" / "results.csv")
    assert [r["status"] for r in rows] == ["ok", "ok"] and {r["steps"] for r in rows} == {"8"}
    assert {r["method"] for r in rows} == {"pretrain"} and int(rows[0]["trainable_params"]) > 0
    cfg = pretrain_config.load(summary["best_yaml"])
    assert cfg.output.output_dir == str(tmp_path / "tune" / "best-run")
    assert pretrain.run(cfg)["eval_loss"] == pytest.approx(summary["best_eval_loss"], rel=1e-4)


@pytest.mark.usefixtures("children_in_process")
def test_a_task_metric_objective_is_maximized_over_the_trials_answers(tmp_path, dataset, capsys):
    space = _space(tmp_path, "train.lr: [0.001, 0.01]\n")
    out = tmp_path / "tune"
    # bf16, forced: the answers come from 16-bit trials on every machine (emulated where the CPU lacks it)
    summary = search.run(search.Search("train", None, {**_base(dataset), "train.eval_max_new_tokens": 4, "train.precision": "bf16"},
                         space, 2, str(out), "random", "auto", max_steps=2, objective="rougeL"))
    said = capsys.readouterr().out
    assert "objective: rougeL of each trial's answers to 16 held-out rows (maximized); pruner none" in said
    rows = _rows(out / "results.csv")
    scores = {int(r["experiment"].split("-")[1]): figure(r, "rougeL") for r in rows}
    assert len(scores) == 2 and summary["best_rougeL"] == max(scores.values())
    assert scores[summary["best_trial"]] == max(scores.values())
    assert f"rougeL {summary['best_rougeL']:.4f}" in (out / "best.yaml").read_text()
    assert (out / "trials" / f"trial-{summary['best_trial']:03d}" / "eval_answers.jsonl").is_file()


@pytest.mark.parametrize("job,pruner,extra,message", [
    ("train", "median", {}, "--pruner median stops trials by their eval loss"),
    ("pretrain", "auto", {}, "`tune --job pretrain` runs do not have"),
    ("train", "auto", {"train.eval_generate": 0}, "eval_generate is 0"),
])
def test_a_task_objective_that_cannot_work_is_refused(tmp_path, dataset, job, pruner, extra, message):
    with pytest.raises(TunebenchError, match=re.escape(message)):
        search.run(search.Search(job, None, {**_base(dataset), **extra}, _space(tmp_path, "train.lr: [0.001]\n"), 1,
                   str(tmp_path / "t"), "random", pruner, max_steps=1, objective="rougeL"))
    assert not (tmp_path / "t").exists()


def test_the_median_pruner_stops_a_trial_worse_than_the_finished_ones_and_lets_a_better_one_run(tmp_path):
    """The study's own median pruner (as open_study builds it), fed a running trial's evals as _follow reads
    them: worse than the median of two finished trials at its first quarter, the trial's process is stopped
    (SIGTERM to its group, as a pruned run gets); better, it runs to its end."""
    study = search.open_study(tmp_path, None, "pruning", "random", "median", 0, "mark")
    for losses in ([2.0, 1.8, 1.6], [2.2, 2.0, 1.9]):  # two finished trials: evals at quarters 1, 2, 3
        done = study.ask()
        for quarter, loss in enumerate(losses, 1):
            done.report(loss, quarter)
        study.tell(done, losses[-1])

    def running(name, first_eval, seconds):
        run = tmp_path / name
        run.mkdir()
        (run / "plan.json").write_text(json.dumps({"decisions": [{"setting": "total_steps", "value": 12}]}))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_loss": 3.0}) + "\n"
                                           + json.dumps({"step": 3, "eval_loss": first_eval}) + "\n")
        return run, subprocess.Popen(["sleep", str(seconds)], start_new_session=True)

    run, proc = running("worse", 5.0, 120)
    try:
        seen, pruned = search._follow(proc, study.ask(), run)
    finally:
        proc.kill()
    assert pruned == (1, 5.0) and seen == 2 and proc.wait(5) == -signal.SIGTERM
    run, proc = running("better", 1.9, 2)
    seen, pruned = search._follow(proc, study.ask(), run)
    assert pruned is None and proc.returncode == 0


def test_a_sigterm_as_the_heartbeat_starts_leaves_no_heartbeat_beating(tmp_path, monkeypatch):
    """The moment a trial has started, its heartbeat thread starts. Optuna's was not a daemon and only its `with`
    stopped it: a SIGTERM raising inside its start left it beating, and the search printed its error and never
    exited (the interrupted-search test timed out so in CI, 2026-11-28). search.Heartbeat is a daemon, stopped
    whether or not its start was cut short; the trial's process is stopped too."""
    import threading

    from tunebench.jobs import children, compare

    study = search.open_study(tmp_path, None, "beat", "random", "none", 0, "mark")
    real = search.Heartbeat.start

    def start(self):
        real(self)
        os.kill(os.getpid(), signal.SIGTERM)  # as the test's interrupt lands: right as the trial has started

    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stopped = []
    monkeypatch.setattr(search.Heartbeat, "start", start)
    monkeypatch.setattr(compare, "start", lambda *a, **k: proc)
    monkeypatch.setattr(children, "stop", lambda p: stopped.append(p) or p.kill())
    previous = signal.signal(signal.SIGTERM, search._raise_interrupt)
    search.STOP.clear()
    earlier = set(threading.enumerate())  # this worker's other tests' threads are theirs to answer for
    try:
        with pytest.raises(KeyboardInterrupt):
            search.run_trial(study, study.ask(), "train", None, {}, [], tmp_path, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
        search.STOP.clear()
        proc.kill()
        proc.wait()
    left = [t for t in set(threading.enumerate()) - earlier if t.is_alive()]
    assert not left and stopped == [proc], left


def test_a_sigterm_python_swallowed_still_stops_the_trial(tmp_path):
    """SIGTERM's KeyboardInterrupt can land in a finalizer or an at-fork hook (logging's, while a trial's process
    starts), where Python prints "Exception ignored" and goes on: the search saw it run to the end with exit 0.
    The flag it leaves stops the trial at the next look."""
    search.STOP.clear()

    class Finalized:
        def __del__(self):
            search._raise_interrupt(signal.SIGTERM, None)

    Finalized()  # the raise is lost here, as in logging's _releaseLock

    class Running:
        def poll(self):
            return None

    try:
        with pytest.raises(KeyboardInterrupt):
            search._follow(Running(), None, tmp_path)
    finally:
        search.STOP.clear()
