"""Several processes on torch.distributed (gloo, on this CPU): each test launches real ranks through
torchrun or `tunebench launch` and compares them with one process at the same global batch (run in the test's
own process).

fp32, dropout 0, fixed kernels, so 2 ranks x micro batch 2 and 1 process x micro batch 4 compute the
same sums in a different order: losses and weights agree to float rounding, not bit for bit.
"""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import free_port, run_losses, run_weights
from tunebench.machine import hardware
from tunebench.machine.distributed import World
from tunebench.training import runner

ROWS = [{"instruction": f"question {i}{' and more words' * (i % 4)}", "response": f"answer {i}" + " yes" * (i % 5)}
        for i in range(20)]  # uneven lengths: ranks hold unequal numbers of loss tokens
TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times.\n" for i in range(300))
PRETRAIN_MODEL = """model:
  vocab_size: 100
  d_model: 32
  n_heads: 4
  n_layers: 2
  d_ff: 64
  max_seq_len: 32
  dropout: 0.0
  attention_dropout: 0.0
"""


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("OMP_NUM_THREADS", None)
    return env


def _tunebench(args, nproc=1, check=True, torchrun=False, timeout=300):
    """Run `tunebench ARGS` on `nproc` ranks through tunebench launch (or torchrun itself), or, as the one process
    the ranks are compared with, through cli.main in this process (a new Python would only add its start-up)."""
    if nproc == 1:
        return _here(args, check)
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "tunebench", *args]
    else:
        cmd = [sys.executable, "-m", "tunebench", "launch", "--nproc-per-node", str(nproc), "--", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}\nstderr: {done.stderr[-6000:]}\nstdout: {done.stdout[-2000:]}")
    return done


def _here(args, check):
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from tunebench.interfaces import cli

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    if check and code != 0:
        raise AssertionError(f"exit {code}\nstderr: {err.getvalue()[-6000:]}\nstdout: {out.getvalue()[-2000:]}")
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


_losses, _weights = run_losses, run_weights


def _same(a, b, rel=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=rel), k


def _same_weights(a, b, degenerate=()):
    """Equal to float rounding. `degenerate`: tensors (by name suffix) holding directions whose gradient is
    zero by construction (attention's key bias: softmax ignores a shift), where Adam's first steps move by
    +-lr on the sign of rounding noise; the model computes the same function either way."""
    assert a.keys() == b.keys()
    for k in a:
        if not k.endswith(degenerate):
            # atol relative to the tensor's scale: on an AVX2-only CPU, FSDP's reduce-scatter sums in another
            # order than one process, and Adam's first steps turn that into ~3e-5 of the weights' range on
            # elements near zero (seen: 2.6e-6 in a v_proj whose largest entry is 0.07)
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=max(1e-6, 1e-4 * float(b[k].abs().max())), msg=k)


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _train_args(data, out, micro, effective=8, **extra):
    args = ["train", "--model", "tiny", "--data", str(data), "--output-dir", str(out), "--batch-size", str(micro),
            "--effective-batch-size", str(effective), "--eval-fraction", "0.2", "--max-length", "128",
            "--precision", "fp32", "--lora-dropout", "0", "--attention", "sdpa", "--compile", "off", "--lr", "1e-2", "--schedule", "constant", "--warmup-ratio", "0", "--no-progress",
            "--max-steps", "3", "--threads", "1"]
    for k, v in {"packing": "off", **extra}.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def test_two_lora_ranks_match_one_process_and_one_big_batch(tmp_path, rows):
    """2 ranks x micro 2 x accumulation 2 (no_sync on the first micro-batch) == 1 process x micro 4 x 2 ==
    1 process x micro 8: same losses, same adapter. Rows have unequal lengths, so the ranks' loss-token
    counts differ: averaging per-rank means would give another gradient. Packed rows: a length-grouped
    order would depend on the micro batch, and only the rows' order must be the same."""
    one = tmp_path / "one"
    _tunebench(_train_args(rows, one, 4, packing="on"))
    big = tmp_path / "big"
    _tunebench(_train_args(rows, big, 8, packing="on"))
    two = tmp_path / "two"
    # all three batch flags, agreeing at 2 ranks (2 x 2 x 2 = 8): run as given
    launched = _tunebench(_train_args(rows, two, 2, packing="on", grad_accum=2), nproc=2, torchrun=True)
    _same(_losses(two), _losses(one))
    _same(_losses(two), _losses(big))
    _same_weights(_weights(two), _weights(one))
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["grad_accum_steps"] == 2 and summary["effective_batch_size"] == 8
    # Not two copies each on all the data: the ranks together saw exactly the one process's tokens.
    assert summary["tokens"] == json.loads((one / "summary.json").read_text())["tokens"]
    plan = {d["setting"]: d for d in json.loads((two / "plan.json").read_text())["decisions"]}
    assert plan["world"]["value"] == 2 and "backend gloo" in plan["world"]["reason"]
    assert plan["parallel"]["value"] == "ddp"
    assert "effective batch 8 = 2 x 2 x 2 ranks" in plan["grad_accum_steps"]["reason"]
    assert launched.stdout.count("settings:") == 1  # rank 0 alone talks


