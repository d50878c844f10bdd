"""Every run holds its plan against what happened (training/plancheck.py): the figures computed by hand on made-up
steps, and one tiny run end to end at auto's micro batch, whose check is printed and kept, and whose steady speed
the next run of its shape predicts from."""

import dataclasses
import json

import pytest

from tunebench.training import plancheck
from tunebench.training.autotune import Key, batch, memory
from tunebench.training.autotune.budget import Budget
from tunebench.training.autotune.known import Known, Record, Recorded
from tunebench.training.plancheck import Forecast, Work


def test_the_first_slow_steps_are_split_from_the_steady_speed():
    # 100 positions a step; steady 100/s in the later half; steps 1-2 took 2.5 s and 1.5 s (both > 1.25 x 1 s)
    times = [(2.5, 100, 90), (1.5, 100, 90), (1.0, 100, 90), (1.1, 110, 100), (1.0, 100, 90), (1.0, 100, 90)]
    s = plancheck.split_steps(times)
    assert s.first_steps == 2
    steady = 410 / 4.1  # the steps after the first two: 410 positions in 4.1 s
    assert s.steady_positions_per_s == pytest.approx(steady)
    assert s.steady_tokens_per_s == pytest.approx(370 / 4.1)
    assert s.first_steps_s == pytest.approx(2.5 + 1.5 - 200 / steady)
    # a slow step in the later half is not a first step; an even run has none
    assert plancheck.split_steps([(1.0, 100, 1), (1.0, 100, 1), (3.0, 100, 1), (1.0, 100, 1)]).first_steps == 0


def test_the_check_splits_the_training_times_difference_by_cause():
    f = Forecast(Work(500.0, 450.0), positions_per_s=125.0, first_steps_s=0.5, peak_mb=1000.0)
    assert f.train_s == pytest.approx(4.5) and f.tokens_per_s == pytest.approx(112.5)
    times = [(2.5, 100, 90), (1.5, 100, 90), (1.0, 100, 90), (1.1, 110, 100), (1.0, 100, 90), (1.0, 100, 90)]
    c = plancheck.check(f, times, wall_s=9.0, peak_mb=1500.0)
    assert c["train_time_s"] == {"predicted": 4.5, "measured": 8.1, "ratio": pytest.approx(8.1 / 4.5, abs=1e-3)}
    assert sum(c["difference_s"].values()) == pytest.approx(8.1 - 4.5, abs=0.03)  # the causes add up
    assert c["difference_s"]["data"] == pytest.approx(110 / 125, abs=0.01)  # 610 positions ran, 500 planned
    assert c["peak_memory_mb"]["ratio"] == 1.5 and c["evaluations_and_checkpoints_s"] == pytest.approx(0.9)
    text = "\n".join(plancheck.lines(c))
    assert "time to train      predicted 4.5 s, measured 8.1 s (1.80x, missed by more than 15%)" in text
    assert "over the first 2 step(s)" in text and "peak memory        predicted 1,000 MB, measured 1,500 MB" in text


def test_a_plan_for_longer_rows_than_were_fed_is_a_bound_and_the_peak_is_held_to_the_plan_at_what_was_fed():
    # GRPO at beta 0 plans every group teaching at the longest completion and feeds only the groups that teach
    plan = memory.MemoryPlan(runtime=500.0, weights=500.0, state=10.0, activations=6000.0, micro=16, tokens=220,
                             checkpointing=False)
    assert plan.as_fed(16, 220) == pytest.approx(plan.total)
    assert plan.as_fed(2, 110) == pytest.approx(1010.0 + 6000.0 / 16)  # 2 rows of 110: a sixteenth of the positions
    f = Forecast(Work(500.0, 450.0), positions_per_s=None, first_steps_s=0.0, peak_mb=plan.total)
    c = plancheck.check(f, [(1.0, 100, 90)] * 4, wall_s=4.0, peak_mb=1600.0, fed=(2, 110, plan.as_fed(2, 110)))
    assert c["largest_micro_batch_fed"] == [2, 110] and c["peak_memory_as_fed_mb"]["ratio"] == pytest.approx(
        1600 / 1385, abs=1e-3)
    text = "\n".join(plancheck.lines(c))
    assert ("peak memory        the plan's 7,010 MB is a bound (every row fed at its longest); at the largest micro "
            "batch fed (2 rows x 110) predicted 1,385 MB, measured 1,600 MB (1.16x, missed by more than 15%)") in text


