"""Experiment trackers (machine/trackers.py): a run's settings with their reasons, every logged step, the summary
and its files land in TensorBoard, MLflow (a real server), W&B (offline) and Trackio, each read back with its own
reader; a resumed run continues the same tracker runs; a tracker that fails or stalls costs the run nothing."""

import csv
import json
import os
import threading

import pytest
import yaml

from conftest import free_port, needs_module, run_losses, sigterm_after_step, tiny_run_config, wandb_history
from tunebench.core.errors import TunebenchError
from tunebench.machine import trackers
from tunebench.settings import tracking


@pytest.mark.parametrize("given, want", [
    (["mlflow", "tensorboard"], "mlflow,tensorboard"), ("wandb, trackio", "wandb,trackio"), ("MLflow", "mlflow"),
    (["mlflow", "mlflow"], "mlflow"), ("none", "none"), ([], "none")])
def test_report_to_takes_hfs_list_and_a_comma_separated_string(given, want):
    assert tracking.parse(given) == want


@pytest.mark.parametrize("given, message", [
    ("comet", "comet: not one of tensorboard, mlflow, wandb, trackio"),
    ("all", "'all' would depend on what happens to be installed"),
    (["none", "mlflow"], "lists none beside trackers"), ([3], "give tracker names")])
def test_report_to_refuses_what_it_cannot_honour(given, message):
    with pytest.raises(TunebenchError, match=message):
        tracking.parse(given)


def test_the_cli_list_and_the_pretraining_yaml_list_reach_the_config(tmp_path):
    from tunebench.interfaces import cli, cli_parser
    from tunebench.settings import pretrain

    args = cli_parser.build_parser().parse_args(["train", "--report-to", "mlflow", "tensorboard", "--run-name", "r1",
                                                 "--project", "team"])
    lg = cli.train_config(args).logging
    assert (lg.report_to, lg.run_name, lg.project) == ("mlflow,tensorboard", "r1", "team")
    (tmp_path / "corpus.txt").write_text("text\n")
    config = tmp_path / "c.yaml"  # the CPU guide's section, HF's list
    config.write_text(yaml.safe_dump({"training": {"report_to": ["tensorboard", "trackio"], "run_name": "guide"},
                                      "data": {"train_file": str(tmp_path / "corpus.txt")}}))
    cfg = pretrain.load(str(config))
    assert (cfg.logging.report_to, cfg.logging.run_name) == ("tensorboard,trackio", "guide")


def test_a_missing_tracker_is_refused_with_its_install_line_before_anything_runs(tmp_path, monkeypatch, dataset,
                                                                                  capsys):
    from tunebench.interfaces.cli import main

    monkeypatch.setitem(tracking.TRACKER_MODULES, "mlflow", "tunebench_no_such_module")
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--data", str(dataset), "--output-dir", str(out),
                 "--report-to", "mlflow"]) == 2
    err = capsys.readouterr().err
    assert "--report-to mlflow needs the mlflow package: pip install 'tunebench[mlflow]'" in err
    assert "Traceback" not in err and not out.exists()


