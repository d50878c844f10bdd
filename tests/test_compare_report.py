import csv
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tunebench.core.errors import TunebenchError
from tunebench.jobs import compare, report
from tunebench.model import quality

STUDY = Path(compare.__file__).resolve().parents[1] / "examples" / "study_results.csv"


EXPERIMENTS = """experiments:
  - {name: bs2_ga2, set: {train.micro_batch_size: 2, train.grad_accum_steps: 2}}
  - {name: gpu_only, devices: [cuda], set: {train.micro_batch_size: 4}}
"""


def _matrix(tmp_path, dataset, extra="", experiments=EXPERIMENTS):
    m = tmp_path / "m.yaml"
    m.write_text(f"""base:
  model.name: tiny
  data.path: {dataset}
  data.max_length: 256
  train.max_steps: 2
  train.effective_batch_size: 4
  train.eval_generate: 2
  train.eval_max_new_tokens: 4
  train.precision: fp32
{experiments}{extra}""")
    return m


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_results_file_of_an_earlier_layout_resumes_in_todays(tmp_path, capsys):
    """A release that adds columns (the tool-call scores) rewrites an earlier file in its layout, the new cells
    empty, so `./run compare` resumes across the upgrade; a file with a column today's has not is refused."""
    old = [k for k in compare.SCHEMA if k not in quality.TOOL_SCORES]
    path = tmp_path / "results.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old)
        w.writeheader()
        w.writerow({k: "" for k in old} | {"experiment": "auto", "device": "cpu", "repeat": "1", "status": "ok",
                                           "rougeL": "41.5"})
    assert compare.read_done(path) == {("auto", "cpu", 1)}
    (row,) = _rows(path)
    assert list(row) == compare.SCHEMA and row["rougeL"] == "41.5" and row["tool_args"] == ""
    assert "rewritten with this release's 4 new column(s), empty for its 1 earlier row(s)" in capsys.readouterr().out
    path.write_text("experiment,device,repeat,status,a_column_we_never_wrote\n")
    with pytest.raises(TunebenchError, match="another column layout"):
        compare.read_done(path)


@pytest.mark.usefixtures("children_in_process")
def test_compare_writes_the_schema_records_failures_and_resumes(tmp_path, dataset, capsys):
    matrix = _matrix(tmp_path, dataset, "  - {name: broken, set: {model.name: ./no/such/model}}\n")
    out = tmp_path / "results.csv"
    compare.run(str(matrix), str(out), str(tmp_path / "runs"), 1, {})
    rows = _rows(out)
    assert list(rows[0]) == compare.SCHEMA
    by = {r["experiment"]: r for r in rows}
    import torch

    # gpu_only runs where CUDA is (a GPU machine's run of the suite), and is skipped here otherwise
    assert set(by) == {"bs2_ga2", "broken", *(["gpu_only"] if torch.cuda.is_available() else [])}
    ok = by["bs2_ga2"]
    assert ok["status"] == "ok" and ok["device"] == "cpu" and ok["batch_size"] == "2" and ok["grad_accum"] == "2"
    assert ok["precision"] == "fp32"
    for key in ("duration_seconds", "tokens_per_s", "peak_memory_mb", "eval_loss", "final_train_loss", "steps"):
        assert float(ok[key]) > 0, key
    assert float(ok["eos_rate"]) in (0, 50, 100) and 0 <= float(ok["rougeL"]) <= 100 and ok["exact_match"] == ""
    # the scores are those of the answers the run wrote down, recomputed here with the libraries themselves
    import sacrebleu
    from rouge_score import rouge_scorer

    lines = (tmp_path / "runs" / "bs2_ga2-cpu-r1" / "eval_answers.jsonl").read_text().splitlines()
    answers = [json.loads(line) for line in lines[1:]]
    hyps, refs = [a["answer"] for a in answers], [a["reference"] for a in answers]
    assert float(ok["chrf"]) == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=0.01)
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge = 100 * sum(scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(hyps, refs)) / len(answers)
    assert float(ok["rougeL"]) == pytest.approx(rouge, abs=0.01)
    assert by["broken"]["status"] == "error" and "not a HF directory" in by["broken"]["message"]
    assert "[2/2]" in capsys.readouterr().out

    compare.run(str(matrix), str(out), str(tmp_path / "runs"), 1, {})  # nothing left to do
    assert len(_rows(out)) == 2
    assert "2 already in" in capsys.readouterr().out
    compare.run(str(matrix), str(out), str(tmp_path / "runs"), 2, {})  # a second repeat of each
    assert sorted((r["experiment"], r["repeat"]) for r in _rows(out)) == [
        ("broken", "1"), ("broken", "2"), ("bs2_ga2", "1"), ("bs2_ga2", "2")]
    compare.run(str(matrix), str(out), str(tmp_path / "runs"), 1, {}, retry_failed=True)  # only the error reruns
    assert sorted((r["experiment"], r["repeat"], r["status"]) for r in _rows(out))[:3] == [
        ("broken", "1", "error"), ("broken", "1", "error"), ("broken", "2", "error")]
    assert len(_rows(out)) == 5
    assert all(ok[k] == "" for k in quality.TOOL_SCORES)  # these rows offer no tools
    # A run whose held-out rows offer tools has its tool scores in summary.json (quality.score): they reach the
    # results row and the report's table, and the report's quality axis is the exact-arguments rate.
    run_dir = tmp_path / "runs" / "bs2_ga2-cpu-r1"
    summary = json.loads((run_dir / "summary.json").read_text())
    tools = {"tool_name": 100.0, "tool_args": 87.5, "tool_schema": 100.0, "tool_decision": 95.0}
    (run_dir / "summary.json").write_text(json.dumps(summary | tools))
    row = compare._row_from_run(run_dir, "cpu") | {"experiment": "tools", "config": "tools", "repeat": 1,
                                                     "device": "cpu", "status": "ok"}
    assert {k: row[k] for k in tools} == tools
    compare.append_row(tmp_path / "tools.csv", row)
    built = report.build([str(tmp_path / "tools.csv")])
    assert report.quality_points(built["cells"])[:2] == ("tool_args", quality.LABELS["tool_args"])