def test_a_step_that_samples_plans_the_larger_of_its_training_pass_and_its_decodings_caches():
    """Hand-computed: SmolLM2-135M's shape (30 layers, key/value 192 wide) in fp32, 16 episodes of 1,024 tokens
    decoded at once: keys and values, three copies (decoding.Turns), 3 x 16 x 1,024 x 30 x 2 x 192 x 4 bytes =
    2,160 MB. Held to a fed micro batch half as wide with a sixteenth of the loss positions, the caches (as many
    episodes, half as long) outgrow the training pass."""
    shape = memory.ModelShape(30, 576, 192, 1536, 9, 0, 0, "llama")
    plan = memory.MemoryPlan(runtime=500.0, weights=500.0, state=10.0, activations=1000.0, micro=4, tokens=1024,
                             checkpointing=True, logits=1600.0, loss_positions=3200)
    sampled = memory.with_sampling(plan, shape, 16, 4)
    assert sampled.sampling == pytest.approx(2160.0) and sampled.sampling_rows == 16
    assert sampled.total == pytest.approx(1010.0 + 2600.0)  # the training pass the larger at the bound
    assert sampled.as_fed(4, 512, 200) == pytest.approx(1010.0 + 1080.0)  # training 500 + 100: the caches' 1,080
    assert plan.as_fed(4, 512, 200) == pytest.approx(1010.0 + 600.0)  # without sampling, as before
    weights = dataclasses.replace(plan, square=400.0)  # attention weights: 0.5 x the positions, each half as wide
    assert weights.as_fed(4, 512, 200) == pytest.approx(1010.0 + 600.0 * 0.5 + 400.0 * 0.25 + 100.0)
    kept = memory.predict(shape, "lora", 4, 0, 4, 1024, False, "tunebench")  # our kernel's T x T a head, 31 layers
    assert kept.square == pytest.approx(memory.TRANSIENT["cpu"] * 4 * 9 * 1024 * 4096 * 31 / 2**20)
    assert "the larger of the training pass (activations 1000 MB (micro 4 x 1024 tokens, checkpointing on) + " \
        "log-probabilities 1.6 GB (3,200 loss positions x the vocabulary)) and sampling's KV caches 2.1 GB (16 " \
        "episodes x 1024 tokens)" in sampled.parts()


def test_what_runs_held_beyond_their_memory_plans_is_added_to_the_next_plans_never_taken_off(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path))
    key = plancheck.memory_key(Key("batch", {"where": "CPU x2", "precision": "bf16", "method": "lora"}))
    plan = memory.MemoryPlan(runtime=400.0, weights=250.0, state=5.0, activations=400.0, micro=4, tokens=98,
                             checkpointing=False)
    assert plancheck.memory_beyond(key) is None and memory.with_learned(plan, None) == plan
    for peak in (1334.0, 1289.0, 1348.0):  # three runs of plans of 1,055 MB
        plancheck.learn_memory(key, {"peak_memory_mb": {"predicted": plan.total, "measured": peak}}, 0.0)
    assert plancheck.memory_beyond(key) == (pytest.approx(1334.0 - 1055.0), 3)
    learned = memory.with_learned(plan, plancheck.memory_beyond(key))
    assert learned.total == pytest.approx(1334.0) and "+ 279 MB that the last 3 run(s) of this machine held" in \
        learned.parts()
    # a run planned with it teaches what it held beyond the plan without it; a GRPO run whose plan was a bound, what
    # it held beyond the plan at the largest micro batch it fed (not beyond the bound)
    plancheck.learn_memory(key, {"peak_memory_mb": {"predicted": learned.total, "measured": 1400.0}}, learned.learned)
    plancheck.learn_memory(key, {"peak_memory_mb": {"predicted": 7000.0, "measured": 1400.0},
                                 "peak_memory_as_fed_mb": {"predicted": 1100.0, "measured": 1400.0}}, 0.0)
    assert plancheck.memory_beyond(key) == (pytest.approx(1348.0 - 1055.0), 5)  # 234, 279, 293, 300, 345
    # runs that held less than their plans leave the plan a bound
    assert memory.with_learned(plan, (-120.0, 3)) == plan
    # a base quantized otherwise is its own record: an 8-bit run's int8 buffers are nothing a 4-bit run holds
    eight, four = (plancheck.memory_key(Key("batch", {"where": "GPU", "precision": "bf16", "method": "qlora",
                                                      "quantization": q})) for q in ("8bit", "4bit"))
    plancheck.learn_memory(eight, {"peak_memory_mb": {"predicted": 668.0, "measured": 1710.0}}, 0.0)
    assert plancheck.memory_beyond(eight) == (pytest.approx(1042.0), 1) and plancheck.memory_beyond(four) is None


