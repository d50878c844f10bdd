"""serve's studio (interfaces/web/studio.py): data previewed as training reads it, the settings with their reasons,
one training child at a time with a visible queue, stop and resume; and a real browser going from a CSV to an
exported GGUF through the Train and Runs tabs."""

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import needs_module
from tunebench.core.errors import TunebenchError

needs_module("gradio", "the web app needs gradio (pip install -e '.[web]')")

from tunebench.interfaces.web import studio  # noqa: E402
from tunebench.interfaces.web import studio_views as views
from tunebench.settings.finetune import load_config

ARTIFACTS = Path(os.environ.get("TUNEBENCH_ARTIFACTS", "test-artifacts")) / "studio"


def _csv(path: Path, rows: int = 40, empty: int = 0) -> Path:
    lines = ["instruction,response"] + [f"What is {i} plus one?,It is {i + 1}." for i in range(rows)]
    lines += ["Why?," for _ in range(empty)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_preview_shows_the_format_columns_counts_and_the_loss_marked(tmp_path):
    shown = studio.preview(str(_csv(tmp_path / "d.csv", 5, empty=2)), "tiny", max_length=40)
    assert (shown.fmt, shown.columns) == ("instruction", {"prompt": "instruction", "response": "response"})
    assert (shown.rows, shown.kept, shown.dropped) == (7, 5, {"empty prompt or response": 2})
    # the tiny preset's tokenizer is one token per byte: "What is 0 plus one?" and its prompt format pass 40
    assert shown.over_max_length == 5 and len(shown.examples) == studio.SHOWN_EXAMPLES
    first = shown.examples[0]
    assert first.index("What is 0 plus one?") < first.index("<mark>It is 1.")  # the prompt, then the loss part
    assert "What is 0" not in first[first.index("<mark>"):]
    assert "dropped 2 (2 empty prompt or response)" in shown.markdown()


def test_bad_data_and_bad_settings_get_the_clis_one_line_errors(tmp_path):
    (tmp_path / "bad.csv").write_text("question_text,reply\nhi,there\n")
    with pytest.raises(TunebenchError, match="cannot tell the dataset format from its columns"):
        studio.preview(str(tmp_path / "bad.csv"), "tiny")
    data = str(_csv(tmp_path / "d.csv"))
    with pytest.raises(TunebenchError, match="run name"):
        studio.check(studio.Ask(data, "../escape", "tiny"), tmp_path / "runs")
    with pytest.raises(TunebenchError, match="not both"):
        studio.check(studio.Ask(data, "r", "tiny", max_steps=3, epochs=1), tmp_path / "runs")
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    with pytest.raises(TunebenchError, match="already exists"):
        studio.check(studio.Ask(data, "taken", "tiny"), tmp_path / "runs")
    with pytest.raises(TunebenchError, match="effective"):  # the CLI's own check of the value
        studio.check(studio.Ask(data, "r", "tiny", effective_batch=-3), tmp_path / "runs")


def test_the_server_checks_a_sample_of_an_upload_and_counts_its_rows_without_loading_it(tmp_path, monkeypatch):
    """The web process reads at most CHECK_ROWS rows of an upload (here a bad row past them is the training
    child's to refuse, in its log), counts the rest as a stream, and still refuses too few rows in one line."""
    from tunebench.data import readers

    monkeypatch.setattr(studio, "CHECK_ROWS", 50)
    big = _csv(tmp_path / "big.csv", rows=300)
    big.write_text(big.read_text() + "only one field\n")  # row 301: a field short
    loaded = []
    real = readers.read_records
    monkeypatch.setattr(readers, "read_records", lambda spec, limit=None: loaded.append(limit) or real(spec, limit))
    cfg = studio.check(studio.Ask(str(big), "big", "tiny"), tmp_path / "runs")
    assert cfg.data.path == str(big) and loaded == [50]
    assert readers.count_records(str(big)) == 301
    with pytest.raises(TunebenchError, match="leaves 5 training row"):  # 6 rows, one held out: under a batch of 8
        studio.check(studio.Ask(str(_csv(tmp_path / "small.csv", rows=6)), "small", "tiny"), tmp_path / "runs")


def test_the_settings_table_says_what_was_asked_what_is_picked_and_what_will_be_measured(tmp_path):
    ask = studio.Ask(str(_csv(tmp_path / "d.csv")), "r", "tiny", effective_batch=4, max_steps=7)
    rows = {r[0]: r[1:] for r in studio.settings_rows(ask, studio.check(ask, tmp_path / "runs"))}
    assert rows["effective_batch_size"] == ["4", "asked on this page"] and rows["length"][0] == "7 steps"
    assert rows["micro_batch_size"][0] == "measured at start" and "1, 2, 4" in rows["micro_batch_size"][1]
    assert {"device", "precision", "torch_threads"} <= set(rows)  # the hardware plan's rows, with reasons
    assert all(reason for _, reason in rows.values())


FAKE_TRAIN = """
import json, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1]).parent  # the run's directory: it is started on RUN/asked.yaml
(out / "config.yaml").write_text("model: {name: tiny}\\n")
stopped = []
signal.signal(signal.SIGTERM, lambda *a: stopped.append(1))
with open(out / "metrics.jsonl", "a") as f:
    for step in range(1, 400):
        f.write(json.dumps({"step": step, "loss": 1.0 / step, "tokens_per_s": 100.0}) + "\\n"); f.flush()
        if stopped:
            (out / "checkpoints" / "step-1").mkdir(parents=True, exist_ok=True)
            sys.exit(130)
        time.sleep(float(open(out.parent / "pace").read()))
(out / "summary.json").write_text(json.dumps({  # the fields every tunebench summary has
    "device": "cpu", "precision": "fp32", "steps": step, "samples": 4 * step, "tokens": 100 * step,
    "duration_s": 1.0, "train_time_s": 1.0, "tokens_per_s": 100.0, "samples_per_s": 4.0, "peak_memory_mb": 1.0,
    "mfu": None, "peak_tflops_source": "stand-in", "final_train_loss": 1.0 / step, "eval_loss": 0.5,
    "micro_batch_size": 4, "grad_accum_steps": 1, "effective_batch_size": 4, "max_length": 128, "method": "lora"}))
"""


def _fake_studio(tmp_path, pace: str):
    """A studio whose runs are FAKE_TRAIN (seconds per step in RUNS/pace), and its runs directory."""
    fake = tmp_path / "tunebench_fake_train.py"
    fake.write_text(FAKE_TRAIN)
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "pace").write_text(pace)
    s = studio.Studio(runs)
    s.program = [sys.executable, str(fake)]
    return s, runs