def test_qlora_ranks_match_one_process(tmp_path, rows):
    """DDP over a 4-bit frozen base: every rank quantizes the same weights; only the adapters sync."""
    one, two = tmp_path / "one", tmp_path / "two"
    _tunebench(_train_args(rows, one, 4, method="qlora", quantization="4bit", packing="on"))
    _tunebench(_train_args(rows, two, 2, method="qlora", quantization="4bit", packing="on"), nproc=2)
    _same(_losses(two), _losses(one))
    _same_weights(_weights(two), _weights(one))


def test_full_fine_tuning_sharded_by_fsdp_matches_one_process(tmp_path, rows):
    """FSDP2 shards the weights, gradients and AdamW moments; the run is the one process's run."""
    one, two = tmp_path / "one", tmp_path / "two"
    _tunebench(_train_args(rows, one, 4, method="full", lr="1e-3"))
    _tunebench(_train_args(rows, two, 2, method="full", lr="1e-3", parallel="fsdp"), nproc=2)
    _same(_losses(two), _losses(one))
    _same_weights(_weights(two), _weights(one))
    plan = {d["setting"]: d for d in json.loads((two / "plan.json").read_text())["decisions"]}
    assert plan["parallel"]["value"] == "fsdp" and plan["compile"]["value"] is False
    from tunebench.model import models
    reloaded = models.resolve(str(two))  # a whole, loadable model directory, not shards
    assert sum(p.numel() for p in reloaded.model.parameters()) == json.loads(
        (two / "summary.json").read_text())["trainable_parameters"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_pretrain_on_two_ranks_matches_one_process(tmp_path, parallel):
    """Including a checkpoint saved and resumed under the same parallelism (FSDP: gathered, then
    sharded again on load)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    tok = tmp_path / "tok"
    _tunebench(["tokenizer", "train", "--data", str(corpus), "--vocab-size", "100", "--type", "char", "-o", str(tok)])
    config = tmp_path / "tiny.yaml"
    config.write_text(PRETRAIN_MODEL)

    def args(out, micro):
        return ["pretrain", str(config), "--data", str(corpus), "--tokenizer", str(tok), "--output-dir", str(out),
                "--max-length", "32", "--batch-size", str(micro), "--effective-batch-size", "8", "--max-steps", "3",
                "--precision", "fp32", "--attention", "sdpa", "--compile", "off", "--threads", "1",
                "--eval-steps", "100", "--lr", "3e-3", "--parallel", parallel, "data.max_eval_blocks=8",
                "training.warmup_steps=0", "training.lr_scheduler=constant", "training.logging_steps=1",
                "--no-progress"]

    _tunebench(args(tmp_path / "one", 4))
    # Two ranks stop after 2 steps and resume (same world, same parallel) for the third.
    _tunebench([*args(tmp_path / "two", 2), "--max-steps", "2"], nproc=2)
    _tunebench([*args(tmp_path / "two", 2), "--resume", "auto"], nproc=2)
    _same(_losses(tmp_path / "two"), _losses(tmp_path / "one"))
    assert len(_losses(tmp_path / "one")) == 3
    _same_weights(_weights(tmp_path / "two"), _weights(tmp_path / "one"), degenerate=("attn.c_attn.bias",))
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two")]
    assert summaries[1]["parallel"] == parallel and summaries[1]["world_size"] == 2
    assert summaries[1]["eval_loss"] == pytest.approx(summaries[0]["eval_loss"], rel=1e-5)


def test_a_run_saved_by_two_ranks_resumes_on_one_and_the_reverse(tmp_path, rows):
    """Constant learning rate, so 2 steps then 2 more == 4 steps straight (the schedule is the new run's)."""
    straight = tmp_path / "straight"
    _tunebench(_train_args(rows, straight, 4, max_steps=4))
    expected = _losses(straight)

    a = tmp_path / "two-then-one"
    _tunebench(_train_args(rows, a, 2, max_steps=2), nproc=2)
    resumed = _tunebench(_train_args(rows, a, "auto", max_steps=4, resume="auto"))
    assert "the checkpoint's rows per micro-step over 1 rank(s)" in resumed.stdout
    assert "saved by 2 rank(s), this run has 1" in resumed.stdout

    b = tmp_path / "one-then-two"
    _tunebench(_train_args(rows, b, 4, max_steps=2))
    _tunebench(_train_args(rows, b, "auto", max_steps=4, resume="auto"), nproc=2)
    for out in (a, b):
        _same(_losses(out), expected)
        _same_weights(_weights(out), _weights(straight))
    assert json.loads((b / "summary.json").read_text())["micro_batch_size"] == 2


def test_a_signal_to_one_rank_stops_both_at_the_same_step_with_a_checkpoint(tmp_path, rows):
    import psutil

    out = tmp_path / "sig"
    cmd = [sys.executable, "-m", "tunebench", "launch", "--nproc-per-node", "2", "--",
           *_train_args(rows, out, 2, max_steps=10000, eval_fraction=0.5)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and _losses(out)):
            time.sleep(0.5)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if p.environ().get("RANK") == "1"]
        assert len(workers) == 1
        workers[0].send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted at step" in stderr
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert len(saved) == 1
    state = json.loads((saved[0] / "state.json").read_text())
    assert state["loop"]["step"] == max(_losses(out)) and state["world_size"] == 2
    assert (saved[0] / "training_state.pt").is_file()


def test_ranks_do_not_outlive_a_launch_killed_with_sigkill(tmp_path, rows):
    """torchrun starts each rank in a session of its own, so a process-group kill never reached them, and a
    `tunebench launch` (or the compare above it) killed with -9 left both ranks training. Each rank now gets
    SIGTERM when its parent dies: it checkpoints and stops."""
    import psutil

    out = tmp_path / "orphans"
    cmd = [sys.executable, "-m", "tunebench", "launch", "--nproc-per-node", "2", "--",
           *_train_args(rows, out, 2, max_steps=10000, eval_fraction=0.5)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=_env())
    ranks, alive = [], []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and _losses(out)):
            time.sleep(0.5)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "RANK" in p.environ()]
        assert len(ranks) == 2
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=90)
    finally:
        proc.kill()
        for p in ranks:
            if p.is_running():
                p.kill()
    assert not alive, f"ranks still running 90 s after their launch was killed: {[p.pid for p in alive]}"
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert saved and json.loads((saved[-1] / "state.json").read_text())["world_size"] == 2


