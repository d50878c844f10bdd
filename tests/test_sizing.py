"""compare's time budget: a matrix sized to this machine by a measured training row, the auto row
compared like with like."""

import csv
import json

import pytest

from conftest import ROWS
from tunebench.core.errors import TunebenchError
from tunebench.jobs import compare, report, sizing


def _matrix(tmp_path, dataset, budget="budget: {train_seconds: 100}\n", base_extra=""):
    m = tmp_path / "m.yaml"
    m.write_text(f"""{budget}base:
  model.name: tiny
  data.path: {dataset}
  data.max_length: 64
  train.effective_batch_size: 4
{base_extra}experiments:
  - {{name: auto, set: {{train.micro_batch_size: auto}}}}
  - {{name: bs1_ga4, set: {{train.micro_batch_size: 1, train.grad_accum_steps: 4}}}}
""")
    return m


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_rows_follow_the_measured_speed_and_the_floor(tmp_path, monkeypatch, dataset):
    monkeypatch.setattr(sizing, "measure_row", lambda settings, device: (0.5, 80.0, 1000))
    base = {"model.name": "tiny", "data.path": dataset, "train.effective_batch_size": 8}
    s = sizing.size(base, 100, 4, "cpu", tmp_path / "a.json")
    # 100 s / 4 runs / 0.5 s a row = 50 rows -> 48 to train (whole steps of 8) -> 51 with the 5% held out
    assert s.max_samples == 51 and "0.50 s a row" in s.reason and "4 run(s)" in s.reason
    assert json.loads((tmp_path / "a.json").read_text())["max_samples"] == 51
    tight = sizing.size(base, 10, 4, "cpu", tmp_path / "b.json")  # 5 rows: raised to 4 steps of 8
    assert tight.max_samples == 34 and "4 optimizer steps" in tight.reason
    monkeypatch.setattr(sizing, "measure_row", lambda settings, device: (0.5, 80.0, 40))
    small = sizing.size(base, 100, 4, "cpu", tmp_path / "c.json")
    assert small.max_samples == 40 and "all 40 rows of the data fit" in small.reason


@pytest.mark.usefixtures("children_in_process")
def test_compare_sizes_every_run_alike_and_resumes_with_the_same_rows(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(ROWS[i % len(ROWS)]) + "\n" for i in range(80)))
    calls = []
    monkeypatch.setattr(sizing, "measure_row", lambda settings, device: calls.append(device) or (1.0, 40.0, 80))
    out = tmp_path / "results.csv"
    matrix = _matrix(tmp_path, data, budget="budget: {train_seconds: 60}\n")
    compare.run(str(matrix), str(out), str(tmp_path / "runs"), 1, {})
    # 60 s / 2 runs / 1 s a row = 30 rows -> 28 to train (whole steps of 4) -> 30 with the held-out 5%
    assert "data.max_samples 30:" in capsys.readouterr().out
    rows = _rows(out)
    assert {r["status"] for r in rows} == {"ok"} and len(rows) == 2
    assert len({r["samples"] for r in rows}) == 1 and 24 <= int(rows[0]["samples"]) <= 30  # every run alike
    for r in rows:  # the seconds each run spent measuring, as its own summary records them
        summary = json.loads((tmp_path / "runs" / f"{r['experiment']}-cpu-r1" / "summary.json").read_text())
        assert float(r["measure_seconds"]) == pytest.approx(summary["measure_s"], abs=1e-3)
    by = {r["experiment"]: float(r["measure_seconds"]) for r in rows}
    assert by["auto"] > 0  # the micro batch was measured
    record = out.with_name("results.sizing.json")
    assert json.loads(record.read_text())["max_samples"] == 30 and calls == ["cpu"]

    # An interrupted comparison goes on with the rows it began with, without measuring again.
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=compare.SCHEMA)
        w.writeheader()
        w.writerows(r for r in rows if r["experiment"] == "auto")
    compare.run(str(matrix), str(out), str(tmp_path / "runs"), 1, {})
    assert "as when these results began" in capsys.readouterr().out and calls == ["cpu"]
    assert len({r["samples"] for r in _rows(out)}) == 1

    # --max-samples sets the rows itself: nothing is measured.
    monkeypatch.setattr(sizing, "measure_row", lambda *a: pytest.fail("measured despite --max-samples"))
    one = tmp_path / "one.yaml"
    one.write_text(matrix.read_text().split("  - {name: bs1_ga4")[0])
    compare.run(str(one), str(tmp_path / "other.csv"), str(tmp_path / "runs2"), 1, {"data.max_samples": 12})
    assert {r["status"] for r in _rows(tmp_path / "other.csv")} == {"ok"}


def test_a_bad_budget_is_refused_before_anything_runs(tmp_path, dataset):
    with pytest.raises(TunebenchError, match="budget must be"):
        compare.load_matrix(str(_matrix(tmp_path, dataset, budget="budget: 60\n")))
    with pytest.raises(TunebenchError, match="budget must be"):
        compare.load_matrix(str(_matrix(tmp_path, dataset, budget="budget: {train_seconds: 0}\n")))
    with pytest.raises(TunebenchError, match="drop one of them"):
        compare.load_matrix(str(_matrix(tmp_path, dataset, base_extra="  data.max_samples: 40\n")))


def test_measure_row_times_the_runs_own_model(dataset):
    seconds, tokens, rows = sizing.measure_row({"model.name": "tiny", "data.path": dataset, "data.max_length": 64},
                                               "cpu")
    assert seconds > 0 and 1 < tokens <= 64 and rows == len(ROWS)  # no bound on the seconds: a loaded machine is slow


def _row(name, micro, accum, seconds, measured, predicted=""):
    return {"experiment": name, "config": name, "device": "cpu", "device_name": "CPU", "batch_size": micro,
            "grad_accum": accum, "duration_seconds": seconds, "measure_seconds": measured, "status": "ok",
            "tokens_per_s": 100, "repeat": 1, "predicted_seconds": predicted}


def test_the_auto_finding_compares_training_with_training(tmp_path):
    path = tmp_path / "r.csv"
    rows = [_row("auto", 2, 4, 50, 30, 40), _row("bs1_ga8", 1, 8, 80, 4), _row("bs2_ga4", 2, 4, 52, 1),
            _row("bs4_ga2", 4, 2, 45, 1, 45)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (finding,) = [f for f in report.build([str(path)])["findings"] if "tunebench auto" in f]
    assert "auto trained in 50 s against 45 s for the best hand-picked configuration (bs4_ga2): 0.90x" in finding
    assert "Against bs2_ga4, the hand-picked run with auto's micro batch (2 x 4): 52 s, 1.04x" in finding
    assert "auto spent 30 s measuring" in finding and "the hand-picked runs 1 to 4 s" in finding
    assert "Counting each run's measuring, auto took 80 s against bs4_ga2's 46 s: 0.57x." in finding
    assert "Their plans said auto 40 s (took 1.25x that), bs4_ga2 45 s (took 1.00x that)." in finding