def test_a_forecast_takes_the_last_runs_speed_and_says_when_it_corrects_a_miss():
    work = Work(1000.0, 900.0)
    probe = plancheck.forecast(work, 4, 200.0, {}, True, 4.6, 10, 1.0, 1)
    assert probe.positions_per_s == 200.0 and probe.first_steps_s == 0.0  # a size the probe ran starts warm
    cold = plancheck.forecast(work, 4, 200.0, {}, False, 4.6, 10, 1.0, 1)
    assert cold.first_steps_s == pytest.approx(4.6 * 100 / 200)  # 4.6 micro batches of 100 positions at 200/s
    last = {4: {"positions_per_s": 120.0, "predicted_positions_per_s": 200.0, "first_steps_s": 1.5, "warm": False}}
    learned = plancheck.forecast(work, 4, 200.0, last, False, 4.6, 10, 1.0, 1)
    assert learned.positions_per_s == 120.0 and learned.first_steps_s == 1.5
    assert "last run at micro 4" in learned.speed_from and "0.60x off: corrected" in learned.speed_from
    # several runs of the size: their median (a VM's runs drift by up to a quarter), the last one's miss said
    runs = {4: {**last[4], "runs": [300.0, 420.0, 120.0]}}
    median = plancheck.forecast(work, 4, 200.0, runs, False, 4.6, 10, 1.0, 1)
    assert median.positions_per_s == 300.0
    assert median.speed_from == ("the median of what the last 3 runs at micro 4 trained at on this machine (120-420 a "
                                 "second) (the last was predicted 200 a second and trained 0.60x that)")
    # the machine measures faster now than when those runs trained (their processes' probes at the size: 100, 90,
    # none): scaled by the probes' ratio beyond 15% (200 / 95 = 2.11), not within it, nor by a size not probed now
    drift = {4: {**runs[4], "probes": [100.0, 90.0, None]}}
    scaled = plancheck.forecast(work, 4, 200.0, drift, True, 4.6, 10, 1.0, 1)
    assert scaled.positions_per_s == pytest.approx(300.0 * 200 / 95)
    assert (" x 2.11: the probe measured 200 a second at this size now against 95 when they trained"
            in scaled.speed_from)
    assert plancheck.forecast(work, 4, 105.0, drift, True, 4.6, 10, 1.0, 1).positions_per_s == 300.0
    assert plancheck.forecast(work, 4, 200.0, drift, False, 4.6, 10, 1.0, 1).positions_per_s == 300.0
    # one earlier probe, or earlier probes that disagree by more than 15% (100 and 60), are a probe's noise: kept
    for probes in ([100.0, None, None], [100.0, 60.0, None]):
        lone = plancheck.forecast(work, 4, 200.0, {4: {**runs[4], "probes": probes}}, True, 4.6, 10, 1.0, 1)
        assert lone.positions_per_s == 300.0 and " x " not in lone.speed_from


def _known(first_steps):
    outcome = Recorded("SmolLM2-135M", 134515008, 30, "lora", 128, 4, {}, {4: 892.0, 8: 981.0}, None, first_steps)
    return Known(Record("amx-bf16", "amx", "bf16", 2, "", "", (outcome,)), outcome, ())


@pytest.mark.parametrize("run_tokens, first_steps, chosen", [
    (9000, 4.6, 4),  # a short run: micro 8's ~10% is ~1.2 s, its cold first steps ~5 s: the measured 4 wins
    (900000, 4.6, 8),  # a long one repays measuring it
    (9000, None, 8),  # a class with no first-steps figure on record chooses as before
])
def test_a_predicted_micro_batch_must_repay_its_first_steps(run_tokens, first_steps, chosen):
    """AMX's compare: micro 4 measured at 666 tokens/s (3 micro batches of 512 tokens in 2.3 s), micro 8 predicted
    1.10x from the record and never run."""
    def step(size):
        return {1: 300.0, 2: 500.0, 4: 666.0, 8: 733.0}[size], 1000.0 * size / 4

    result = batch.probe(step, [1, 2, 4, 8], 1e9, 500.0, lambda e: False, Budget(run_tokens), _known(first_steps),
                         {4: (666.0, 1000.0, 2.3)})
    assert result.micro_batch_size == chosen
    if chosen == 4 and first_steps:
        assert "its first steps would cost ~" in result.reason and "4.6 micro batches of it on record" in result.reason