def test_one_run_at_a_time_a_second_waits_in_the_queue_and_stop_keeps_a_resumable_checkpoint(tmp_path):
    """With a stand-in for `tunebench train` (the queue's logic, not training: that is the browser test's)."""
    s, runs = _fake_studio(tmp_path, "0.05")
    data = str(_csv(tmp_path / "d.csv"))
    assert s.start(studio.Ask(data, "first", "tiny")) == "first: starting"
    assert s.start(studio.Ask(data, "second", "tiny")) == "second: queued, 1 run ahead"
    with pytest.raises(TunebenchError, match="'second' is already queued"):  # no directory yet, but taken
        s.start(studio.Ask(data, "second", "tiny"))
    deadline = time.monotonic() + 30
    while len(views.loss_points(runs / "first")) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s.state("first") == "running" and s.state("second") == "queued"
    assert s.queue_text() == "Training: **first**; waiting: second"
    assert not (runs / "second").exists()  # it has not started beside the first
    restarted = studio.Studio(runs)  # a server started again while the run trains: it sees the run, and waits
    assert restarted.state("first") == "running (started by an earlier server)"
    assert restarted.queue_text() == "Training: **first**"
    # a run asked of the restarted server waits behind the one an earlier server left training, never beside it
    assert restarted.start(studio.Ask(data, "third", "tiny")) == "third: queued, 1 run ahead"
    restarted._step()
    assert restarted.state("third") == "queued" and not (runs / "third").exists()
    with restarted._lock:  # taken back: this test goes on with the first server's queue alone
        restarted.queue.clear()
    assert restarted.stop("first") == "first: stopping (SIGTERM); it saves a checkpoint first, and Resume continues " \
                                      "from it"
    assert s.wait("first", 30) == 130 and s.state("first") == "stopped (checkpoint kept)"
    (runs / "pace").write_text("0")
    assert s.wait("second", 60) == 0 and s.state("second") == "finished"
    assert s.resume("first") == "first: starting"
    assert s.wait("first", 60) == 0 and s.state("first") == "finished"
    asked = load_config(str(runs / "first" / "asked.yaml"))  # the run's own config.yaml, resumed as from a terminal
    assert asked.output.resume == "auto" and asked.output.output_dir == str(runs / "first")
    assert f"$ tunebench train {runs / 'first' / 'asked.yaml'}" in s.log_tail("first")
    table = {r[0]: r for r in views.runs_table(s)}
    assert table["second"][1] == "finished" and table["second"][5] == "0.500"
    with pytest.raises(TunebenchError, match="has finished"):
        s.resume("first")
    with pytest.raises(TunebenchError, match="is not running"):
        s.stop("first")