def test_bad_input_under_launch_is_one_line_from_rank_0(tmp_path, rows):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    done = _tunebench(_train_args(rows, out, 2), nproc=2, check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("tunebench: error:")]
    assert done.returncode == 2
    assert len(errors) == 1 and "already holds a run" in errors[0] and "--overwrite" in errors[0]
    assert "Traceback" not in done.stderr


def test_effective_batch_that_the_ranks_cannot_share_is_refused(tmp_path, rows):
    done = _tunebench(_train_args(rows, tmp_path / "o", 2, effective=6), nproc=2, check=False)
    assert done.returncode == 2
    assert "--effective-batch-size 6 is not a multiple of 2 rank(s) x --batch-size 2" in done.stderr


def _shares(n_rows, micro, world_size, epoch=0):
    """Each rank's micro-batches of one epoch, as runner.micro_batches builds them."""
    data = np.arange(n_rows)

    def collate(rows_, step_rows):
        ids = torch.tensor(rows_)[:, None]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    from tunebench.data.batching import epoch_steps
    from tunebench.training.loop import LoopState

    shares, accum = [], 2
    for rank in range(world_size):
        world = World(rank, world_size, rank, world_size, "gloo")
        take = runner.micro_batches(lambda e: epoch_steps(data, micro * world_size * accum, 7, e), collate, world,
                                    micro, accum)
        state = LoopState(epoch=epoch)
        steps = len(epoch_steps(data, micro * world_size * accum, 7, epoch)) * accum
        shares.append([take(state) for _ in range(steps)])
    return shares


