"""`tunebench report RUN_DIR`: the picture of one run. Its loss (train and eval), learning rate and
tokens/s by step (metrics.jsonl); CPU, RAM and, where present, GPU use over time (monitor.jsonl); the
memory report; every setting with the reason it was chosen (plan.json); and the summary (summary.json).
Written as report.md and a self-contained report.html, as compare's report is."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path
from typing import Any

from tunebench.core.durable import atomic_file, open_no_follow
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import read_json, records
from tunebench.jobs import report
from tunebench.settings.objectives import Objective
from tunebench.settings.rundir import RunDir


def is_run(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "metrics.jsonl").is_file()


def _line_chart(series: list[tuple[str, list[float], list[float], dict]], title: str, xlabel: str, ylabel: str,
                twin: list[tuple[str, list[float], list[float], dict]] = (), twin_label: str = "") -> bytes | None:
    if not any(xs for _, xs, _, _ in series):
        return None
    plt = report.figure()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, xs, ys, style in series:
        if xs:
            ax.plot(xs, ys, label=label, **style)
    ax.ticklabel_format(axis="y", useOffset=False)  # 5.5443 reads as itself, not as +5.544 and 0.0003
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if twin:
        other = ax.twinx()
        for label, xs, ys, style in twin:
            if xs:
                other.plot(xs, ys, label=label, **style)
        other.set_ylabel(twin_label)
        h2, l2 = other.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="best")
    return report.png(fig)


def charts(metrics: list[dict], monitor: list[dict], objective: Objective | None = None
           ) -> list[tuple[str, str, bytes]]:
    """(name, caption, PNG) of every chart the run's records allow: the loss, learning rate, throughput, CPU and
    memory charts of every run, and `objective`'s own (the sets its type names, OBJECTIVE_CHARTS)."""
    steps = [r for r in metrics if "loss" in r and "step" in r]
    evals = [r for r in metrics if "eval_loss" in r]
    t0 = monitor[0]["time"] if monitor else 0.0
    at = [r["time"] - t0 for r in monitor]
    # gpuN only: a chart's name is a file name and an HTML id, and monitor.jsonl is a file anyone may edit
    gpus = sorted({k.split("_")[0] for r in monitor for k in r
                   if re.fullmatch(r"gpu\d+_util_percent", k)}, key=lambda g: int(g[3:]))
    out = [
        ("loss", "Training loss per step, and eval loss where it was measured", _line_chart(
            [("train loss", [r["step"] for r in steps], [r["loss"] for r in steps], {}),
             ("eval loss", [r["step"] for r in evals], [r["eval_loss"] for r in evals],
              {"marker": "o", "linestyle": "--"})],
            "Loss", "optimizer step", "loss")),
        ("learning_rate", "The learning rate each step used", _line_chart(
            [("lr", [r["step"] for r in steps if "lr" in r], [r["lr"] for r in steps if "lr" in r], {})],
            "Learning rate", "optimizer step", "lr")),
        ("tokens_per_s", "Real (non-padding) tokens per second, step by step", _line_chart(
            [("tokens/s", [r["step"] for r in steps if r.get("tokens_per_s")],
              [r["tokens_per_s"] for r in steps if r.get("tokens_per_s")], {})],
            "Throughput", "optimizer step", "tokens/s")),
        ("cpu", "CPU use over the run: all CPUs (100% = every core busy) and this process (100% = one core)",
         _line_chart([("all CPUs %", at, [r.get("cpu_percent", 0) for r in monitor], {}),
                      ("this process %", at, [r.get("process_cpu_percent", 0) for r in monitor], {})],
                     "CPU", "seconds", "%")),
        ("memory", "Memory over the run: this process's resident memory (RSS, which counts the memory-mapped "
                   "weights) and the system's RAM in use (psutil's 'used': without the file cache those pages "
                   "live in, so it can sit below the RSS)",
         _line_chart([("process RSS MB", at, [r.get("process_rss_mb", 0) for r in monitor], {}),
                      ("system RAM used MB", at, [r.get("ram_used_mb", 0) for r in monitor], {})],
                     "Memory", "seconds", "MB")),
    ]
    # the objective's own charts after the loss
    own = objective.charts if objective else ()
    out[1:1] = [chart for name in own for chart in OBJECTIVE_CHARTS[name](steps, evals)]
    for g in gpus:
        out.append((f"{g}", f"{g.upper()}: utilisation and memory over the run", _line_chart(
            [("utilisation %", at, [r.get(f"{g}_util_percent", 0) for r in monitor], {})], g.upper(), "seconds", "%",
            twin=[("memory MB", at, [r.get(f"{g}_memory_mb", 0) for r in monitor], {"color": "tab:red"})],
            twin_label="MB")))
    return [(name, caption, png) for name, caption, png in out if png]