def test_an_upload_while_a_run_is_queued_is_kept_and_the_queued_runs_upload_survives_pruning(tmp_path):
    """Uploads are pruned by what the queue and the runs use: a queued run's data must survive, a stale unused one
    goes, and a new upload is taken whatever the queue holds."""
    s = studio.Studio(tmp_path / "runs")
    queued = s.keep_upload(str(_csv(tmp_path / "queued.csv")))
    stale = s.keep_upload(str(_csv(tmp_path / "stale.csv", rows=41)))
    job = studio.Job("waiting", studio.check(studio.Ask(queued, "waiting", "tiny"), s.runs_dir), tmp_path / "w.log")
    with s._lock:  # a run training (not started here: no process) and one queued behind it
        s.current, s.queue = job, [studio.Job("next", job.cfg, tmp_path / "n.log")]
    old = time.time() - studio.UPLOAD_GRACE_S - 60
    for kept in (queued, stale):
        os.utime(kept, (old, old))
    mask = os.umask(0o022)  # a common umask: files 0644 unless made otherwise
    try:
        fresh = s.keep_upload(str(_csv(tmp_path / "fresh.csv", rows=42)))
    finally:
        os.umask(mask)
    assert Path(fresh).is_file() and Path(queued).is_file()
    assert not Path(stale).exists()  # unused and past its grace time
    # a visitor's data readable by the server's user alone, whatever the umask (round five)
    assert (os.stat(fresh).st_mode & 0o777, os.stat(s.uploads).st_mode & 0o777) == (0o600, 0o700)


def test_a_start_that_raises_is_recorded_as_failed_and_the_queue_goes_on(tmp_path, monkeypatch):
    """Whatever a start raises (here a config that cannot be written), the run ends as failed with the reason in
    its log, and the run queued behind it starts: the queue never wedges on a start."""
    s, _ = _fake_studio(tmp_path, "0")
    real = studio.children.start

    def start(job, cfg, run, **kw):
        if run.name == "broken":
            raise ValueError("cannot represent an object")
        return real(job, cfg, run, **kw)

    monkeypatch.setattr(studio.children, "start", start)
    data = str(_csv(tmp_path / "d.csv"))
    s.start(studio.Ask(data, "broken", "tiny"))
    s.start(studio.Ask(data, "after", "tiny"))
    assert s.wait("broken", 30) == 127 and "could not start the run: ValueError" in s.log_tail("broken")
    assert s.wait("after", 60) == 0


def test_loss_points_skip_a_half_written_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n"
                                            + json.dumps({"step": 0, "eval_loss": 3.0}) + "\n{\"step\": 2, \"lo")
    got = views.loss_points(tmp_path)
    assert got == [{"step": 1, "value": 2.0, "series": "train loss"},
                   {"step": 0, "value": 3.0, "series": "eval loss"}]