def test_wandb_without_a_login_is_refused_and_offline_mode_is_enough(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no ~/.config/wandb/settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TunebenchError, match="--report-to wandb needs a W&B login: run `wandb login`"):
        tracking.check("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    tracking.check("wandb")
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    (tmp_path / ".netrc").chmod(0o600)
    tracking.check("wandb")


def test_compare_and_tune_name_their_runs_as_one_experiment_unless_the_user_named_one(tmp_path):
    from tunebench.jobs import compare

    named = compare.tracked("train", None, {"model.name": "tiny", "logging.report_to": "mlflow"}, "study-a")
    assert (named["logging.project"], named["logging.group"]) == ("study-a", "study-a")
    named = compare.tracked("train", None, {"logging.project": "team"}, "study-a")
    assert (named["logging.project"], named["logging.group"]) == ("team", "study-a")
    config = tmp_path / "c.yaml"  # a tune config file's own project is kept (the settings override the file)
    config.write_text(yaml.safe_dump({"logging": {"project": "from-file", "group": "g"}}))
    named = compare.tracked("train", str(config), {}, "study-b")
    assert "logging.project" not in named and named["logging.group"] == "g"


class Recorder:
    """A tracker that records its calls; `gate` holds its metrics calls until set."""

    def __init__(self, fail_at: str | None = None, gate: threading.Event | None = None):
        self.calls, self.fail_at, self.gate = [], fail_at, gate

    def __getattr__(self, method):
        def call(*args):
            if self.gate is not None and method == "metrics":
                self.gate.wait(30)
            self.calls.append((method, args))
            if method == self.fail_at:
                raise ConnectionError("tracking server down")
            return "run-1" if method == "open" else None
        return call


def test_a_failing_tracker_warns_once_and_a_stalled_one_never_holds_up_the_loop_and_gets_its_rows_at_once(tmp_path, capsys):
    gate = threading.Event()
    failing, stalled, healthy = Recorder(fail_at="metrics"), Recorder(gate=gate), Recorder()
    made = {"failing": failing, "stalled": stalled, "healthy": healthy}
    tracking = trackers.Tracking(list(made), trackers.Where(tmp_path, "p", "r"),
                                 backends={name: (lambda b=b: b) for name, b in made.items()})
    tracking.start(trackers.Params({"settings/lr": "0.1"}, {}))
    for step in range(1, 6):
        tracking.log({"step": step, "loss": 1.0 / step, "note": "text is left out"})
    assert not [c for c in stalled.calls if c[0] == "metrics"]  # all five logged while it is held
    gate.set()
    with tracking:
        tracking.finish({"tokens_per_s": 10.0, "device": "cpu"}, {})
    assert capsys.readouterr().out.count("warning: tracking: failing stopped at its metrics call "
                                         "(ConnectionError: tracking server down)") == 1
    for recorder in (stalled, healthy):
        assert [row for c in recorder.calls if c[0] == "metrics" for row in c[1][0]] == \
            [(s, {"loss": 1.0 / s}) for s in range(1, 6)]
        assert ("summary", (5, {"tokens_per_s": 10.0})) in recorder.calls
        assert recorder.calls[-1] == ("close", ("FINISHED",))
    # the rows that queued while the stalled tracker was busy went to it in one call
    assert len([c for c in stalled.calls if c[0] == "metrics"]) <= 2
    assert [c[0] for c in failing.calls] == ["open", "metrics"]  # dropped after its failure
    assert json.loads((tmp_path / "trackers.json").read_text()) == {n: "run-1" for n in made}


def test_a_stopped_run_closes_its_trackers_as_killed_and_a_resume_reopens_the_same_ids(tmp_path):
    first = Recorder()
    with pytest.raises(KeyboardInterrupt):
        with trackers.Tracking(["mlflow"], trackers.Where(tmp_path, "p", "r"), backends={"mlflow": lambda: first}) as t:
            t.start(trackers.Params({}, {}))
            raise KeyboardInterrupt
    assert first.calls[0][1][1] is None and first.calls[-1] == ("close", ("KILLED",))
    again = Recorder()
    with trackers.Tracking(["mlflow"], trackers.Where(tmp_path, "p", "r"), resume=True,
                           backends={"mlflow": lambda: again}) as t:
        t.start(trackers.Params({}, {}))
    assert again.calls[0][1][1] == "run-1"  # open(where, resume_id, params)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_one_run_in_all_four_trackers_read_back_with_their_own_readers_and_resumed_into_the_same_runs(
        tmp_path, dataset, monkeypatch, mlflow_server, capfd):
    """A run stopped by SIGTERM at step 3 and resumed: MLflow (a real server), W&B (offline) and Trackio hold
    one run each with every step's loss equal to metrics.jsonl's, the settings with their reasons as parameters,
    the summary; MLflow and W&B hold the report and the adapter; TensorBoard's reader reads the same losses.
    MLflow's URI carries a login, which nothing printed shows (MLflow's own "View run ... at" lines included):
    MLflow is handed it apart from the URI."""
    for module in ("mlflow", "wandb", "trackio", "tensorboard"):
        needs_module(module, f"{module} is in the test extra: pip install -e '.[test]'")
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trackio.sqlite_storage import SQLiteStorage

    from tunebench.jobs import finetune

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.replace("://", "://ann:s3cret-pw@"))
    for moved in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # restored after the test
        monkeypatch.setenv(moved, "")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    options = {"logging.report_to": ["tensorboard", "mlflow", "wandb", "trackio"], "logging.project": "tb-test",
               "evaluation.eval_steps": 3, "hardware.precision": "fp32"}
    with sigterm_after_step(3), pytest.raises(TunebenchError, match="interrupted at step 3"):
        finetune.run(tiny_run_config(dataset, out, **options))
    ids = json.loads((out / "trackers.json").read_text())
    plan = json.loads((out / "plan.json").read_text())  # the first run's decisions, which the trackers keep
    finetune.run(tiny_run_config(dataset, out, **options, **{"output.resume": "auto"}))
    assert json.loads((out / "trackers.json").read_text()) == ids  # the same runs, continued
    printed = "".join(capfd.readouterr())
    assert "View run run at" in printed and "s3cret-pw" not in printed and "ann:" not in printed
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_URI"]) == ("ann", mlflow_server)
    rows = _rows(out)
    losses = run_losses(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    resumed_plan = {r["setting"]: r["reason"] for r in json.loads((out / "plan.json").read_text())["decisions"]}
    summary = json.loads((out / "summary.json").read_text())

    client = MlflowClient(mlflow_server)
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "tb-test"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == pytest.approx(losses)
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval_loss")} == pytest.approx(evals)
    params = run.data.params
    for row in plan["decisions"]:
        assert params[f"settings/{row['setting']}/reason"] == row["reason"][:6000]
    assert params["settings/micro_batch_size"] == "2" and params["config/model.name"] == "tiny"
    # what the resume decided differently is beside it, as a tag
    assert run.data.tags["resumed/settings/micro_batch_size/reason"] == resumed_plan["micro_batch_size"] != \
        params["settings/micro_batch_size/reason"]
    assert params["machine/cpu_model"] == plan["hardware"]["cpu_model"]
    assert run.data.metrics["summary/tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
    assert summary["tracking_ms_per_step/mlflow"] > 0
    stored = {a.path for top in ("run", "report", "model") for a in client.list_artifacts(run.info.run_id, top)}
    assert {"run/summary.json", "report/report.html", "model/adapter_model.safetensors"} <= stored

    history, records = wandb_history(out, ids["wandb"])
    assert {s: r["loss"] for s, r in history.items() if "loss" in r} == pytest.approx(losses)
    assert {s: r["eval_loss"] for s, r in history.items() if "eval_loss" in r} == pytest.approx(evals)
    [config] = [json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "run"
                for u in r.run.config.update if u.key == "settings"][:1]
    assert config["micro_batch_size"] == {"value": 2, "reason": "asked for"}
    artifacts = {r.artifact.type for r in records if r.WhichOneof("record_type") == "artifact"}
    assert artifacts == {"run", "report", "model"}

    logs = SQLiteStorage.get_logs("tb-test", ids["trackio"])
    assert {r["step"]: r["loss"] for r in logs if "loss" in r} == pytest.approx(losses)
    # Trackio's config is the latest one's (MLflow's parameters cannot change: the resume's are its tags)
    assert SQLiteStorage.get_run_config("tb-test", ids["trackio"])["settings"]["micro_batch_size"]["reason"] == \
        resumed_plan["micro_batch_size"]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(losses)
    assert {e.step: e.value for e in events.Scalars("eval/eval_loss")} == pytest.approx(evals)


def test_a_compare_is_one_mlflow_experiment_its_runs_sortable_by_tokens_per_s(tmp_path, dataset, monkeypatch,
                                                                               mlflow_server):
    needs_module("mlflow", "mlflow is in the test extra: pip install -e '.[test]'")
    from mlflow import MlflowClient

    from tunebench.jobs import compare

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({
        "base": {"model.name": "tiny", "data.path": str(dataset), "data.max_length": 64, "schedule.max_steps": 2,
                 "hardware.precision": "fp32", "data.eval_fraction": 0.2, "logging.report_to": "mlflow"},
        "experiments": [{"name": "bs1", "set": {"batch.micro_batch_size": 1, "batch.grad_accum_steps": 4}},
                        {"name": "bs2", "set": {"batch.micro_batch_size": 2, "batch.grad_accum_steps": 2}}]}))
    results = compare.run(str(matrix), str(tmp_path / "cmp-a" / "results.csv"), str(tmp_path / "cmp-a" / "runs"), 1,
                          {}, devices=["cpu"])
    rows = {r["experiment"]: r for r in csv.DictReader(results.open())}
    assert {r["status"] for r in rows.values()} == {"ok"}
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("cmp-a")
    runs = client.search_runs([experiment.experiment_id], order_by=["metrics.`summary/tokens_per_s` DESC"])
    assert sorted(r.info.run_name for r in runs) == ["bs1-cpu-r1", "bs2-cpu-r1"]
    speeds = [r.data.metrics["summary/tokens_per_s"] for r in runs]
    assert speeds == sorted(speeds, reverse=True)
    for r in runs:
        name = r.info.run_name.split("-")[0]
        assert r.data.metrics["summary/tokens_per_s"] == pytest.approx(float(rows[name]["tokens_per_s"]))
        assert r.data.tags["group"] == "cmp-a"
        assert r.data.params["settings/micro_batch_size"] == name[2:]
        assert r.data.params["settings/grad_accum_steps/reason"].startswith("effective batch 4")


def test_a_tracking_server_that_is_down_costs_the_run_nothing(tmp_path, dataset, monkeypatch, capsys):
    """MLflow pointed at a port nothing listens on: one warning, the run finishes, metrics.jsonl and summary whole."""

    needs_module("mlflow", "mlflow is in the test extra: pip install -e '.[test]'")
    from tunebench.jobs import finetune

    port = free_port()  # nothing listens there, and no other worker's server will
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}/?token=s3cret-tok")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    out = tmp_path / "run"
    summary = finetune.run(tiny_run_config(dataset, out, **{"logging.report_to": "mlflow"}))
    printed = capsys.readouterr().out
    assert printed.count("warning: tracking: mlflow stopped at its open call") == 1
    assert "s3cret-tok" not in printed and "token=***" in printed  # MLflow's exception names the URI it failed on
    assert sorted(run_losses(out)) == [1, 2, 3, 4, 5, 6] and summary["steps"] == 6
    assert "tracking_ms_per_step/mlflow" not in summary  # a dropped tracker reports no cost
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