@pytest.mark.parametrize("n_rows, micro, world_size", [(16, 2, 2), (11, 2, 2), (10, 3, 4), (5, 2, 4)])
def test_shards_are_disjoint_cover_the_epoch_and_keep_ranks_in_step(n_rows, micro, world_size):
    shares = _shares(n_rows, micro, world_size)
    assert len({len(s) for s in shares}) == 1  # every rank runs the same number of micro-batches
    seen = []
    for share in shares:
        for batch in share:
            real = batch["attention_mask"].bool()[:, 0]
            seen += batch["input_ids"][real, 0].tolist()
            if not real.any():  # a filler: no real tokens, no loss
                assert (batch["labels"] == -100).all()
    assert sorted(seen) == list(range(n_rows))  # disjoint and covering

    def ids(shares_):
        return [[b["input_ids"][:, 0].tolist() for b in share] for share in shares_]

    assert ids(_shares(n_rows, micro, world_size, epoch=1)) != ids(shares)  # a new order each epoch


def test_each_epoch_is_ordered_once_not_once_a_micro_batch():
    calls = []

    def steps(epoch):
        calls.append(epoch)
        return [[0, 1], [2, 3], [4]]

    def collate(rows_, step_rows):
        ids = torch.tensor(rows_)[:, None]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    from tunebench.training.loop import LoopState

    take, state = runner.micro_batches(steps, collate, World(), 1, 2), LoopState()
    rows = [take(state)["input_ids"][:, 0].tolist() for _ in range(9)]
    assert rows[:6] == [[0], [1], [2], [3], [4], [4]]  # [4] again: the filler of the short step, with no loss
    assert calls == [0, 1]  # two epochs, each ordered once


@pytest.mark.parametrize("local_ranks, omp, launched, threads, why", [
    (1, None, False, 8, "8 physical cores"),
    (4, None, False, 2, "shared by 4 ranks on this machine: 8 // 4"),
    (16, None, False, 1, "8 // 16"),
    (2, "1", False, 1, "torchrun sets 1 when it is unset"),
    (2, "4", True, 4, "shared by 2 ranks"),  # tunebench launch set OMP_NUM_THREADS itself: the split decides
])
def test_threads_per_rank_split_the_usable_cores(local_ranks, omp, launched, threads, why):
    hw = hardware.Hardware(cpu_model="test", physical_cores=8, logical_cores=16, cpu_flags=frozenset(),
                           ram_total_mb=64_000, ram_available_mb=60_000, os="Linux", usable_cpus=16)
    decision = hardware._pick_threads(None, hw, omp, local_ranks, launched)
    assert decision.value == threads and why in decision.reason


@pytest.mark.parametrize("options, why", [
    ({"train.objective": "grpo", "objective.reward": ["gsm8k"]}, "--objective grpo samples"),  # auto's pick
    ({"evaluation.eval_generate": 2, "distributed.parallel": "fsdp"}, "--eval-generate needs the whole model"),
])
def test_what_cannot_run_sharded_is_refused_when_fsdp_is_picked(options, why):
    """GRPO samples, and --eval-generate generates, with a whole model on each rank: FSDP, asked for or picked by
    auto for a model that does not fit a rank, is refused with the fix (these compared the table's row, not its
    value, with "fsdp", and never fired)."""
    from types import SimpleNamespace

    from tunebench.core.errors import TunebenchError
    from tunebench.settings.finetune import load_config
    from tunebench.training import finetune_model

    if "distributed.parallel" in options:  # asked for: refused at load, before any output
        with pytest.raises(TunebenchError, match=why):
            load_config(options={"adapter.method": "full", **options}, world_size=2)
    cfg = load_config(options={"adapter.method": "full", **options}, world_size=1)
    opened = SimpleNamespace(world=World(rank=0, size=2, local_size=2, backend="gloo"), device=torch.device("cpu"))
    with pytest.raises(TunebenchError, match=why):
        finetune_model.pick_parallel(cfg, opened, 10**12)  # a trillion parameters fit no rank: auto shards


def test_parallel_auto_shards_what_does_not_fit_and_keeps_adapters_on_ddp():
    assert hardware.pick_parallel("auto", "full", 10_000_000, 2, 10_000).value == "ddp"  # ~153 MB of 10 GB
    assert hardware.pick_parallel("auto", "pretrain", 1_000_000_000, 2, 10_000).value == "fsdp"
    assert hardware.pick_parallel("auto", "lora", 1_000_000_000, 2, 10_000).value == "ddp"
    assert hardware.pick_parallel("auto", "full", 10, 1, 10).value == "none"
    from tunebench.core.errors import TunebenchError

    with pytest.raises(TunebenchError, match="--parallel ddp"):
        hardware.pick_parallel("fsdp", "lora", 10, 2, 10)




