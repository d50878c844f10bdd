"""Nothing lost, nothing trusted that should not be: checkpoints load without pickle, writes survive a
kill or a power loss, and torn files are repaired or skipped rather than crashed on."""

import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_losses, tiny_run_config
from tunebench.core import durable
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import read_jsonl
from tunebench.jobs import compare, finetune
from tunebench.jobs.parts import measuring
from tunebench.machine.metrics import MetricsWriter
from tunebench.training import checkpoint


def test_rng_states_round_trip_as_tensors_and_numbers():
    state = checkpoint._rng_state()
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    checkpoint._set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws
    allowed = (torch.Tensor, int, float, str, list, dict, type(None))

    def plain(x):
        return isinstance(x, allowed) and all(plain(v) for v in (x.values() if isinstance(x, dict) else
                                                               x if isinstance(x, list) else []))
    assert plain(state)


def test_a_checkpoint_carrying_a_pickled_object_is_refused(tmp_path, dataset):
    out = tmp_path / "run"
    finetune.run(tiny_run_config(dataset, out, **{"train.max_steps": 2, "train.save_steps": 1}))
    newest = checkpoint.list_checkpoints(out / "checkpoints")[-1]
    blob = torch.load(newest / checkpoint.TENSORS, weights_only=True)  # ours load without pickle
    blob["payload"] = __import__("argparse").Namespace(cmd="touch /tmp/pwned")  # any object = code on load
    torch.save(blob, newest / checkpoint.TENSORS)
    with pytest.raises(TunebenchError, match="holds pickled Python objects"):
        finetune.run(tiny_run_config(dataset, out, **{"train.max_steps": 3, "train.resume": str(newest)}))


def test_files_follow_the_umask(tmp_path, dataset):
    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        finetune.run(tiny_run_config(dataset, out, **{"train.max_steps": 1}))
    finally:
        os.umask(old)
    for path in (out / "summary.json", out / "plan.json", out / "config.yaml",
                 *checkpoint.list_checkpoints(out / "checkpoints")[-1].iterdir()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE(checkpoint.list_checkpoints(out / "checkpoints")[-1].stat().st_mode) == 0o755


def test_resume_skips_a_damaged_newest_checkpoint_and_stale_temp_dirs(tmp_path, dataset, capsys):
    extra = {"train.max_steps": 6, "train.save_steps": 1, "train.save_total_limit": 3}
    straight = tmp_path / "straight"
    finetune.run(tiny_run_config(dataset, straight, **extra))
    cut = tmp_path / "cut"
    finetune.run(tiny_run_config(dataset, cut, **extra))
    step4, step5, step6 = checkpoint.list_checkpoints(cut / "checkpoints")
    __import__("shutil").rmtree(step6)  # as if the run had died after step 5's save
    tensors = step5 / checkpoint.TENSORS
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])  # a power loss mid-write
    stale = cut / "checkpoints" / ".tmp-killed"
    stale.mkdir()
    (stale / checkpoint.TENSORS).write_bytes(b"\0" * 1024)
    capsys.readouterr()
    finetune.run(tiny_run_config(dataset, cut, **{**extra, "train.resume": "auto"}))
    said = capsys.readouterr().out
    assert f"resume: skipping {step5.name}: its {checkpoint.TENSORS} is truncated" in said
    assert f"continuing from {step4}" in said and not stale.exists()
    assert run_losses(cut)[5] == run_losses(straight)[5] and run_losses(cut)[6] == run_losses(straight)[6]