@pytest.mark.usefixtures("children_in_process")
def test_compare_reports_task_metrics_for_each_precision(tmp_path, dataset):
    """compare's children, one per 16-bit precision forced (emulated where the CPU lacks it), each scored on
    its held-out rows (the other tests' matrix forces fp32)."""
    out = tmp_path / "results.csv"
    compare.run(str(_matrix(tmp_path, dataset, experiments="grid:\n  train.precision: [bf16, fp16]\n")),
                str(out), str(tmp_path / "runs"), 1, {"train.micro_batch_size": 2})
    rows = {r["precision"]: r for r in _rows(out)}
    assert set(rows) == {"bf16", "fp16"}
    for precision, row in rows.items():
        assert row["status"] == "ok", (precision, row["message"])
        assert row["rougeL"] != "" and 0 <= float(row["rougeL"]) <= 100, (precision, row)


def test_oom_is_recorded_as_oom():
    status, message = compare._failure("Traceback...\ntorch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB\n")
    assert status == "oom" and "out of memory" in message
    assert compare._failure("tunebench: error: bad thing")[0] == "error"


def test_matrix_is_checked_before_anything_runs(tmp_path, dataset):
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiments:\n  - {name: x, set: {train.bach_size: 2}}\n")
    with pytest.raises(TunebenchError, match="experiment 'x'.*did you mean 'batch.micro_batch_size'"):
        compare.load_matrix(str(bad))
    grid = tmp_path / "grid.yaml"
    grid.write_text("grid:\n  train.micro_batch_size: [1, 2]\n  train.precision: [fp32, bf16]\n")
    names = [e.name for e in compare.load_matrix(str(grid))[1]]
    assert names == ["micro_batch_size=1_precision=fp32", "micro_batch_size=1_precision=bf16",
                     "micro_batch_size=2_precision=fp32", "micro_batch_size=2_precision=bf16"]
    for shipped in ("quick", "study"):
        base, experiments = compare.load_matrix(shipped)
        assert any(e.name == "auto" for e in experiments)


@pytest.mark.usefixtures("children_in_process")
def test_number_of_processes_is_a_matrix_dimension(tmp_path, dataset):
    grid = tmp_path / "grid.yaml"
    grid.write_text("grid:\n  train.micro_batch_size: [2]\n  nproc: [1, 2]\n"
                    "experiments:\n  - {name: pair, nproc: 2, set: {train.micro_batch_size: 1}}\n")
    experiments = compare.load_matrix(str(grid))[1]
    assert [(e.name, e.nproc, e.overrides) for e in experiments] == [
        ("pair", 2, {"batch.micro_batch_size": 1}),
        ("micro_batch_size=2_nproc=1", 1, {"batch.micro_batch_size": 2}),
        ("micro_batch_size=2_nproc=2", 2, {"batch.micro_batch_size": 2})]
    grid.write_text("experiments:\n  - {name: x, nproc: 0}\n")
    with pytest.raises(TunebenchError, match="nproc must be a whole number"):
        compare.load_matrix(str(grid))

    # --nproc 2 runs each experiment on 2 ranks (tunebench launch) and records it.
    out = tmp_path / "results.csv"
    # The matrix's effective batch 4 with micro 2 x accumulation 2 agrees on one process, not on 2 ranks (8):
    # refused before anything runs, where it used to train at 8 without a word.
    with pytest.raises(TunebenchError, match=r"experiment 'bs2_ga2_np2'.*x 2 ranks != --effective-batch-size 4"):
        compare.run(str(_matrix(tmp_path, dataset)), str(out), str(tmp_path / "runs"), 1, {}, nproc=[2])
    assert not out.exists()
    # bf16, forced: 16-bit autocast over 2 ranks, with task metrics, on every machine
    compare.run(str(_matrix(tmp_path, dataset)), str(out), str(tmp_path / "runs"), 1,
                {"train.precision": "bf16", "train.effective_batch_size": 8}, nproc=[2])
    (row,) = _rows(out)
    assert row["experiment"] == "bs2_ga2_np2" and row["status"] == "ok", row["message"]
    assert row["precision"] == "bf16" and row["rougeL"] != "", row
    assert row["processes"] == "2" and row["effective_batch"] == "8"  # --grad-accum 2 as asked, x 2 ranks