def test_a_run_prints_its_plan_against_what_happened_and_the_next_run_predicts_from_it(tmp_path, dataset, capsys,
                                                                                        monkeypatch):
    """At auto's micro batch: the check is printed and kept in summary.json, the positions the plan counted are
    the ones the run trained (no data difference), the steady speed is what the next run of the shape predicts
    from, and tokens_per_s is over the clock the closing line names."""
    from conftest import tiny_run_config
    from tunebench.jobs import finetune
    from tunebench.machine.monitor import CoreShare

    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))  # an empty cache of its own
    # the suite's other worker shares these cores, and a run they were shared in teaches nothing: the share measured,
    # then read as none, so that what is tested here is the learning (the one below tests the measuring)
    real, seen = CoreShare.shared, []
    monkeypatch.setattr(CoreShare, "shared", lambda self: seen.append(real(self)) or 0.0)
    fit, fitted = plancheck.call_cost, []  # what the plan costed a micro batch from: the probe's sizes
    monkeypatch.setattr(plancheck, "call_cost", lambda speeds, rows, micro: fitted.append(
        (speeds, micro, fit(speeds, rows, micro))) or fitted[-1][2])
    summary = finetune.run(tiny_run_config(dataset, tmp_path / "a", **{"batch.micro_batch_size": "auto"}))
    out = capsys.readouterr().out
    c = summary["plan_check"]
    assert "plan against the run" in out and "  time to train      predicted " in out
    assert c["difference_s"]["data"] == 0.0  # the plan collated the run's own batches
    assert c["peak_memory_mb"]["predicted"] == pytest.approx(summary["memory_plan_mb"], abs=0.1)
    assert c["train_time_s"]["measured"] == pytest.approx(summary["train_time_s"], abs=0.01)
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["plan_check"] == c
    closing = [line for line in out.splitlines() if " steps in " in line][-1]
    assert f"real tokens/s over {summary['steady_time_s']:.1f}s of steps after the first 2" in closing
    logged = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    at_two = next(r["tokens"] for r in logged if r.get("step") == 2 and "loss" in r)
    steady, clock = summary["tokens"] - at_two, summary["steady_time_s"]  # the clock is rounded to the millisecond
    assert steady / (clock + 0.0005) <= summary["tokens_per_s"] <= steady / max(clock - 0.0005, 1e-9)

    from tunebench.jobs import run_report

    report = (run_report.write(tmp_path / "a").parent / "report.md").read_text()  # the run's report shows it too
    assert "## Plan against the run" in report and f"| peak memory (MB) | {c['peak_memory_mb']['predicted']:,.4g} |" \
        in report and "| difference by cause: data (s) |  | +0.0 |  |" in report

    first_plan = {d["setting"]: d for d in json.loads((tmp_path / "a" / "plan.json").read_text())["decisions"]}
    reason, (speeds, micro, calls) = first_plan["time_estimate"]["reason"], fitted[0]
    assert micro in speeds  # the sweep's sizes reach the plan's cost of a micro batch (one size: the test below's)
    assert (f"{calls.probes}: {1000 * calls.fixed_s:,.0f} ms a micro batch whatever its width" if calls else
            "the probe's forward and backward at ") in reason and "and an optimizer step (" in reason

    assert len(seen) == 1 and 0.0 <= seen[0] <= 1.0 and c["cores_shared"] == 0.0  # measured on every CPU run (Linux)

    capsys.readouterr()
    monkeypatch.setattr(CoreShare, "shared", lambda self: 0.5)  # the second run's cores half taken by another process
    finetune.run(tiny_run_config(dataset, tmp_path / "b", **{"batch.micro_batch_size": "auto"}))
    plan = {d["setting"]: d for d in json.loads((tmp_path / "b" / "plan.json").read_text())["decisions"]}
    micro = plan["micro_batch_size"]["value"]
    assert f"what the last run at micro {micro} trained at on this machine" in plan["time_estimate"]["reason"]
    assert f"{c['steady_positions_per_s']['measured']:,.0f} a second" in plan["time_estimate"]["reason"]
    assert "  cores shared       50% of the core time the steps needed went to other processes or the host: its " \
        "speed is not kept as this shape's record (over 20%)" in capsys.readouterr().out
    from tunebench.training.autotune import cache_file

    records = [v for k, v in json.loads(cache_file().read_text()).items() if k.startswith("trained|")]
    assert [r["micro"][str(micro)]["runs"] for r in records] == [[c["steady_positions_per_s"]["measured"]]]  # b's not
    assert len(records[0]["micro"][str(micro)]["probes"]) == 1  # with what its process's probe measured, if any
    kind = plancheck.machine_key(Key("batch", {})).kind  # the machine's probe-to-run record, by its current name
    ratios = [v for k, v in json.loads(cache_file().read_text()).items() if k.startswith(kind + "|")]
    assert [list(r["by_micro"]) for r in ratios] == [[str(micro)]]  # a's trained over probed, kept at its micro batch