def test_a_kill_storm_during_checkpoint_writes_still_resumes_exactly(tmp_path, dataset):
    """Kill -9 a run that checkpoints every step, three times at different moments, resuming each time,
    then truncate the newest checkpoint: the run still ends with the straight run's losses."""
    args = ["--model", "tiny", "--data", str(dataset), "--max-length", "256", "--batch-size", "2",
            "--effective-batch-size", "4", "--lr", "1e-2", "--eval-fraction", "0.2", "--save-steps", "1",
            "--max-steps", "24", "--compile", "off", "--attention", "sdpa", "--no-progress", "train.save_total_limit=3"]

    def train(out, *more):
        return subprocess.Popen([sys.executable, "-m", "tunebench", "train", *args, "--output-dir", str(out), *more],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    straight = tmp_path / "straight"
    assert train(straight).wait(300) == 0
    out = tmp_path / "stormy"
    rng = random.Random(3)
    def newest(ckpts) -> int:
        found = checkpoint.list_checkpoints(ckpts)
        return int(found[-1].name.split("-")[-1]) if found else -1

    for attempt in range(3):
        ckpts = out / "checkpoints"
        before = newest(ckpts)
        proc = train(out, *(["--resume", "auto"] if attempt else []))
        end = time.monotonic() + 120
        # one to three saves of this attempt's own, so the kill lands while it trains and saves (not while Python
        # starts, nor after the run's end), then a moment into the next step or its save: counted in saves, not
        # seconds, so a fast machine does not finish the run between kills
        target = before + rng.randint(1, 3)
        while time.monotonic() < end and newest(ckpts) < target and proc.poll() is None:
            time.sleep(0.01)
        assert newest(ckpts) >= target, f"attempt {attempt} made no checkpoint {target} of its own"
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, f"attempt {attempt} ended before its kill: the storm missed it"
    newest = checkpoint.list_checkpoints(out / "checkpoints")[-1]
    (newest / checkpoint.TENSORS).write_bytes((newest / checkpoint.TENSORS).read_bytes()[:100])
    final = train(out, "--resume", "auto")
    assert final.wait(300) == 0, final.stderr.read()[-2000:]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert run_losses(out) == run_losses(straight)


def test_a_corrupt_tokenized_cache_is_recomputed(tmp_path, dataset, capsys):
    from tunebench.data.tokenize import load_tokenized
    from tunebench.model import models
    from tunebench.settings.finetune import load_config

    cfg = load_config(options={"data.path": str(dataset), "data.max_length": 64}).data
    tok = models.byte_tokenizer()
    first = load_tokenized(cfg, tok, tmp_path)
    (cache,) = (tmp_path / "tokenized").glob("*.npz")
    cache.write_bytes(cache.read_bytes()[:40])
    again = load_tokenized(cfg, tok, tmp_path)
    assert "does not load" in capsys.readouterr().out
    assert np.array_equal(again.ids, first.ids) and len(list((tmp_path / "tokenized").iterdir())) == 1
    assert np.array_equal(load_tokenized(cfg, tok, tmp_path).ids, first.ids)  # the rewritten cache loads


def test_a_torn_results_row_is_cut_before_the_next_and_skipped_when_read(tmp_path, capsys):
    path = tmp_path / "results.csv"
    row = {"experiment": "a", "device": "cpu", "repeat": 1, "status": "ok"}
    compare.append_row(path, row)
    with path.open("a") as f:
        f.write("b,b,1,cpu,Intel")  # a kill mid-row
    compare.append_row(path, {**row, "experiment": "c"})
    assert compare.read_done(path) == {("a", "cpu", 1), ("c", "cpu", 1)}
    with path.open("a") as f:
        f.write("d,d,x,cpu" + "," * (len(compare.SCHEMA) - 4) + "\n")  # a whole line, but not a row
    assert compare.read_done(path) == {("a", "cpu", 1), ("c", "cpu", 1)}
    assert "skipped 1 damaged row(s)" in capsys.readouterr().out


def test_a_torn_metrics_line_is_repaired_on_append_and_skipped_when_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + '{"step": 2, "lo')
    assert read_jsonl(path) == ([{"step": 1, "loss": 2.0}], 1)
    writer = MetricsWriter(path)
    writer({"step": 2, "loss": 1.5})
    writer.close()
    assert read_jsonl(path) == ([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], 0)