def test_two_nodes_on_this_machine_match_one_process(tmp_path, rows):
    """Two `tunebench launch --nnodes 2` processes, one rank each, meeting at a localhost rendezvous (as two
    machines would at the first one's address): the run is the one process's run."""
    one, two = tmp_path / "one", tmp_path / "two"
    _tunebench(_train_args(rows, one, 4))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "tunebench", "launch", "--nproc-per-node", "1", "--nnodes", "2",
                               "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", "--",
                               *_train_args(rows, two, 2)], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outputs]
    _same(_losses(two), _losses(one))
    _same_weights(_weights(two), _weights(one))
    plan = {d["setting"]: d for d in json.loads((two / "plan.json").read_text())["decisions"]}
    assert plan["world"]["value"] == 2
    assert sum(out.count("settings:") for out, _ in outputs) == 1  # global rank 0 alone talks


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo ran",))


def test_what_ranks_send_each_other_is_read_as_data_never_as_code():
    """agree/gather carry bytes in tensors read by torch's weights_only unpickler: plain values, tensors and
    the classes named come back; anything else (a peer's payload that would run code) is refused."""
    from tunebench.core.decision import Decision
    from tunebench.machine import distributed
    from tunebench.training.runplan import Measured

    value = ("ok", Measured((Decision("compile", True, "measured"),), 2, 4, 12.5))
    back = distributed._decode(distributed._encode(value), (Measured, Decision))
    assert back == value and isinstance(back[1], Measured)
    rng = {"torch": torch.get_rng_state(), "python": [3, [1, 2], None]}
    assert torch.equal(distributed._decode(distributed._encode(rng), ())["torch"], rng["torch"])
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        distributed._decode(distributed._encode(_RunsCode()), ())
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        distributed._decode(distributed._encode(value), ())  # a class not named is refused too


def _preference_data(tmp_path, objective):
    from conftest import pairs_file

    if objective == "kto":
        data = tmp_path / "judged.jsonl"
        golden = json.loads((Path(__file__).parent / "golden" / "kto.json").read_text())
        data.write_text("".join(json.dumps(r) + "\n" for r in golden["rows"]))  # 10: 8 train, steps of 4, 4, 4
        return data
    return pairs_file(tmp_path)  # 6 pairs: 5 train, steps of 4 and 1 (rank 1's share of that one: a filler)


def test_preference_objectives_fully_fine_tuned_under_fsdp_match_one_process(tmp_path):
    """FSDP2 shards the policy's weights, gradients and AdamW moments; the reference (a frozen whole copy on each
    rank: FSDP refuses LoRA, whose reference is the base with the adapter off) scores each rank's pairs."""
    for objective in ("dpo", "orpo", "kto"):
        data = _preference_data(tmp_path, objective)
        one, two = tmp_path / f"{objective}-one", tmp_path / f"{objective}-two"
        args = {"effective": 4, "objective": objective, "method": "full", "lr": "1e-3"}
        _tunebench(_train_args(data, one, 4, **args))
        _tunebench(_train_args(data, two, 2, parallel="fsdp", **args), nproc=2)
        ours, theirs = _losses(two), _losses(one)
        assert sorted(ours) == [1, 2, 3], objective
        for step in ours:
            assert ours[step] == pytest.approx(theirs[step], abs=1e-6), (objective, step)
        _same_weights(_weights(two), _weights(one))
        plan = {d["setting"]: d["value"] for d in json.loads((two / "plan.json").read_text())["decisions"]}
        assert plan["parallel"] == "fsdp" and plan["world"] == 2