def test_the_share_of_a_runs_cores_others_took_is_what_stayed_neither_idle_nor_its_own():
    """Hand-computed from the kernel's counters: 2 threads on 2 CPUs for 10 s need 20 CPU-seconds; 1 idle and 9 of
    the run's own leave 10 that went elsewhere (half); on 64 CPUs with 320 idle nothing waited; a VM whose host
    stole 4 of the 20 (neither idle nor ours) shared a fifth."""
    from tunebench.machine.monitor import CoreShare

    def share(threads, cpus, idle, own, ranks=1):
        c = CoreShare(threads, ranks)
        c._cpus, c._start = list(range(cpus)), (100.0, 50.0, 7.0)
        c._read = lambda: (110.0, 50.0 + idle, 7.0 + own)
        return c.shared()

    assert share(2, 2, idle=1.0, own=9.0) == 0.5
    assert share(2, 64, idle=320.0, own=20.0) == 0.0
    assert share(2, 2, idle=0.0, own=16.0) == 0.2
    assert share(2, 4, idle=2.0, own=19.0, ranks=2) == 0.0  # two alike ranks of 2 threads: 2 + 2 x 19 of 40 needed
    assert share(2, 4, idle=0.0, own=5.0, ranks=2) == 0.75


def test_runs_that_trained_two_micro_batches_choose_the_faster(tmp_path, monkeypatch):
    """What whole runs of a shape trained beats the probe's pick, by 5% or more and beyond the runs' noise (two runs
    a size, the faster's slowest above the other's fastest); a size no run trained, or one that does not divide the
    effective batch, is not taken."""
    from tunebench.core.decision import Decision
    from tunebench.training import runplan

    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path))
    key = Key("batch", {"model": "m"})
    picked = [Decision("micro_batch_size", 4, "fastest measured"), Decision("gradient_checkpointing", False, "")]
    assert runplan.trained_faster(4, picked, 100.0, key, 8, 100, {}) == (4, picked, 100.0)  # nothing learned yet

    def trained(micro, speed):
        plancheck.learn(plancheck.trained_key(key), micro, {
            "steady_positions_per_s": {"measured": speed, "predicted": 250.0}, "first_steps_s": {"measured": 0.0},
            "speed_from": "the probe"}, True)

    trained(4, 300.0), trained(2, 360.0), trained(3, 900.0)
    micro, rows, speed = runplan.trained_faster(4, picked, 100.0, key, 8, 100, {2: (110.0, 1.0, 1.0)})
    assert (micro, speed, rows[1]) == (4, 100.0, picked[1])  # one run a size: within a run's noise
    assert rows[0].reason == ("fastest measured; kept over micro 2, which trained 1.20x it on this machine (360 "
                              "against 300 positions/s): one run is within a run's noise")
    trained(4, 340.0), trained(2, 330.0)
    assert runplan.trained_faster(4, picked, 100.0, key, 8, 100, {})[0] == 4  # medians 345 and 320: 4 is faster
    trained(2, 420.0)
    micro, rows, _ = runplan.trained_faster(4, picked, 100.0, key, 8, 100, {})
    assert micro == 4 and "their runs overlap" in rows[0].reason  # 2's median 360 is 1.13x, but its 330 < 4's 340
    trained(2, 400.0), trained(2, 390.0)  # micro 2 keeps its last five: 360, 330, 420, 400, 390 (3 is not a divisor)
    micro, rows, speed = runplan.trained_faster(4, picked, 100.0, key, 8, 100, {2: (110.0, 1.0, 1.0)})
    assert micro == 4  # 330 is still among 2's runs
    trained(2, 410.0)  # now 330, 420, 400, 390, 410: the oldest (360) dropped
    micro, rows, speed = runplan.trained_faster(4, picked, 100.0, key, 8, 100, {2: (110.0, 1.0, 1.0)})
    assert micro == 4  # 330 <= 340
    trained(2, 405.0)  # 420, 400, 390, 410, 405: slowest 390 > 340
    micro, rows, speed = runplan.trained_faster(4, picked, 100.0, key, 8, 100, {2: (110.0, 1.0, 1.0)})
    assert (micro, speed) == (2, 110.0) and rows[1] == picked[1]  # the probe's figure for 2
    assert ("trained fastest on this machine: 405 positions/s at micro 2 (390-420 in 5 runs), 1.27x the 320 at "
            "micro 4 (300-340), which the probe picked (fastest measured)") in rows[0].reason