@pytest.mark.usefixtures("children_in_process")
def test_foreign_csv_is_not_appended_to(tmp_path, dataset):
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(TunebenchError, match="another column layout"):
        compare.run(str(_matrix(tmp_path, dataset)), str(other), str(tmp_path / "runs"), 1, {})
    assert other.read_text() == "a,b\n1,2\n"


def test_study_csv_reproduces_the_published_means_and_speedups():
    r = report.build([str(STUDY)], baseline_device="CPU 32-core")
    means = {d: s["mean_duration_s"] for d, s in r["stats"].items()}
    assert means == pytest.approx({"CPU 8-core": 1132.333, "CPU 32-core": 730.0, "GTX 1080 Ti": 644.5,
                                   "RTX 3070": 807.25, "RTX 3080": 623.5}, abs=0.01)  # not the prose's 633 s
    assert r["stats"]["RTX 3080"]["fastest"] == ("bs8_ga1", 312.0)
    assert r["stats"]["CPU 8-core"]["slowest"] == ("bs1_ga8", 1857.0)
    assert r["stats"]["CPU 8-core"]["fastest"] == ("bs4_ga2", 572.0)
    assert r["device_speedups"]["RTX 3080"] == pytest.approx(730.0 / 623.5)
    assert r["config_speedups"]["RTX 3080"]["bs8_ga1"] == pytest.approx(1170 / 312)
    assert any("RTX 3080 has the lowest mean duration (623.5 s)" in f for f in r["findings"])
    # the study's central table: each device's configuration against the baseline device's
    across = {(a["device"], a["config"]): a for a in r["across_devices"]}
    assert across[("RTX 3080", "bs4_ga2")]["vs_same_config"] == pytest.approx(373 / 374)
    assert across[("RTX 3080", "bs8_ga1")]["vs_same_config"] is None  # no CPU ran micro batch 8
    assert across[("RTX 3080", "bs8_ga1")]["vs_baseline"] == pytest.approx(1180 / 312)
    assert across[("CPU 32-core", "bs1_ga8")]["vs_baseline"] == pytest.approx(1.0) and len(across) == 18


def test_report_combines_two_csvs_and_writes_html_and_md(tmp_path):
    second = tmp_path / "second.csv"
    rows = _rows(STUDY)
    with second.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for row in rows[:3]:
            w.writerow(dict(row, device_name="Laptop", duration_seconds=str(float(row["duration_seconds"]) * 2)))
    html = report.write([str(STUDY), str(second)], str(tmp_path / "rep"))
    text = html.read_text()
    assert "Laptop" in text and "RTX 3080" in text and text.count("<img") >= 2
    assert "data:image/png;base64," in text  # self-contained
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| Laptop | 3 | 2,264.67 |" in md and (tmp_path / "rep" / "duration.png").is_file()
    assert "## Each configuration on each device, against Laptop" in md  # the slowest device is the baseline
    assert "| RTX 3080 | bs8_ga1 | 312.0 |  |  | 11.90x |" in md  # 3,714 s on the Laptop at bs1_ga8


def test_report_errors():
    with pytest.raises(TunebenchError, match="not found"):
        report.read_results(["/nonexistent.csv"])
    with pytest.raises(TunebenchError, match="not in the results"):
        report.build([str(STUDY)], baseline_device="TPU")