def test_repair_tail_cuts_only_a_partial_last_line(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a\nb\n")
    assert not durable.repair_tail(path) and path.read_text() == "a\nb\n"
    path.write_text("a\nb\nc")
    assert durable.repair_tail(path) and path.read_text() == "a\nb\n"
    path.write_text("no newline at all")
    assert durable.repair_tail(path) and path.read_text() == ""


def test_a_kill_while_a_directory_is_replaced_loses_neither_copy(tmp_path, monkeypatch):
    """Re-saving a step deleted the old directory before renaming the new one in: a kill in between lost it,
    and the next start's clean-up deleted the complete new copy too."""
    target = tmp_path / "step-00000006"
    with durable.atomic_dir(target) as tmp:
        (tmp / "state.json").write_text("old")
    real_replace = os.replace

    def killed_after_setting_aside(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise KeyboardInterrupt  # the kill: the old copy is aside, the new one not yet in place
        real_replace(src, dst)

    monkeypatch.setattr(durable.os, "replace", killed_after_setting_aside)
    with pytest.raises(KeyboardInterrupt), durable.atomic_dir(target) as tmp:
        (tmp / "state.json").write_text("new")
    monkeypatch.setattr(durable.os, "replace", real_replace)
    assert not target.exists() and (tmp_path / ".old-step-00000006").is_dir()
    durable.clean_stale(tmp_path)
    assert (target / "state.json").read_text() == "old" and not list(tmp_path.glob(".old-*"))


def test_final_files_are_replaced_whole_or_not_at_all(tmp_path):
    """The final adapter, model and tokenizer were written in place: a kill mid-save left a truncated file."""
    (tmp_path / "adapter_model.safetensors").write_text("old")
    with pytest.raises(KeyboardInterrupt), durable.atomic_files(tmp_path) as tmp:
        (tmp / "adapter_model.safetensors").write_text("half of the ne")
        raise KeyboardInterrupt
    assert (tmp_path / "adapter_model.safetensors").read_text() == "old" and not list(tmp_path.glob(".tmp-*"))
    with durable.atomic_files(tmp_path) as tmp:
        (tmp / "adapter_model.safetensors").write_text("new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x.json").write_text("{}")
    assert (tmp_path / "adapter_model.safetensors").read_text() == "new" and (tmp_path / "sub" / "x.json").is_file()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_measuring_says_nothing_was_trained_and_leaves_the_directory_free(tmp_path, dataset, signum,
                                                                                        monkeypatch):
    """SIGTERM (or Ctrl-C) during the measuring phase, before the loop's own handling: one line that says so,
    exit 130 as a stopped run, no checkpoint, and the run directory's lock let go."""
    from tunebench.core import runlock

    real = measuring.decide

    def measure(*args, **kwargs):
        os.kill(os.getpid(), signum)  # delivered between bytecodes, inside the measuring
        return real(*args, **kwargs)

    monkeypatch.setattr(measuring, "decide", measure)
    before = signal.getsignal(signal.SIGTERM)  # what the process had (another test may have left torch's own)
    out = tmp_path / "run"
    with pytest.raises(TunebenchError) as stopped:
        finetune.run(tiny_run_config(dataset, out, **{"batch.micro_batch_size": "auto"}))
    name = signal.Signals(signum).name
    assert stopped.value.exit_code == 130 and str(stopped.value) == (
        f"{name} before the first training step (loading or measuring): nothing was trained and no checkpoint "
        "written; start the run again to train")
    assert runlock.holder(out) is None and not (out / "checkpoints").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the job's own handling ends with it


def test_writes_into_a_run_directory_refuse_a_planted_symbolic_link(tmp_path):
    """A link in a shared run directory (the lock file, a report chart, the studio's pid and owner files, a run's
    log) must not turn our write into a write of the file it points at."""
    from tunebench.core import runlock
    from tunebench.core.durable import open_no_follow

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / runlock.LOCK).symlink_to(victim)
    with pytest.raises(TunebenchError, match="cannot take the lock .* symbolic link"):
        runlock.hold(run)
    (run / "loss.png").symlink_to(victim)
    for mode in ("wb", "a"):
        with pytest.raises(TunebenchError, match="loss.png' is a symbolic link"):
            open_no_follow(run / "loss.png", mode)
    assert victim.read_text() == "keep me"
    with open_no_follow(run / "plain.txt", "a") as f:
        f.write("one\n")
    with open_no_follow(run / "plain.txt", "a") as f:
        f.write("two\n")
    assert (run / "plain.txt").read_text() == "one\ntwo\n"


def test_a_runs_metrics_monitor_and_results_refuse_a_planted_link_and_leave_its_target_whole(tmp_path):
    """metrics.jsonl, monitor.jsonl, compare's results.csv: appended to, and their torn tail cut first; a link
    planted at any of them is refused in one line, and the file it points at keeps every byte (cutting "its" tail
    would have cut the target's last line)."""
    from tunebench.core.durable import repair_tail
    from tunebench.jobs import compare
    from tunebench.machine.metrics import MetricsWriter
    from tunebench.machine.monitor import Monitor

    victim = tmp_path / "victim.txt"
    victim.write_text("line one\nno newline at the end")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "monitor.jsonl", "results.csv"):
        (run / name).symlink_to(victim)
    with pytest.raises(TunebenchError, match="metrics.jsonl' is a symbolic link"):
        MetricsWriter(run / "metrics.jsonl")
    with pytest.raises(TunebenchError, match="monitor.jsonl' is a symbolic link"):
        Monitor(run / "monitor.jsonl").__enter__()
    with pytest.raises(TunebenchError, match="results.csv' is a symbolic link"):
        compare.append_row(run / "results.csv", {})
    with pytest.raises(TunebenchError, match="is a symbolic link"):
        repair_tail(run / "metrics.jsonl")
    assert victim.read_text() == "line one\nno newline at the end"