def test_what_runs_on_a_machine_trained_against_their_probes_corrects_the_next_shapes_probe(tmp_path, monkeypatch):
    """A new shape of a method this machine has trained predicts from its probe times the median of the last
    runs' ratios of trained to probed speed (a LoRA run here trained 1.14-1.22x what its probe measured);
    another method or machine keeps the probe's figure."""
    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path))
    lora = Key("batch", {"where": "CPU x2", "precision": "fp32", "torch": "2.13", "method": "lora", "model": "a"})
    other_shape = Key("batch", {**lora.fields, "model": "b"})
    full = Key("batch", {**lora.fields, "method": "full"})
    assert plancheck.machine_key(lora) == plancheck.machine_key(other_shape) != plancheck.machine_key(full)
    assert plancheck.probe_ratio(plancheck.machine_key(lora)) is None
    for measured in (116.0, 120.0, 130.0):
        plancheck.learn_ratio(plancheck.machine_key(lora), {"steady_positions_per_s": {"measured": measured}}, 100.0)
    ratio = plancheck.probe_ratio(plancheck.machine_key(other_shape))
    assert ratio == (1.2, 3, 1.16, 1.3, None)
    f = plancheck.forecast(Work(1000.0, 900.0), 4, 100.0, {}, True, None, 10, 1.0, 1, ratio)
    assert f.positions_per_s == pytest.approx(120.0) and "x 1.20, what the last 3 run(s)" in f.speed_from
    assert plancheck.probe_ratio(plancheck.machine_key(full)) is None
    # one run corrects nothing, nor runs that disagree (a cold first probe read 1.70x, the next runs 0.72x, 1.32x)
    for measured in (170.0, 72.0, 132.0):
        plancheck.learn_ratio(plancheck.machine_key(full), {"steady_positions_per_s": {"measured": measured}}, 100.0)
        ratio = plancheck.probe_ratio(plancheck.machine_key(full))
        f = plancheck.forecast(Work(1000.0, 900.0), 4, 100.0, {}, True, None, 10, 1.0, 1, ratio)
        assert ratio[0] is None and f.positions_per_s == 100.0 and "not corrected: the last" in f.speed_from


def test_the_probe_ratio_is_taken_at_the_runs_micro_batch_where_two_runs_there_agree(tmp_path, monkeypatch):
    """Runs at micro 1 trained below their probes and runs at micro 4 above (a 2-core Xeon: medians 0.89 and 1.07):
    each size corrects by its own; a size with fewer than two runs by the pool of every size."""
    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path))
    key = plancheck.machine_key(Key("batch", {"where": "CPU x2", "precision": "fp32", "torch": "2.13",
                                              "method": "lora"}))
    for micro, measured in ((1, 88.0), (4, 106.0), (1, 90.0), (4, 108.0), (2, 120.0)):
        plancheck.learn_ratio(key, {"steady_positions_per_s": {"measured": measured}}, 100.0, micro)
    assert plancheck.probe_ratio(key, 1) == (0.89, 2, 0.88, 0.9, 1)
    assert plancheck.probe_ratio(key, 4) == (1.07, 2, 1.06, 1.08, 4)
    pooled = plancheck.probe_ratio(key, 2)  # one run at 2: the five at every size (median 1.06; 0.88, 0.90 too far)
    assert pooled == (1.08, 3, 0.88, 1.2, None)
    f = plancheck.forecast(Work(1000.0, 900.0), 1, 100.0, {}, True, None, 10, 1.0, 1, plancheck.probe_ratio(key, 1))
    assert f.positions_per_s == pytest.approx(89.0)
    assert "x 0.89, what the last 2 run(s) at micro 1 on this machine trained at" in f.speed_from


def test_the_plans_speed_adds_an_optimizer_step_to_the_probes_forward_and_backward():
    """The probe times no optimizer step: the plan adds one, timed, per optimizer step of the run's positions."""
    speed, what = plancheck.with_optimizer(100.0, Work(1000.0, 900.0), steps=5, optimizer_s=0.5)
    assert speed == pytest.approx(200 / (200 / 100 + 0.5))  # 200 positions a step: 2 s of them, 0.5 s of optimizer
    assert what == "the probe's forward and backward at the widest rows (100 a second) and an optimizer step (500 ms)"