def test_dpo_from_votes_queues_a_dpo_run_on_the_votes_from_the_runs_base(tmp_path):
    from tunebench.data import votes

    runs = tmp_path / "runs"
    (runs / "tuned").mkdir(parents=True)
    (runs / "tuned" / "config.json").write_text("{}")  # a whole model (a full fine-tune): DPO starts from it
    (runs / "tuned" / "summary.json").write_text("{}")
    s = studio.Studio(runs)
    s.program = [sys.executable, "-c", "import sys; print(sys.argv)"]
    db = votes.open_store(tmp_path / "ab.sqlite")
    with pytest.raises(TunebenchError, match="no A or B votes yet"):
        views.dpo_from_votes(s, "tuned", db)
    votes.record(db, "p", "base: tiny", "run: tuned", "answer a", "answer b", "a", {"temperature": 0.7})
    with pytest.raises(TunebenchError, match="fewer than one effective batch of 8"):  # the CLI's own check
        views.dpo_from_votes(s, "tuned", db)
    for i in range(10):
        votes.record(db, f"p{i}", "base: tiny", "run: tuned", f"answer a{i}", f"answer b{i}", "b", {})
    said = views.dpo_from_votes(s, "tuned", db)
    name = said.split(":")[0]
    assert name.startswith("tuned-dpo-") and s.wait(name, 30) == 0
    asked = load_config(str(runs / name / "asked.yaml"))  # what the child started from: values, not an argv
    assert (asked.data.path, asked.model.name, asked.adapter.method) == (str(db), str(runs / "tuned"), "lora")
    assert asked.objective.name == "dpo" and str(runs / name / "asked.yaml") in s.log_tail(name)


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> Path:
    """A tiny random Llama on a trained byte-level BPE tokenizer: small enough to train in seconds, and a
    tokenizer GGUF can hold (the `tiny` preset's one token per byte has no merges)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tunebench.data import tokenizer_training as tokenizer

    root = tmp_path_factory.mktemp("bpe")
    (root / "corpus.txt").write_text("\n".join(f"What is {i} plus one? It is {i + 1}. The order ships in "
                                               f"{i % 5 + 1} days." for i in range(300)))
    tokenizer.train([str(root / "corpus.txt")], 300, "bpe", root / "tok", quiet=True)
    tok = AutoTokenizer.from_pretrained(root / "tok")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model"


STEPS = 200  # the run is paused once it has logged a few steps (_paused_after), so Stop always lands mid-way


def _paused_after(runs: Path, name: str, steps: int, limit_s: float = 240.0) -> int:
    """The studio's run `name` paused (SIGSTOP to its process group) as soon as its metrics.jsonl holds `steps` train
    losses, read every 10 ms: a Stop clicked from the page then reaches it mid-way whatever the machine's speed
    (1,500 steps at ~100 a second used to race the page's clicks). Its pid, for the SIGCONT."""
    pidfile, metrics = runs / ".studio" / f"{name}.pid", runs / name / "metrics.jsonl"
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if pidfile.is_file() and metrics.is_file():
            if sum('"loss"' in line for line in metrics.read_text().splitlines()) >= steps:
                pid = json.loads(pidfile.read_text())["pid"]
                os.killpg(pid, signal.SIGSTOP)
                return pid
        time.sleep(0.01)
    pytest.fail(f"{name} logged no {steps} steps within {limit_s:g} s")


def test_a_browser_goes_from_a_csv_to_an_exported_gguf_and_a_blind_comparison(tmp_path, bpe_model, chromium):
    """The issue's whole path on the page: upload a CSV, see its examples and the settings table, start a run,
    see its chart gain points, stop it, resume it to the end, export a GGUF, compare it blind against its
    base and vote, and chat with it; a screenshot of each tab kept under $TUNEBENCH_ARTIFACTS/studio."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from conftest import free_port
    from test_serve import _browser
    from tunebench.data import votes
    from tunebench.interfaces.web import app

    shots = tmp_path / "shots"  # this run's own: stale pictures kept from an earlier run cannot pass the checks
    shots.mkdir()
    runs, db, port = tmp_path / "runs", tmp_path / "ab.sqlite", free_port()
    served = app.serve(app.Served([str(bpe_model)], []), app.Door(port=port, no_auth=True), ab_db=str(db), block=False, runs_dir=str(runs))
    browser = _browser(chromium)
    wait, slow = WebDriverWait(browser, 60), WebDriverWait(browser, 240)

    def body():
        return browser.find_element(By.TAG_NAME, "body").text

    def tab(name):
        wait.until(lambda d: any(b.text.strip() == name for b in d.find_elements(By.CSS_SELECTOR, "button[role=tab]")))
        next(b for b in browser.find_elements(By.CSS_SELECTOR, "button[role=tab]") if b.text.strip() == name).click()
        time.sleep(1)

    def button(text):
        return wait.until(ec.element_to_be_clickable(
            (By.XPATH, f"//button[normalize-space()='{text}' and not(@role='tab')]")))

    def field(elem_id, value):
        box = browser.find_element(By.CSS_SELECTOR, f"#{elem_id} input, #{elem_id} textarea")
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(str(value) + Keys.TAB)

    def points():
        found = browser.find_element(By.ID, "tb-points").text.split(" train-loss points")[0].split()
        return int(found[-1]) if found and found[-1].isdigit() else 0

    def shot(name, at=None):
        if at is not None:  # scrolled to what the picture is of
            browser.execute_script("arguments[0].scrollIntoView({block: 'start'})", browser.find_element(By.ID, at))
            time.sleep(0.5)
        browser.save_screenshot(str(shots / f"{name}.png"))

    try:
        browser.get(f"http://127.0.0.1:{port}/")
        tab("Train")
        data = _csv(tmp_path / "support.csv")
        browser.find_element(By.CSS_SELECTOR, "#tb-upload input[type=file]").send_keys(str(data))
        wait.until(lambda d: "instruction** format" in d.find_element(By.ID, "tb-data-info").get_attribute(
            "innerHTML") or "instruction</strong> format" in d.find_element(By.ID, "tb-data-info").get_attribute(
            "innerHTML"))
        assert "Kept 40, dropped 0" in body()
        shot("train-data")
        marked = browser.find_elements(By.CSS_SELECTOR, "#tb-examples mark")
        assert len(marked) == studio.SHOWN_EXAMPLES and marked[0].text.startswith("It is 1.")
        field("tb-steps", STEPS)
        field("tb-name", "support")
        button("Show the settings").click()
        wait.until(lambda d: "measured at start" in body() and "asked on this page" in body())
        button("Start training").click()
        wait.until(lambda d: "support: starting" in body())
        paused = _paused_after(runs, "support", 3)
        slow.until(lambda d: points() >= 3)  # redrawn every 2 s as metrics.jsonl grows
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#tb-loss img"))  # the loss chart, drawn
        seen = points()
        shot("train-settings", "tb-settings")
        shot("train-live", "tb-state")
        button("Stop (checkpoint kept)").click()
        wait.until(lambda d: "support: stopping (SIGTERM)" in body())  # sent, and waiting on the paused run
        os.killpg(paused, signal.SIGCONT)
        slow.until(lambda d: "support: stopped (checkpoint kept)" in body())
        stopped_at = points()
        assert seen <= stopped_at < STEPS
        button("Resume").click()
        slow.until(lambda d: "support: finished" in body())
        wait.until(lambda d: points() == STEPS)  # one loss point a step, none lost or repeated over the stop
        shot("train-finished", "tb-state")

        tab("Runs")
        button("Refresh").click()
        wait.until(lambda d: "support" in d.find_element(By.ID, "tb-runs").text)
        picked = browser.find_element(By.CSS_SELECTOR, "#tb-picked input")
        picked.click()
        picked.send_keys("support" + Keys.ENTER)
        wait.until(lambda d: "loss" in d.find_element(By.ID, "tb-report").text)  # its report, drawn now
        assert browser.find_elements(By.CSS_SELECTOR, "#tb-report img")
        button("Export").click()
        slow.until(lambda d: "Exported support (gguf, q8_0)" in body())
        gguf = runs / "support" / "export" / "support-q8_0.gguf"
        assert gguf.is_file() and str(gguf) in body()
        shot("runs")

        button("A/B it").click()  # against its base, the default
        wait.until(lambda d: "Which answer is better?" not in body() and "Get answers" in body())
        prompt = browser.find_element(By.CSS_SELECTOR, "textarea[placeholder^='Type a prompt']")
        prompt.send_keys("What is 3 plus one?")
        button("Get answers").click()
        wait.until(lambda d: "Which answer is better?" in d.page_source)
        button("A is better").click()
        wait.until(lambda d: "Vote #1 stored" in d.page_source)
        shot("ab")
        tab("Runs")
        button("Chat with it").click()
        chat = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, "textarea[placeholder^='Ask something']")))
        chat.send_keys("What is 5 plus one?" + Keys.ENTER)
        wait.until(lambda d: "tokens/s" in body())
        shot("chat")
    finally:
        browser.quit()
        served.close()
    (pair,) = votes.pairs(db)
    assert {pair.first, pair.second} == {f"base: {bpe_model}", f"run: {runs / 'support'} (lora)"}
    assert json.loads((runs / "support" / "summary.json").read_text())["steps"] == STEPS
    for name in ("train-settings", "train-live", "train-finished", "runs", "ab", "chat"):
        assert (shots / f"{name}.png").stat().st_size > 10_000
    ARTIFACTS.mkdir(parents=True, exist_ok=True)  # kept for people to look at, once checked
    for picture in shots.glob("*.png"):
        shutil.copyfile(picture, ARTIFACTS / picture.name)


def test_a_run_on_two_processes_is_checked_at_two_ranks_trains_on_both_and_resumes_on_both(tmp_path):
    """The Train tab's processes: the settings checked at that many ranks (a batch they cannot share is refused),
    the run launched on them, and Resume on as many as it started on."""
    from conftest import pairs_file

    pairs = str(pairs_file(tmp_path))  # DPO: what a studio user trains from the A/B tab's votes
    with pytest.raises(TunebenchError, match=r"--effective-batch-size 3 is not a multiple of 2 rank"):
        studio.check(studio.Ask(pairs, "odd", "tiny", "dpo", effective_batch=3, processes=2), tmp_path / "runs")
    with pytest.raises(TunebenchError, match="processes 0 is out of this page's range"):
        studio.check(studio.Ask(pairs, "none", "tiny", "dpo", processes=0), tmp_path / "runs")
    cores = len(os.sched_getaffinity(0))  # each rank a core at most: more would only thrash a shared server
    with pytest.raises(TunebenchError, match=f"processes {cores + 1}: this server has {cores} core"):
        studio.check(studio.Ask(pairs, "many", "tiny", "dpo", processes=cores + 1), tmp_path / "runs")
    ask = studio.Ask(pairs, "ranks", "tiny", "dpo", effective_batch=4, max_steps=2, processes=2)
    rows = {r[0]: r for r in studio.settings_rows(ask, studio.check(ask, tmp_path / "runs"))}
    assert rows["processes"][1] == "2" and "(the divisors of 2)" in rows["micro_batch_size"][2]
    s = studio.Studio(tmp_path / "runs")
    assert s.start(ask) == "ranks: starting"
    assert s.wait("ranks", 120) == 0, s.log_tail("ranks")
    run = tmp_path / "runs" / "ranks"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["objective"] == "dpo"
    (run / "summary.json").unlink()  # as a run stopped after its last checkpoint leaves it
    assert s.resume("ranks") == "ranks: starting"
    assert s.wait("ranks", 120) == 0, s.log_tail("ranks")
    assert "continuing from" in s.log_tail("ranks", 200)
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2


def test_a_preference_upload_is_checked_on_a_sample_and_a_sqlite_upload_is_never_opened(tmp_path, monkeypatch):
    """DPO on an upload: the web process reads CHECK_ROWS rows of it through the pairs' reader, as SFT's; an
    upload that is a SQLite file (here named x.jsonl) is refused at upload, never opened as a vote store."""
    import sqlite3

    from tunebench.data import pairs, readers

    monkeypatch.setattr(studio, "CHECK_ROWS", 50)
    big = tmp_path / "pairs.jsonl"
    big.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) + "\n"
                           for i in range(300)) + "not json\n")
    loaded = []
    real = readers.read_records
    monkeypatch.setattr(readers, "read_records", lambda spec, limit=None: loaded.append(limit) or real(spec, limit))
    cfg = studio.check(studio.Ask(str(big), "dpo-run", "tiny", method="dpo"), tmp_path / "runs")
    assert cfg.objective.name == "dpo" and loaded == [50]
    db = tmp_path / "x.jsonl"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE votes (id INTEGER PRIMARY KEY, model_a, model_b, vote)")
    monkeypatch.setattr(pairs, "from_store", lambda path: pytest.fail("an upload was opened as a vote store"))
    s = studio.Studio(tmp_path / "runs")
    with pytest.raises(TunebenchError, match="x.jsonl is a SQLite file; upload data as CSV, JSON, JSONL or Parquet"):
        s.keep_upload(str(db))
    assert not s.uploads.exists() or not any(s.uploads.iterdir())