def _preference_charts(steps: list[dict], evals: list[dict]) -> list[tuple[str, str, bytes | None]]:  # DPO, ORPO
    """A DPO or ORPO run's reward accuracy (per step and held out) and margin."""
    rewarded = [r for r in steps if "rewards/accuracies" in r]
    if not rewarded:
        return []
    held = [r for r in evals if "eval_rewards/accuracies" in r]
    return [("rewards", "Preference runs: the share of pairs whose chosen reply gets the higher reward, per step and on "
                        "the held-out pairs, and the mean reward margin per step",
             _line_chart([("train reward accuracy", [r["step"] for r in rewarded],
                           [r["rewards/accuracies"] for r in rewarded], {}),
                          ("eval reward accuracy", [r["step"] for r in held],
                           [r["eval_rewards/accuracies"] for r in held], {"marker": "o", "linestyle": "--"})],
                         "Rewards", "optimizer step", "accuracy",
                         twin=[("margin", [r["step"] for r in rewarded], [r["rewards/margins"] for r in rewarded],
                                {"color": "tab:red"})], twin_label="margin"))]


def _kto_charts(steps: list[dict], evals: list[dict]) -> list[tuple[str, str, bytes | None]]:
    """A KTO run's implied rewards of each kind of completion, and its KL reference point."""
    judged = [r for r in steps if "kl" in r]
    if not judged:
        return []
    return [("kto", "KTO: the mean implied reward of the desirable and the undesirable completions, and the KL "
                    "reference point",
             _line_chart([(label, [r["step"] for r in judged if key in r], [r[key] for r in judged if key in r], {})
                          for label, key in (("desirable", "rewards/chosen"), ("undesirable", "rewards/rejected"))],
                         "Rewards", "optimizer step", "reward",
                         twin=[("KL", [r["step"] for r in judged], [r["kl"] for r in judged], {"color": "tab:red"})],
                         twin_label="KL"))]