def test_a_micro_batch_costs_a_fixed_part_and_a_part_per_position_fitted_to_two_probed_sizes():
    """Hand-computed: rows 100 positions wide; micro 2 at 250 a second is 0.8 s for 200 positions, micro 4 at 300 is
    1.333 s for 400: 2.667 ms a position and 0.267 s whatever the width. 20 micro batches of 50 positions on
    average then take 20 x 0.267 + 1000 x 0.00267 = 8 s, and 5 optimizer steps of 0.5 s: 1000 / 10.5 a second,
    where the widest rows' speed alone said 300. Micro 1, with no smaller size, is fitted with the next larger."""
    import torch

    def rows(size):
        return {"input_ids": torch.zeros(size, 100, dtype=torch.long), "attention_mask": torch.ones(size, 100)}

    speeds = {1: 200.0, 2: 250.0, 4: 300.0}
    calls = plancheck.call_cost(speeds, rows, 4)
    assert calls.probes.startswith("at micro 2 and 4 ") and calls.fixed_s == pytest.approx(0.8 / 3) and \
        calls.per_position_s == pytest.approx(0.8 / 300)
    speed, what = plancheck.with_optimizer(300.0, Work(1000.0, 900.0, 0, 20), steps=5, optimizer_s=0.5, calls=calls)
    assert speed == pytest.approx(1000 / 10.5)
    assert what == ("the probe's forward and backward at micro 2 and 4 of the widest rows (250 and 300 a second: "
                    "267 ms a micro batch whatever its width and 2.67 ms a position, over the run's 20 of 50 positions "
                    "on average) and an optimizer step (500 ms)")
    full, _ = plancheck.with_optimizer(300.0, Work(4000.0, 4000.0, 0, 10), steps=10, optimizer_s=0.0, calls=calls)
    assert full == pytest.approx(300.0)  # batches as wide as the probe's train at its speed
    one = plancheck.call_cost(speeds, rows, 1)
    assert one.probes.startswith("at micro 1 and 2 ") and one.fixed_s == pytest.approx(0.2) and one.per_position_s == pytest.approx(0.003)
    assert plancheck.call_cost({4: 300.0}, rows, 4) is None  # one size: nothing to fit
    assert plancheck.call_cost({1: 100.0, 2: 300.0}, rows, 1) is None  # twice the rows in less time: noise
    assert plancheck.call_cost({1: 300.0, 2: 200.0}, rows, 2) is None  # dearer a position when larger: no fixed part


def test_a_micro_batch_asked_for_is_costed_at_the_runs_own_width_by_one_more_probe(tmp_path, dataset, monkeypatch):
    """Micro 1 asked for: no second size was probed, so the plan probes once more at rows as wide as the run's micro
    batches are on average (narrower than the widest), and costs each of them from the two probes."""
    from conftest import tiny_run_config
    from tunebench.jobs import finetune

    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))
    long = {"instruction": "tell me everything", "response": " ".join(["and then some more words"] * 12)}
    with dataset.open("a") as f:  # long rows among short ones (some held out): the run's average under the widest
        f.write(3 * (json.dumps(long) + "\n"))
    real, seen = plancheck.width_cost, []
    monkeypatch.setattr(plancheck, "width_cost", lambda micro, wide, fast, narrow, slow: seen.append(
        (micro, wide["input_ids"].shape, narrow["input_ids"].shape, real(micro, wide, fast, narrow, slow))) or seen[-1][3])
    finetune.run(tiny_run_config(dataset, tmp_path / "a", **{"batch.micro_batch_size": 1, "schedule.max_steps": 12}))
    [(micro, wide, narrow, calls)] = seen
    assert micro == 1 and wide[0] == narrow[0] == 1 and narrow[1] < 0.85 * wide[1]
    plan = {d["setting"]: d for d in json.loads((tmp_path / "a" / "plan.json").read_text())["decisions"]}
    assert f"at micro 1 of the widest rows and of rows {narrow[1]} wide (" in plan["time_estimate"]["reason"]