@pytest.mark.parametrize("objective", ["dpo", "orpo", "kto"])
def test_preference_objectives_on_two_ranks_match_one_process(tmp_path, objective):
    """DPO, ORPO and KTO on 2 ranks x micro 2 take one process's micro-4 steps: the loss normalised over the
    whole step's pairs (or judged completions), the reference pass under DDP, KTO's KL reference point over the
    global micro-step (its mismatched rows drawn across the ranks, the sums all-reduced), and a short last step
    whose rows one rank cannot share (a filler with no units); the held-out figures reduced across ranks."""
    data = _preference_data(tmp_path, objective)
    one, two = tmp_path / "one", tmp_path / "two"
    _tunebench(_train_args(data, one, 4, effective=4, objective=objective))
    _tunebench(_train_args(data, two, 2, effective=4, objective=objective), nproc=2)
    ours, theirs = _losses(two), _losses(one)
    assert sorted(ours) == [1, 2, 3]
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], abs=1e-6), step
    if objective == "dpo":
        assert ours[1] == pytest.approx(np.log(2), abs=1e-6)  # the policy is its reference at the first step
    if objective in ("dpo", "kto"):  # KTO: its KL reference point over the same global micro-step at every size
        # saved by 2 ranks after step 2, resumed in 1 process and on 4 ranks: the same data position, the same step 3
        moved, four = tmp_path / "two-then-one", tmp_path / "two-then-four"
        _tunebench(_train_args(data, moved, 2, effective=4, objective=objective, max_steps=2), nproc=2)
        shutil.copytree(moved, four)
        _tunebench(_train_args(data, moved, 4, effective=4, objective=objective, resume="auto"))
        _tunebench(_train_args(data, four, 1, effective=4, objective=objective, resume="auto"), nproc=4)
        assert _losses(moved) == pytest.approx(theirs, abs=1e-6)
        assert _losses(four) == pytest.approx(theirs, abs=1e-6)
    _same_weights(_weights(two), _weights(one))
    rows = {name: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for name, run in (("one", one), ("two", two))}
    figures = ("kl", "rewards/chosen", "rewards/rejected") if objective == "kto" else \
        ("rewards/accuracies", "rewards/margins", "logps/chosen")
    for a, b in zip(*(([r for r in rows[n] if "loss" in r]) for n in ("one", "two"))):
        for key in figures:
            # the loss above to 1e-6; the rewards, sums over whole replies after two AdamW steps whose gradients the
            # ranks add in another order, to float rounding (seen: 2.7e-6 relative)
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    mine, one_process = (json.loads((run / "summary.json").read_text()) for run in (two, one))
    held = [k for k, v in one_process.items() if k.startswith("eval_") and isinstance(v, float) and "time" not in k]
    assert "eval_loss" in held and mine["world_size"] == 2
    for key in held:  # the held-out pairs' (or completions') loss and rewards, summed over the ranks' shares
        assert mine[key] == pytest.approx(one_process[key], rel=1e-5, abs=1e-6), key


# GRPO's completions fixed by their prompt (not by the seed, which differs by rank), so 2 ranks and 1 process learn
# from the same ones; the script replaces the sampler and runs the command line as `python -m tunebench` would.
FIXED_GRPO = """import sys, zlib
import torch
from tunebench.interfaces import cli
from tunebench.training import grpo

def fixed(model, tokenizer, device, autocast, prompts, s, seed):
    out = []
    for p in prompts:
        g = torch.Generator().manual_seed(zlib.crc32(str(p).encode()))
        for _ in range(s.num_generations):
            n = int(torch.randint(1, s.max_completion_length, (1,), generator=g))
            out.append(torch.randint(3, 60, (n,), generator=g).tolist() + [tokenizer.eos_token_id])
    return out

grpo.sample = fixed
sys.exit(cli.main(sys.argv[1:]))
"""


def _grpo_args(tmp_path, out, micro, *extra):
    # 18 prompts: 9 train, steps of 4, 4 and 1 (rank 1's share of that one: a filler); 9 held out, decoded in
    # batches of 8 and 1 (rank 0 takes the first, rank 1 the second)
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}) + "\n"
                            for a in range(1, 7) for b in range(1, 4)))
    lengths = tmp_path / "lengths.py"  # `answer` scores the prompt, not the completion: the held-out figures differ
    lengths.write_text("def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
                       "def answer(completions, answer, **kwargs):\n    return [float(a.split()[-1]) for a in answer]\n")
    return ["train", "--model", "tiny", "--method", "grpo", "--reward", f"{lengths}:length", "--reward", "format:\\d",
            "--reward", f"{lengths}:answer", "--reward-weights", "0.1", "1", "0.01", "--data", str(data),
            "--num-generations", "3",
            "--max-completion-length", "8", "--batch-size", str(micro), "--effective-batch-size", "4",
            "--eval-fraction", "0.5", "--precision", "fp32", "--lora-dropout", "0", "--attention", "sdpa",
            "--compile", "off", "--lr", "3e-3", "--schedule", "constant", "--warmup-ratio", "0", "--no-progress",
            "--threads", "1", "--max-steps", "3", "--output-dir", str(out), *extra]