def test_the_write_test_and_the_runs_report_never_write_through_a_planted_link(tmp_path):
    """Issue 98 N9: `ln -s ~/.bashrc RUN/.write-test`, then a train into RUN truncated the target; a linked
    RUN/report folder took the report's files. The write test is a new file of its own name; a linked report
    folder is refused in one line."""
    from tunebench.jobs import run_report
    from tunebench.training import checkpoint

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".write-test").symlink_to(victim)
    checkpoint.prepare_output_dir(run, None, False)
    assert victim.read_text() == "keep me" and (run / ".write-test").is_symlink()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "report").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(TunebenchError, match="report' is a symbolic link; .* remove the link"):
        run_report.write(run)
    assert not any(elsewhere.iterdir())


def test_a_planted_link_for_the_checkpoints_folder_is_refused_before_anything_in_its_target_moves(tmp_path, capsys):
    """Saving, rotating, cleaning up after a killed save and --overwrite all write or delete inside checkpoints/: a
    link planted there would have them delete another folder's `.tmp-*` and `step-*` (or, for --overwrite, fail
    with an OSError traceback). Every way into a run refuses it in one line, and the folder it points at is whole."""
    from tunebench.training import checkpoint

    victim = tmp_path / "victim"
    (victim / "step-00000001").mkdir(parents=True)
    (victim / ".tmp-keep").write_text("a half-written file of someone else's")
    (victim / ".old-step-00000002").mkdir()
    before = sorted(str(p.relative_to(victim)) for p in victim.rglob("*"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(victim, target_is_directory=True)
    for resume, overwrite in (("auto", False), (None, True), (None, False)):
        with pytest.raises(TunebenchError, match="checkpoints' is a symbolic link; .* remove the link"):
            checkpoint.prepare_output_dir(run, resume, overwrite)
    assert sorted(str(p.relative_to(victim)) for p in victim.rglob("*")) == before
    assert (run / "checkpoints").is_symlink()


def test_a_resume_brings_the_files_its_first_start_recorded_checkpoint_or_not(tmp_path, monkeypatch):
    """Issue 98 N6: `--resume auto` finding no checkpoint compared nothing, so a GRPO run stopped before its first
    save ran whatever env.py sat in the folder it was resumed from. The first start records each file's resolved
    path and hash; every resume is held to them."""
    from tunebench.training import checkpoint

    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    checkpoint.record_user_code(run, None, {"env.py": "1111"})
    checkpoint.check_user_code(run, "auto", {"env.py": "1111"})  # the same file: resumed
    with pytest.raises(TunebenchError, match="env.py is not the file this run started with"):
        checkpoint.check_user_code(run, "auto", {"env.py": "2222"})  # changed since
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(TunebenchError, match="b/env.py is not the file this run started with"):
        checkpoint.check_user_code(run, "auto", {"env.py": "1111"})  # the same name from another folder
    checkpoint.record_user_code(run, "auto", {"env.py": "3333"})  # a resume keeps the first start's record
    assert json.loads((run / checkpoint.USER_CODE).read_text()) == {str(tmp_path / "a" / "env.py"): "1111"}


def test_a_user_file_runs_the_bytes_that_were_hashed_not_what_lies_on_disk_by_then(tmp_path):
    """Round five's M3: a resume hashes a reward or environment file and compares it before it runs; running the
    path again (importlib's loader reads the file itself) would run whatever had replaced it since. Both homes of
    a user's file, the trainer's module and the environment's process, run the bytes that were read and hashed."""
    from tunebench.core.userfile import UserFile
    from tunebench.training.grpo import environment

    path = tmp_path / "env.py"
    path.write_text("WHO = 'hashed'\n\n\ndef who() -> str:\n    \"\"\"Who wrote this file.\"\"\"\n    return WHO\n\n\n"
                    "TOOLS = [who]\n\n\ndef reset(row):\n    return [{'role': 'user', 'content': 'who?'}]\n\n\n"
                    "def reward(messages, row):\n    return 0.0\n")
    read = UserFile.read(path)
    path.write_text(path.read_text().replace("'hashed'", "'swapped'"))
    assert read.run("user_env").WHO == "hashed"
    env = environment.load(str(path), 10, file=read)
    assert environment.call(env, "who", {}).text == "hashed"