def test_where_no_line_fits_the_two_probes_their_positions_over_their_time_is_the_plans():
    """Hand-computed: micro 2 of rows 100 wide at 200 a second is 1 s for 200 positions; of rows 50 wide at 250,
    0.4 s for 100: the line's part paid whatever the width would be below 0 (the probes' noise), so the run's
    positions are costed at both probes' 1.4 s over 300 positions: 1,000 of them in 4.67 s, 214 a second. The same
    where the narrow rows took longer than the widest (1.2 s)."""
    import torch

    def rows(size, width):
        return {"input_ids": torch.zeros(size, width, dtype=torch.long), "attention_mask": torch.ones(size, width)}

    calls = plancheck.width_cost(2, rows(2, 100), 200.0, rows(2, 50), 250.0)
    assert calls.fixed_s == 0.0 and calls.per_position_s == pytest.approx(1.4 / 300)
    speed, what = plancheck.with_optimizer(200.0, Work(1000.0, 900.0, 0, 10), steps=5, optimizer_s=0.0, calls=calls)
    assert speed == pytest.approx(300 / 1.4)
    assert what.startswith("the probe's forward and backward at micro 2 of the widest rows and of rows 50 wide (200 "
                           "and 250 a second; no line fits the two, so their positions over their time: 4.67 ms a "
                           "position, over the run's 10 of 100 positions on average)")
    slower = plancheck.width_cost(2, rows(2, 100), 200.0, rows(2, 50), 100 / 1.2)
    assert slower.fixed_s == 0.0 and slower.per_position_s == pytest.approx(2.2 / 300)
    fitted = plancheck.width_cost(2, rows(2, 100), 200.0, rows(2, 50), 150.0)  # 0.667 s for 100: a line
    assert fitted.fixed_s == pytest.approx(1 / 3) and fitted.per_position_s == pytest.approx(1 / 300)


def test_one_probed_size_is_costed_with_the_records_ratio_of_the_next_smaller():
    """Hand-computed: rows 100 wide; micro 4 probed at 300 a second (1.333 s for 400 positions), the record's micro
    1 at 0.5x micro 4 (150 a second: 0.667 s for 100): 2.22 ms a position and 0.444 s whatever the width. 20 micro
    batches of 50 positions then take 20 x 0.444 + 1000 x 0.00222 = 11.1 s: 90 a second."""
    import torch

    def rows(size):
        return {"input_ids": torch.zeros(size, 100, dtype=torch.long), "attention_mask": torch.ones(size, 100)}

    calls = plancheck.record_cost(4, 300.0, {1: 0.5, 8: 1.1}, rows, "AMX bf16 machines (...)")
    assert calls.fixed_s == pytest.approx(4 / 9) and calls.per_position_s == pytest.approx(1 / 450)
    assert calls.probes == ("at micro 4 of the widest rows, with micro 1 at 0.50x it as the record of AMX bf16 "
                            "machines (...) has it (300 and 150 a second")
    speed, _ = plancheck.with_optimizer(300.0, Work(1000.0, 900.0, 0, 20), steps=5, optimizer_s=0.0, calls=calls)
    assert speed == pytest.approx(90.0)
    assert plancheck.record_cost(1, 150.0, {4: 2.0}, rows, "").fixed_s == pytest.approx(4 / 9)  # else the larger
    assert plancheck.record_cost(4, 300.0, {}, rows, "") is None  # no other size on record


def test_a_run_that_probed_one_size_costs_its_micro_batches_with_the_class_records_ratio(tmp_path, dataset,
                                                                                        monkeypatch):
    """Micro 2 asked for, and a class record of the run's own shape: the plan's second size is the record's micro 1,
    at its ratio to micro 2, and the time estimate says so; no probe at the run's own width is taken (its first calls
    at a new width cost more measuring than its budget counted)."""
    from conftest import tiny_run_config
    from tunebench.jobs import finetune
    from tunebench.jobs.parts import recipe
    from tunebench.training.autotune import known

    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(recipe, "narrow_cost", lambda *args: pytest.fail("a probe at the run's own width was taken"))
    outcome = Recorded("tiny", 1000, 2, "lora", 256, 2, {}, {1: 600.0, 2: 1000.0}, None, None)
    record = Known(Record("avx2-fp32", "avx2", "fp32", 2, "", "", (outcome,)), outcome, (), same_shape=True)
    monkeypatch.setattr(known, "for_run", lambda *args: record)
    finetune.run(tiny_run_config(dataset, tmp_path / "a"))
    plan = {d["setting"]: d for d in json.loads((tmp_path / "a" / "plan.json").read_text())["decisions"]}
    assert f"at micro 2 of the widest rows, with micro 1 at 0.60x it as the record of {record.source} has it (" in \
        plan["time_estimate"]["reason"]


def test_the_optimizer_step_is_timed_on_a_sample_and_scaled_to_the_trainable_count(monkeypatch):
    import torch

    monkeypatch.setattr(plancheck, "OPTIMIZER_SAMPLE", 1000)
    small = plancheck.optimizer_step_s(1000, torch.device("cpu"))
    assert 0 < small < 1 and plancheck.optimizer_step_s(10**9, torch.device("cpu")) > 100 * small