def _steps(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.mark.parametrize("loss_type, beta", [("dapo", "0"), ("grpo", "0.04"), ("dr_grpo", "0")])
def test_grpo_on_two_ranks_matches_one_process_on_the_same_completions(tmp_path, loss_type, beta):
    """Each rank generates its own prompts' groups (a group whole on one rank, its advantages its own); the loss
    is normalised over the whole step's completions or completion tokens as the loss type says, the rewards and
    the share of groups that taught nothing summed over the ranks; a short last step leaves rank 1 a filler."""
    script = tmp_path / "fixed.py"
    script.write_text(FIXED_GRPO)
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--loss-type", loss_type, "--beta", beta)
    for out, micro, launch in ((one, 4, [sys.executable]), (two, 2, [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])):
        done = subprocess.run([*launch, str(script), *_grpo_args(tmp_path, out, micro, *extra)], capture_output=True,
                              text=True, env=_env(), timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
    ours, theirs = _steps(two), _steps(one)
    assert sorted(ours) == [1, 2, 3]
    for step, r in theirs.items():
        assert ours[step]["loss"] == pytest.approx(r["loss"], abs=1e-6), step
        for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "rewards/length/mean",
                    "kl"):
            assert ours[step][key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), (step, key)
    assert theirs[2]["reward_std"] > 0 and (theirs[3]["kl"] > 0) == (beta != "0")  # the steps taught something
    ours_w = _weights(two)
    for name, theirs_w in _weights(one).items():
        # within 2% of one lr step (3e-3): with beta, a few elements whose gradient is rounding noise (the KL term
        # is 0 at the first step) take Adam steps that turn another summation order into ~1e-5 (seen: 3.6e-5 in 2
        # of 512 elements; one process at micro 1 against micro 4: 1.6e-4); a loss normalised per rank, say,
        # moves most elements by a large part of a step
        torch.testing.assert_close(ours_w[name], theirs_w, rtol=1e-4, atol=6e-5, msg=name)
    mine, one_process = (json.loads((run / "summary.json").read_text()) for run in (two, one))
    assert mine["world_size"] == 2 and mine["generated_tokens"] == one_process["generated_tokens"]
    for key in ("eval_reward_before", "eval_reward", "eval_rewards/answer/mean", "eval_rewards/length/mean"):
        # the 9 held-out prompts' greedy completions: 8 decoded by rank 0 and 1 by rank 1, read together
        assert mine[key] == pytest.approx(one_process[key], abs=1e-6), key


# A reward that writes the prompts of each training step it scores (a group: the prompt num_generations times) to the
# file SCORED names, and kills rank 0 with SIGKILL once the checkpoint KILL_AFTER names is on disk (a real kill: no
# handler runs, the step in flight is lost).
RECORDER = """import json, os, signal

def seen(prompts, completions, **kwargs):
    rank = os.environ.get("RANK", "0")
    if rank == "0" and os.path.isdir(os.environ.get("KILL_AFTER", "/nonexistent")):
        os.kill(os.getpid(), signal.SIGKILL)
    if len(prompts) % 3 == 0 and prompts[0] == prompts[1]:
        with open(os.environ["SCORED"], "a") as f:
            f.write(json.dumps({"rank": rank, "prompts": prompts[::3]}) + "\\n")
    return [0.0] * len(prompts)
"""


def _scored(path, skip_first=0):
    """The prompts a run's training steps scored, each rank's first `skip_first` steps left out."""
    calls, seen = [], {}
    for line in path.read_text().splitlines():
        call = json.loads(line)
        seen[call["rank"]] = seen.get(call["rank"], 0) + 1
        if seen[call["rank"]] > skip_first:
            calls += call["prompts"]
    return sorted(calls)


def test_grpo_killed_on_two_ranks_resumes_on_two_one_and_four(tmp_path):
    """Sampled for real: a 2-rank run killed with SIGKILL in step 3 resumes on 2 ranks to the uninterrupted run's
    rewards and losses (each rank draws as it did), and on 1 and on 4 ranks from the same data position: steps 3
    and 4 learn from the same prompts (a short last step, then the next epoch's first)."""
    recorder = tmp_path / "seen.py"
    recorder.write_text(RECORDER)

    def run(out, nproc, *extra, **env):
        args = _grpo_args(tmp_path, out, 4 // nproc, "--reward", f"{recorder}:seen", "--reward-weights", "0.1", "1",
                          "0.01", "0", "--max-steps", "4", "--save-steps", "1", *extra)
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
        return subprocess.run([sys.executable, *launch, "-m", "tunebench", *args], capture_output=True, text=True,
                              env={**_env(), "SCORED": str(out) + ".scored", **env}, timeout=300)

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run(whole, 2).returncode == 0
    done = run(killed, 2, KILL_AFTER=str(killed / "checkpoints" / "step-00000002"))
    assert done.returncode != 0 and "SIGKILL" in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in (killed / "checkpoints").glob("step-*"))[-1] == "step-00000002"
    for nproc in (1, 4):
        shutil.copytree(killed, tmp_path / f"on-{nproc}")
    expected = _scored(Path(f"{whole}.scored"), skip_first=2)  # steps 3 and 4 (each rank had prompts in 1 and 2)
    for out, nproc in ((killed, 2), (tmp_path / "on-1", 1), (tmp_path / "on-4", 4)):
        Path(f"{out}.scored").unlink(missing_ok=True)
        resumed = run(out, nproc, "--resume", "auto")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "continuing from" in resumed.stdout and _scored(Path(f"{out}.scored")) == expected, nproc
        steps = _steps(out)
        assert sorted(steps) == [1, 2, 3, 4] and json.loads((out / "summary.json").read_text())["world_size"] == nproc
        for step in (1, 2):  # before the kill: the 2-rank run's own figures
            assert steps[step]["reward"] == pytest.approx(_steps(whole)[step]["reward"], abs=1e-6)
    for step, r in _steps(whole).items():  # on 2 ranks again, the uninterrupted run's draws, rewards and losses
        assert _steps(killed)[step]["reward"] == pytest.approx(r["reward"], abs=1e-6), step
        assert _steps(killed)[step]["loss"] == pytest.approx(r["loss"], abs=1e-6), step
    assert _steps(whole)[3]["reward_std"] > 0 or _steps(whole)[4]["reward_std"] > 0  # sampling made groups differ