def _sampled_charts(steps: list[dict], evals: list[dict]) -> list[tuple[str, str, bytes | None]]:
    """A GRPO or RFT run's charts from its steps' records: rewards, completions and KL, episodes, and what shows a
    collapse as it happens (training/grpo/watch.py): the sampling's entropy, and each kind's reward and informative
    groups."""
    sampled = [r for r in steps if "reward" in r]
    if not sampled:
        return []
    names = sorted({k for r in sampled for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    x = [r["step"] for r in sampled]
    out = [("grpo_rewards", "GRPO: the mean reward of each step's completions (weighted sum) and each reward "
                            "function's, with the share of groups whose rewards do not differ (they teach nothing)",
            _line_chart([("reward", x, [r["reward"] for r in sampled], {}),
                         *[(n[len("rewards/"):-len("/mean")], [r["step"] for r in sampled if n in r],
                            [r[n] for r in sampled if n in r], {"linestyle": "--"}) for n in names]],
                        "Rewards", "optimizer step", "reward",
                        twin=[("zero-spread groups", x, [r["frac_reward_zero_std"] for r in sampled],
                               {"color": "tab:gray", "linestyle": ":"})], twin_label="share")),
           ("grpo_kl", "GRPO: the completions' mean length in tokens, and the KL from the reference (0 when beta "
                       "is 0)",
            _line_chart([("completion tokens", x, [r["completions/mean_length"] for r in sampled], {})],
                        "Completions", "optimizer step", "tokens",
                        twin=[("KL", [r["step"] for r in sampled if "kl" in r], [r["kl"] for r in sampled if "kl" in r],
                               {"color": "tab:red"})], twin_label="KL"))]  # RFT has no reference: no KL
    played = [r for r in sampled if "episodes/turns" in r]
    if played:  # GRPO in an environment
        ran = [(r["step"], r["episodes/calls_ok"]) for r in played if r.get("episodes/calls_ok") is not None]
        out.append(("grpo_episodes", "GRPO in an environment: turns and tool calls per episode, step by step, and "
                                     "the share of calls that ran without error",
                    _line_chart([("turns", [r["step"] for r in played], [r["episodes/turns"] for r in played], {}),
                                 ("calls", [r["step"] for r in played], [r["episodes/calls"] for r in played],
                                  {"linestyle": "--"})],
                                "Episodes", "optimizer step", "per episode",
                                twin=[("calls that ran", [s for s, _ in ran], [v for _, v in ran],
                                       {"color": "tab:green", "linestyle": ":"})], twin_label="share")))
    return out + _collapse_charts(sampled)


def _collapse_charts(sampled: list[dict]) -> list[tuple[str, str, bytes | None]]:
    """The sampling's entropy step by step, and each kind's training reward with the share of its groups that
    taught anything (--kind-column): a kind whose groups stop teaching, or an entropy that falls, is a collapse."""
    series = lambda key: ([r["step"] for r in sampled if r.get(key) is not None],  # noqa: E731
                          [r[key] for r in sampled if r.get(key) is not None])
    out = [("grpo_entropy", "GRPO: the entropy of the policy's sampling distribution at the tokens it sampled "
                            "(nats, a completion's mean), and at each turn's first token, where a way of answering "
                            "is chosen",
            _line_chart([("entropy a token", *series("entropy"), {}),
                         ("first token of a turn", *series("entropy/first_token"), {"linestyle": "--"})],
                        "Entropy", "optimizer step", "nats"))]
    kinds = sorted({k[len("kinds/"):-len("/reward")] for r in sampled for k in r
                    if k.startswith("kinds/") and k.endswith("/reward")})
    if kinds:
        out.append(("grpo_kinds", "GRPO by kind (--kind-column): each kind's mean training reward (solid) and the "
                                  "share of its groups that taught anything (dotted, right axis); a kind whose "
                                  "groups stop teaching at a low reward has collapsed",
                    _line_chart([(k, *series(f"kinds/{k}/reward"), {}) for k in kinds], "Reward by kind",
                                "optimizer step", "reward",
                                twin=[(f"{k} informative", *series(f"kinds/{k}/informative"), {"linestyle": ":"})
                                      for k in kinds], twin_label="share of groups")))
    return out



# an objective type's own chart sets (settings/objectives.py: each type's `charts`), each (steps, evals) -> charts
OBJECTIVE_CHARTS = {"preference": _preference_charts, "judgements": _kto_charts, "sampled": _sampled_charts}

def memory_report(summary: dict, plan: dict, monitor: list[dict]) -> list[list[str]]:
    """The hardware guide's MemoryTracker.report(): current (at the end), peak, total, utilisation."""
    hw = plan.get("hardware", {})
    total = hw.get("ram_total_mb")
    rows = []
    if monitor:
        last = monitor[-1]
        peak_rss = max(r.get("process_rss_mb", 0) for r in monitor)
        peak_ram = max(r.get("ram_used_mb", 0) for r in monitor)
        rows += [["process RSS", f"{last.get('process_rss_mb', 0):,.0f} MB", f"{peak_rss:,.0f} MB",
                  f"{total:,.0f} MB" if total else "", f"{100 * peak_rss / total:.1f}%" if total else ""],
                 ["system RAM used", f"{last.get('ram_used_mb', 0):,.0f} MB", f"{peak_ram:,.0f} MB",
                  f"{total:,.0f} MB" if total else "", f"{100 * peak_ram / total:.1f}%" if total else ""]]
        for g in hw.get("gpus", []):
            key = f"gpu{g['index']}_memory_mb"
            if any(key in r for r in monitor):
                peak = max(r.get(key, 0) for r in monitor)
                rows.append([f"GPU {g['index']} ({g['name']})", f"{last.get(key, 0):,.0f} MB", f"{peak:,.0f} MB",
                             f"{g['memory_mb']:,.0f} MB", f"{100 * peak / g['memory_mb']:.1f}%"])
    if summary.get("peak_memory_mb") is not None:
        rows.append(["training loop peak (summary.json)", "", f"{summary['peak_memory_mb']:,.0f} MB", "", ""])
    return rows


def plan_check_rows(check: dict | None) -> list[list[str]]:
    """summary.json's plan_check as rows: each figure the plan predicted beside what the run measured, then the
    training time's difference by cause and the evaluations' and checkpoints' time."""
    if not check:
        return []
    names = {"train_time_s": "time to train (s)", "steady_tokens_per_s": "steady tokens/s",
             "first_steps_s": "first steps' extra (s)", "seconds_a_step": "seconds a step (median, later half)",
             "peak_memory_mb": "peak memory (MB)"}
    rows = [[label, _value(check[k]["predicted"]), _value(check[k]["measured"]),
             f"{check[k]['ratio']:.2f}x" if check[k]["ratio"] is not None else ""] for k, label in names.items()
            if k in check]
    rows += [[f"difference by cause: {cause} (s)", "", f"{seconds:+.1f}", ""]
             for cause, seconds in (check.get("difference_s") or {}).items()]
    rows.append(["evaluations and checkpoints (s)", "", _value(check["evaluations_and_checkpoints_s"]), ""])
    if check.get("speed_from"):
        rows.append(["speed predicted from", check["speed_from"], "", ""])
    if check.get("cores_shared") is not None:  # others' share of the cores the steps needed (monitor.CoreShare)
        rows.append(["cores' time others took", "", f"{100 * check['cores_shared']:.0f}%", ""])
    return rows


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return "" if v is None else str(v)


def write(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    run = Path(run_dir)
    if not is_run(run):
        raise TunebenchError(f"'{run}' is not a run directory (no metrics.jsonl); pass a train or pretrain "
                             "--output-dir, or results CSVs")
    metrics, monitor = records(run / "metrics.jsonl"), records(run / "monitor.jsonl")
    finished, plan = RunDir(run).summary(), read_json(run / "plan.json")
    summary = finished.to_dict() if finished else {}
    out = Path(out_dir) if out_dir else run / "report"
    if not out_dir and out.is_symlink():  # a run directory is shared: a planted link must not aim our writes
        raise TunebenchError(f"'{out}' is a symbolic link; tunebench writes a run's report only to a folder of its "
                             "own inside the run: remove the link, or give --output-dir for the report elsewhere")
    out.mkdir(parents=True, exist_ok=True)
    pngs = charts(metrics, monitor, RunDir(run).objective())
    sections = [
        ("Plan against the run", ["figure", "predicted", "measured", "measured / predicted"],
         plan_check_rows(summary.get("plan_check"))),
        ("Memory", ["", "current (end)", "peak", "total", "peak / total"], memory_report(summary, plan, monitor)),
        ("Settings, and why", ["setting", "value", "reason"],
         [[d["setting"], _value(d["value"]), d["reason"]] for d in plan.get("decisions", [])]),
        ("Summary", ["figure", "value"], [[k, _value(v)] for k, v in summary.items() if k != "plan_check"]),
    ]
    state = "finished" if summary else "not finished (no summary.json yet): what it has logged so far"
    title = f"tunebench run: {run.resolve().name}"

    md = [f"# {title}", "", f"Run directory: {run.resolve()} ({state})", ""]
    for name, caption, png in pngs:
        with open_no_follow(out / f"{name}.png", "wb") as f:
            f.write(png)
        md += [f"![{name}]({name}.png)", "", f"*{caption}*", ""]
    for heading, head, rows in sections:
        if rows:
            md += [f"## {heading}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            md += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows] + [""]
    with atomic_file(out / "report.md") as tmp:
        tmp.write_text("\n".join(md) + "\n", encoding="utf-8")

    esc = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>",
             "body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;"
             "margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;"
             "vertical-align:top}th{background:#f0f0f0}figure{margin:1em 0}figcaption{color:#555;font-size:13px}"
             "img{max-width:100%}.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(480px,1fr));gap:1em}",
             f"</style></head><body><h1>{esc(title)}</h1><p>Run directory: <code>{esc(str(run.resolve()))}</code> "
             f"({esc(state)})</p><div class='grid'>"]
    for name, caption, png in pngs:
        parts.append(f"<figure><img id='{esc(name)}' alt='{esc(caption)}' "
                     f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
                     f"<figcaption>{esc(caption)}</figcaption></figure>")
    parts.append("</div>")
    for heading, head, rows in sections:
        if rows:
            parts.append(f"<h2>{esc(heading)}</h2><table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows]
            parts.append("</table>")
    parts.append("</body></html>")
    with atomic_file(out / "report.html") as tmp:
        tmp.write_text("\n".join(parts), encoding="utf-8")
    return out / "report.html"


def main(results: list[str], output_dir: str | None, baseline_device: str | None = None,
         baseline_config: str | None = None) -> None:
    """`tunebench report`: results CSVs into one report (default runs/report), or run directories each into
    the picture of that run (in RUN_DIR/report unless output_dir says)."""
    if not results:
        raise TunebenchError("report needs results: give CSVs (or --results_csv FILE), or a run directory")
    runs = [r for r in results if Path(r).is_dir()]
    if runs and len(runs) != len(results):
        raise TunebenchError("give results CSVs or run directories, not both")
    for r in runs:
        out = Path(output_dir) / Path(r).resolve().name if output_dir is not None else None
        print(f"report: {write(r, out).resolve()}")
    if not runs:
        html_ = report.write(results, output_dir or "runs/report", baseline_device, baseline_config)
        print(f"report: {html_.resolve()}")


RECORDS = ("config.yaml", "plan.json", "summary.json", "metrics.jsonl", "monitor.jsonl", "eval_answers.jsonl")


def send(tracking, summary: dict[str, Any], run_dir: Path, model_files: list[Path]) -> None:
    """The end of a tracked run (machine.trackers): the summary's numbers, then, to the trackers that store
    files, the run's records, its report (written here for them) and the adapter or model."""
    if not tracking.lanes:
        return
    files: dict[str, list[Path]] = {}
    if tracking.stores_files:
        report_dir = write(run_dir).parent
        files = {"run": [run_dir / n for n in RECORDS if (run_dir / n).is_file()],
                 "report": sorted(f for f in report_dir.iterdir() if f.is_file()), "model": model_files}
    tracking.finish(summary, files)