def test_html_report_renders_its_charts_in_headless_chromium(tmp_path, chromium):
    html = report.write([str(STUDY)], str(tmp_path / "rep"))
    browser = chromium[0]
    js = ("[...document.images].filter(i => i.complete && i.naturalWidth > 100).length + ' images ok; ' + "
          "document.querySelectorAll('table').length + ' tables'")
    page = tmp_path / "probe.html"
    page.write_text(html.read_text().replace("</body>", f"<script>document.title = {js};</script></body>"))
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                           "--virtual-time-budget=3000", page.as_uri()], capture_output=True, text=True, timeout=120)
    title = proc.stdout.split("<title>")[1].split("</title>")[0]
    n_images = int(title.split(" images ok")[0])
    assert n_images == len(report.charts(report.build([str(STUDY)]))) >= 2 and "4 tables" in title


def test_a_rerun_goes_on_from_the_checkpoint_an_interrupted_experiment_left(tmp_path, monkeypatch):
    """An interrupted compare said "stopped with a checkpoint", and the rerun forced --overwrite, which deleted
    it: the experiment began again at step 0. A run directory holding a checkpoint is now resumed."""
    started = []
    monkeypatch.setattr(compare.subprocess, "Popen", lambda argv, **kw: started.append(argv))
    fresh, stopped = tmp_path / "fresh", tmp_path / "stopped"
    (stopped / "checkpoints" / "step-00000003").mkdir(parents=True)
    for run_dir in (fresh, stopped):
        compare.start("train", {"model.name": "tiny"}, run_dir)
    asked = {d.name: yaml.safe_load((d / "asked.yaml").read_text())["output"] for d in (fresh, stopped)}
    assert asked["stopped"]["resume"] == "auto" and asked["fresh"]["resume"] is None
    assert asked["stopped"]["overwrite"] and len(started) == 2


def test_resume_auto_with_overwrite_replaces_a_checkpoint_of_other_settings(tmp_path, capsys):
    import torch

    from tunebench.training import checkpoint
    from tunebench.training.loop import LoopState

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.save(tmp_path / "checkpoints", model, opt, sched, LoopState(step=3), {"seed": 1}, keep=1)
    with pytest.raises(TunebenchError, match="seed"):
        checkpoint.resume_point("auto", tmp_path, {"seed": 2})  # refused, as before, without --overwrite
    assert checkpoint.resume_point("auto", tmp_path, {"seed": 1}, overwrite=True).name == "step-00000003"
    assert checkpoint.resume_point("auto", tmp_path, {"seed": 2}, overwrite=True) is None
    assert "made with other settings; starting over" in capsys.readouterr().out
    assert not (tmp_path / "checkpoints").exists()


def test_a_run_report_names_charts_only_from_what_a_gpu_monitor_writes(tmp_path):
    """monitor.jsonl is a file in the run directory: a key that is no gpuN does not become a chart (its name is a
    file name and an HTML id, so one holding quotes or a path wrote both raw), and a real gpuN one does."""
    from tunebench.jobs import run_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0 / s, "lr": 1e-3, "tokens_per_s": 100.0 * s}) + "\n"
                                               for s in range(1, 4)))
    evil = "gpu'><img src=x onerror=alert(1)>/../../owned"
    (run / "monitor.jsonl").write_text("".join(json.dumps({
        "time": float(t), "cpu_percent": 50.0, f"{evil}_util_percent": 1.0, "gpu0_util_percent": 80.0,
        "gpu0_memory_mb": 100.0}) + "\n" for t in range(3)))
    page = run_report.write(run).read_text()
    assert "onerror" not in page and "id='gpu0'" in page
    assert sorted(p.name for p in (run / "report").glob("*.png")) == ["cpu.png", "gpu0.png", "learning_rate.png",
                                                                        "loss.png", "memory.png", "tokens_per_s.png"]
    assert not list(tmp_path.rglob("owned*"))


@pytest.mark.parametrize("objective, own", [("kto", {"kto.png"}), ("sft", set()), (None, set())])
def test_a_run_reports_own_charts_are_its_objectives_not_what_its_metrics_look_like(tmp_path, objective, own):
    """Issue 97: the report worked out the objective from metric names ("desirable" in a record meant KTO). It draws
    the charts the run's objective type names (config.yaml's objective; none for a run that names none): the same
    records under an SFT config draw no KTO chart."""
    from tunebench.jobs import run_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({
        "step": s, "loss": 1.0 / s, "lr": 1e-3, "tokens_per_s": 10.0, "kl": 0.1 * s, "rewards/chosen": 0.2 * s,
        "rewards/rejected": -0.1 * s, "desirable": 2.0}) + "\n" for s in range(1, 4)))
    if objective:
        (run / "config.yaml").write_text(yaml.safe_dump({"objective": {"name": objective}}))
    run_report.write(run)
    drawn = {p.name for p in (run / "report").glob("*.png")} - {"cpu.png", "memory.png"}
    assert drawn == {"loss.png", "learning_rate.png", "tokens_per_s.png"} | own