@pytest.mark.usefixtures("children_in_process")
def test_compare_runs_preference_and_grpo_rows_on_two_ranks_beside_sft(tmp_path, rows):
    """A matrix whose SFT row runs in one process and whose DPO and GRPO rows set nproc 2: each results row says its
    objective and processes, DPO its held-out reward accuracy, GRPO its held-out reward; the report lists them."""
    from conftest import pairs_file
    from tunebench.jobs import compare, report

    pairs = pairs_file(tmp_path)
    _grpo_args(tmp_path, tmp_path / "unused", 2)  # writes q.jsonl and lengths.py
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(
        f"base: {{model.name: tiny, data.path: '{rows}', train.max_steps: 2, train.effective_batch_size: 4, "
        "hardware.precision: fp32, train.compile: 'off', data.eval_fraction: 0.2}\n"
        "experiments:\n  - {name: sft}\n"
        f"  - {{name: dpo, nproc: 2, set: {{data.path: '{pairs}', objective.name: dpo}}}}\n"
        f"  - {{name: grpo, nproc: 2, set: {{data.path: '{tmp_path / 'q.jsonl'}', objective.name: grpo, "
        f"objective.reward: ['{tmp_path / 'lengths.py'}:length'], objective.num_generations: 2, "
        "objective.max_completion_length: 8}}\n")
    out = tmp_path / "results.csv"
    compare.run(str(matrix), str(out), str(tmp_path / "runs"), 1, {})
    with out.open() as f:
        got = {r["experiment"]: r for r in csv.DictReader(f)}
    assert {r["status"] for r in got.values()} == {"ok"}, [r["message"] for r in got.values()]
    assert [(got[n]["objective"], got[n]["processes"]) for n in ("sft", "dpo", "grpo")] == [
        ("sft", "1"), ("dpo", "2"), ("grpo", "2")]
    assert got["dpo"]["reward_accuracy"] != "" and got["grpo"]["reward"] != "" and got["sft"]["reward"] == ""
    text = (report.write([str(out)], str(tmp_path / "report")).parent / "report.md").read_text()
    runs = text.split("## All runs")[1]
    assert all(f"| {n} |" in runs for n in ("sft", "dpo", "grpo")) and "| objective |" in runs
    assert "grpo" in text.split("## Held-out reward (GRPO), before training and after")[1].split("##")[0]
