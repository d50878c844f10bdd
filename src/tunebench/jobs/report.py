"""`tunebench report`: results CSVs from any machines -> report.html (self-contained) and report.md.

Needs no torch: a CSV written anywhere renders anywhere. Every number and every finding is
computed from the rows; repeats of one (device, configuration) are summarised by their median.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import read_jsonl
from tunebench.model import quality


@dataclass
class Run:
    row: dict[str, str]

    def num(self, key: str) -> float | None:
        value = (self.row.get(key) or "").strip()
        try:
            return float(value) if value else None
        except ValueError:
            return None

    @property
    def device(self) -> str:
        return self.row.get("device_name") or self.row.get("device") or "?"

    @property
    def config(self) -> str:
        if self.row.get("config"):
            return self.row["config"]
        label = f"bs{int(self.num('batch_size') or 0)}_ga{int(self.num('grad_accum') or 0)}"
        quant = self.row.get("quantization") or "none"
        method = self.row.get("method") or "lora"
        return label + (f"_{quant}" if quant != "none" else "") + (f"_{method}" if method not in ("lora", "qlora") else "")

    @property
    def ok(self) -> bool:
        return (self.row.get("status") or "ok") == "ok" and self.num("duration_seconds") is not None


@dataclass
class Cell:
    """The median of the repeats of one configuration on one device."""

    runs: list[Run] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        values = [v for r in self.runs if (v := r.num(key)) is not None]
        return statistics.median(values) if values else None


def read_results(paths: list[str]) -> list[Run]:
    runs: list[Run] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise TunebenchError(f"results file '{p}' not found; pass CSVs written by tunebench compare")
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "duration_seconds" not in reader.fieldnames:
                raise TunebenchError(f"'{p}' has no duration_seconds column; it is not a tunebench results CSV")
            runs += [Run(dict(r, source=str(path))) for r in reader]
    if not runs:
        raise TunebenchError("the results files hold no rows; run tunebench compare first")
    return runs


def table(runs: list[Run]) -> dict[str, dict[str, Cell]]:
    """device -> config -> cell, in first-seen order."""
    cells: dict[str, dict[str, Cell]] = defaultdict(dict)
    for r in runs:
        if r.ok:
            cells[r.device].setdefault(r.config, Cell()).runs.append(r)
    return cells


def device_stats(cells: dict[str, dict[str, Cell]]) -> dict[str, dict]:
    out = {}
    for device, by_config in cells.items():
        durations = {c: cell.median("duration_seconds") for c, cell in by_config.items()}
        fastest = min(durations, key=durations.get)
        slowest = max(durations, key=durations.get)
        tps = [v for cell in by_config.values() if (v := cell.median("tokens_per_s")) is not None]
        mem = [v for cell in by_config.values() if (v := cell.median("peak_memory_mb")) is not None]
        out[device] = {
            "configs": len(durations), "mean_duration_s": statistics.mean(durations.values()),
            "fastest": (fastest, durations[fastest]), "slowest": (slowest, durations[slowest]),
            "mean_tokens_per_s": statistics.mean(tps) if tps else None,
            "max_peak_memory_mb": max(mem) if mem else None,
        }
    return out


def device_speedups(stats: dict[str, dict], baseline: str) -> dict[str, float]:
    """Mean-duration speedup of every device over the baseline device."""
    base = stats[baseline]["mean_duration_s"]
    return {d: base / s["mean_duration_s"] for d, s in stats.items()}


def config_speedups(cells: dict[str, dict[str, Cell]], baseline_config: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for device, by_config in cells.items():
        if baseline_config in by_config:
            base = by_config[baseline_config].median("duration_seconds")
            out[device] = {c: base / cell.median("duration_seconds") for c, cell in by_config.items()}
    return out


def across_devices(cells: dict[str, dict[str, Cell]], baseline_device: str,
                   baseline_config: str) -> list[dict]:
    """The study's central table: every (device, configuration) with its time and speed, and its speedup over the
    baseline device on the same configuration (None where the baseline device did not run it) and over the
    baseline device's baseline configuration (the study's one "1x" row)."""
    base = cells.get(baseline_device, {})
    anchor = base[baseline_config].median("duration_seconds") if baseline_config in base else None
    rows = []
    for device, by_config in cells.items():
        for config, cell in by_config.items():
            t = cell.median("duration_seconds")
            same = base[config].median("duration_seconds") if config in base else None
            rows.append({"device": device, "config": config, "duration_s": t,
                         "tokens_per_s": cell.median("tokens_per_s"),
                         "vs_same_config": same / t if same and t else None,
                         "vs_baseline": anchor / t if anchor and t else None})
    return rows


def findings(cells, stats, speedups, baseline_device) -> list[str]:
    """Sentences computed from the numbers; none is written in advance."""
    out = []
    for device, s in stats.items():
        (fc, fd), (sc, sd) = s["fastest"], s["slowest"]
        if fc != sc:
            out.append(f"On {device}, {fc} is fastest ({fd:,.0f} s), {sd / fd:.2f}x faster than {sc} ({sd:,.0f} s).")
    ranked = sorted(stats, key=lambda d: stats[d]["mean_duration_s"])
    if len(ranked) > 1:
        best, worst = ranked[0], ranked[-1]
        text = (f"{best} has the lowest mean duration ({stats[best]['mean_duration_s']:,.1f} s): "
                f"{stats[worst]['mean_duration_s'] / stats[best]['mean_duration_s']:.2f}x faster than {worst}")
        if baseline_device not in (best, worst):
            text += f" and {speedups[best]:.2f}x faster than the baseline {baseline_device}"
        out.append(text + ".")
    for device, by_config in cells.items():
        sized = [(int(c.runs[0].num("batch_size") or 0), cfg, c.median("duration_seconds")) for cfg, c in by_config.items()
                 if (c.runs[0].row.get("quantization") or "none") == "none" and c.runs[0].num("batch_size")]
        fastest, slowest = stats[device]["fastest"][0], stats[device]["slowest"][0]
        if len({s for s, _, _ in sized}) > 1 and (max(sized)[1], min(sized)[1]) != (fastest, slowest):
            small, large = min(sized), max(sized)
            verb = "cuts" if large[2] < small[2] else "raises"
            out.append(f"On {device}, going from micro batch {small[0]} to {large[0]} {verb} the duration from "
                       f"{small[2]:,.0f} s to {large[2]:,.0f} s ({small[2] / large[2]:.2f}x).")
        for cfg, cell in by_config.items():
            quant = cell.runs[0].row.get("quantization") or "none"
            if quant == "none":
                continue
            twin = cfg.replace(f"_{quant}", "")
            if twin in by_config:
                q, base = cell.median("duration_seconds"), by_config[twin].median("duration_seconds")
                verdict = "paid off" if q < base else "did not pay off"
                out.append(f"On {device}, {quant} quantization {verdict} for speed: {q:,.0f} s vs {base:,.0f} s "
                           f"without it ({base / q:.2f}x).")
        if "auto" in by_config:
            text = _auto_finding(device, by_config)
            if text:
                out.append(text)
    return out


def _auto_finding(device: str, by_config: dict[str, Cell]) -> str | None:
    """auto against the hand-picked rows, like with like: training time against training time (what
    auto measured before training is said apart), against the row with auto's own micro batch, and against the best
    again counting each run's measuring."""
    manual = {c: t for c, cell in by_config.items() if c != "auto" and (t := cell.median("duration_seconds"))}
    auto = by_config["auto"].median("duration_seconds")
    if not manual or not auto:
        return None
    best = min(manual, key=manual.get)
    text = (f"On {device}, tunebench auto trained in {auto:,.0f} s against {manual[best]:,.0f} s for the best "
            f"hand-picked configuration ({best}): {manual[best] / auto:.2f}x.")
    shape = lambda c: (by_config[c].runs[0].num("batch_size"), by_config[c].runs[0].num("grad_accum"))  # noqa: E731
    same = [c for c in manual if shape(c) == shape("auto")]
    micro = f"{int(shape('auto')[0] or 0)} x {int(shape('auto')[1] or 0)}"
    if best in same:
        text += f" auto chose the same micro batch ({micro}), so the gap is run-to-run variation; --repeats narrows it."
    elif same:
        text += (f" Against {same[0]}, the hand-picked run with auto's micro batch ({micro}): {manual[same[0]]:,.0f} s, "
                 f"{manual[same[0]] / auto:.2f}x.")
    said = [(c, p, t) for c in ("auto", best) if (p := by_config[c].median("predicted_seconds"))
            and (t := by_config[c].median("duration_seconds"))]
    if said:  # each plan held against its run: the time_estimate each printed before it trained
        text += " Their plans said " + ", ".join(f"{c} {p:,.0f} s (took {t / p:.2f}x that)" for c, p, t in said) + "."
    measured = by_config["auto"].median("measure_seconds")
    others = [t for c in manual if (t := by_config[c].median("measure_seconds")) is not None]
    if measured is None or not others:
        return text
    if measured >= 1:
        text += (f" Before training, auto spent {measured:,.0f} s measuring (attention kernel, micro batches, compile; "
                 f"a complete measurement is cached for later runs of this shape, one that predicted from the "
                 f"machine class's record is not), the hand-picked runs {min(others):,.0f} to "
                 f"{max(others):,.0f} s; both are apart from the training times compared.")
        best_measured = by_config[best].median("measure_seconds") or 0.0
        text += (f" Counting each run's measuring, auto took {auto + measured:,.0f} s against {best}'s "
                 f"{manual[best] + best_measured:,.0f} s: {(manual[best] + best_measured) / (auto + measured):.2f}x.")
    else:
        text += (f" auto's measurements were on record from an earlier run of this shape: it spent {measured:.1f} s "
                 "measuring before training.")
    return text


# -- charts (matplotlib, headless)


def figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    figure().close(fig)
    return buf.getvalue()


def bar_chart(cells, key: str, title: str, ylabel: str) -> bytes | None:
    plt = figure()
    configs = list(dict.fromkeys(c for by in cells.values() for c in by))
    devices = list(cells)
    if not any(cells[d][c].median(key) is not None for d in devices for c in configs if c in cells[d]):
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(configs) * max(1, len(devices)) / 2), 4))
    width = 0.8 / len(devices)
    for i, device in enumerate(devices):
        xs = [j + i * width for j, c in enumerate(configs) if c in cells[device]]
        ys = [cells[device][c].median(key) or 0 for c in configs if c in cells[device]]
        ax.bar(xs, ys, width, label=device)
    ax.set_xticks([j + width * (len(devices) - 1) / 2 for j in range(len(configs))], configs, rotation=30, ha="right")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return png(fig)


def batch_chart(cells) -> bytes | None:
    plt = figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for device, by in cells.items():
        pts = sorted((int(c.runs[0].num("batch_size")), c.median("duration_seconds")) for c in by.values()
                     if c.runs[0].num("batch_size") and (c.runs[0].row.get("quantization") or "none") == "none")
        if len(pts) > 1:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=device)
            drawn = True
    if not drawn:
        figure().close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro batch (accumulation keeps the effective batch)")
    ax.set_ylabel("duration (s)")
    ax.set_title("Batch size / accumulation effect")
    ax.legend(fontsize=8)
    return png(fig)


# The quality axis: the first task metric the runs have (higher is better; exact tool arguments first, where rows
# offer tools: their ROUGE-L mostly counts the call's JSON punctuation), else eval loss (lower is).
QUALITY = (*((k, quality.LABELS[k], True) for k in ("tool_args", *quality.OBJECTIVES)),
           ("eval_loss", "eval loss (lower is better)", False))


def quality_points(cells) -> tuple[str, str, bool, list[tuple[str, float, float]]]:
    """(metric, its label, higher is better, [(device: config, tokens/s, quality)]) over every cell that has both."""
    for key, label, higher in QUALITY:
        pts = [(f"{device}: {config}", cell.median("tokens_per_s"), cell.median(key))
               for device, by in cells.items() for config, cell in by.items()
               if cell.median("tokens_per_s") is not None and cell.median(key) is not None]
        if pts:
            return key, label, higher, pts
    return "", "", True, []


def pareto_front(points: list[tuple[str, float, float]], higher: bool) -> list[tuple[str, float, float]]:
    """The points no other point beats on both speed and quality (at least as good on both, better on one),
    fastest first."""
    def better(a, b):  # a dominates b
        q_ge = a[2] >= b[2] if higher else a[2] <= b[2]
        q_gt = a[2] > b[2] if higher else a[2] < b[2]
        return a[1] >= b[1] and q_ge and (a[1] > b[1] or q_gt)

    return sorted((p for p in points if not any(better(o, p) for o in points)), key=lambda p: -p[1])


def quality_chart(cells) -> bytes | None:
    """Each configuration and device a point (tokens/s, quality); the Pareto front joined and marked, so a
    faster configuration that answers worse is read together with its speed."""
    key, label, higher, pts = quality_points(cells)
    if len(pts) < 2:
        return None
    plt = figure()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    front = pareto_front(pts, higher)
    ax.scatter([p[1] for p in pts], [p[2] for p in pts], color="#999999", label="configuration")
    ax.plot([p[1] for p in front], [p[2] for p in front], marker="o", color="#d62728", label="Pareto front")
    for name, x, y in pts:
        ax.annotate(name, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if not higher:
        ax.invert_yaxis()  # better is up either way
    ax.set_xlabel("throughput (real tokens/s)")
    ax.set_ylabel(label)
    ax.set_title(f"Quality vs speed ({key})")
    ax.legend(fontsize=8)
    return png(fig)


def loss_chart(runs: list[Run]) -> bytes | None:
    plt = figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for r in runs:
        run_dir = r.row.get("run_dir")
        metrics = Path(run_dir) / "metrics.jsonl" if run_dir else None
        if not r.ok or metrics is None or not metrics.is_file():
            continue
        rows, _ = read_jsonl(metrics)
        pts = [(x["step"], x["loss"]) for x in rows if "loss" in x]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{r.device} {r.config}", linewidth=1)
            drawn = True
    if not drawn:
        figure().close(fig)
        return None
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss")
    ax.legend(fontsize=7)
    return png(fig)


# -- rendering


def _fmt(v, digits=1) -> str:
    if v is None:
        return ""
    return f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def build(paths: list[str], baseline_device: str | None = None, baseline_config: str | None = None) -> dict:
    runs = read_results(paths)
    cells = table(runs)
    if not cells:
        raise TunebenchError("no successful runs in the results; nothing to report")
    stats = device_stats(cells)
    if baseline_device is None:
        baseline_device = max(stats, key=lambda d: stats[d]["mean_duration_s"])  # the slowest
    elif baseline_device not in stats:
        raise TunebenchError(f"--baseline-device '{baseline_device}' is not in the results: {', '.join(stats)}")
    configs = list(dict.fromkeys(c for by in cells.values() for c in by))
    baseline_config = baseline_config or configs[0]
    speedups = device_speedups(stats, baseline_device)
    return {
        "runs": runs, "cells": cells, "stats": stats, "baseline_device": baseline_device,
        "baseline_config": baseline_config, "device_speedups": speedups,
        "config_speedups": config_speedups(cells, baseline_config),
        "across_devices": across_devices(cells, baseline_device, baseline_config),
        "findings": findings(cells, stats, speedups, baseline_device),
    }


COLUMNS = ["experiment", "device_name", "processes", "config", "method", "objective", "batch_size", "grad_accum",
           "quantization", "precision", "duration_seconds", "tokens_per_s", "peak_memory_mb", "final_train_loss",
           "eval_loss", "reward_accuracy", "mfu", *quality.TASK_SCORES, "trainable_params", "status"]


DIGITS = {"duration_seconds": 1, "tokens_per_s": 0, "peak_memory_mb": 0, "final_train_loss": 4, "eval_loss": 4,
          "reward_accuracy": 3,
          **{k: quality.DIGITS[k] for k in quality.TASK_SCORES}}


def _cell(run: Run, key: str) -> str:
    if key == "config":
        return run.config
    if key == "mfu" and run.num("mfu") is not None:
        return f"{100 * run.num('mfu'):.1f}%"
    if key == "trainable_params" and run.num(key) is not None:
        return f"{int(run.num(key)):,}"
    if key in DIGITS and run.num(key) is not None:
        return _fmt(run.num(key), DIGITS[key])
    return run.row.get(key) or ""


def run_report_of(run: Run) -> str:
    """The path of the run's own report (tunebench report RUN_DIR), where compare wrote one."""
    path = Path(run.row.get("run_dir") or "") / "report" / "report.html"
    return str(path.resolve()) if run.row.get("run_dir") and path.is_file() else ""


def _sections(r: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    stats = r["stats"]
    summary = [[d, str(s["configs"]), _fmt(s["mean_duration_s"], 2), f"{s['fastest'][0]} ({_fmt(s['fastest'][1], 0)})",
                f"{s['slowest'][0]} ({_fmt(s['slowest'][1], 0)})", _fmt(s["mean_tokens_per_s"], 0),
                _fmt(s["max_peak_memory_mb"], 0), f"{r['device_speedups'][d]:.2f}x"] for d, s in stats.items()]
    configs = list(dict.fromkeys(c for by in r["cells"].values() for c in by))
    cfg_rows = [[d] + [f"{sp[c]:.2f}x" if c in sp else "" for c in configs] for d, sp in r["config_speedups"].items()]
    speedup = lambda x: "" if x is None else f"{x:.2f}x"  # noqa: E731
    across = [[a["device"], a["config"], _fmt(a["duration_s"], 1), _fmt(a["tokens_per_s"], 0),
               speedup(a["vs_same_config"]), speedup(a["vs_baseline"])] for a in r["across_devices"]]
    all_rows = [[_cell(run, k) for k in COLUMNS] + [run_report_of(run)] for run in r["runs"]]
    return [
        ("Per-device summary", ["device", "configs", "mean duration (s)", "fastest (s)", "slowest (s)",
                                "mean tokens/s", "peak MB", f"speedup vs {r['baseline_device']}"], summary),
        (f"Speedup of each configuration vs {r['baseline_config']}", ["device"] + configs, cfg_rows),
        (f"Each configuration on each device, against {r['baseline_device']}",
         ["device", "config", "time (s)", "tokens/s", f"speedup vs {r['baseline_device']}, same config",
          f"speedup vs {r['baseline_device']} {r['baseline_config']}"], across),
        *_rewards(r["runs"]),
        ("All runs", COLUMNS + ["run report"], all_rows),
    ]


def _rewards(runs: list[Run]) -> list[tuple[str, list[str], list[list[str]]]]:
    """GRPO runs' held-out figures side by side, each before training and after: the reward, and where the run
    played episodes in an environment, their success, turns, calls and calls that ran; none where no run has them."""
    held = [run for run in runs if run.ok and run.num("reward") is not None]
    if not held:
        return []

    def share(run: Run, key: str) -> str:
        return "" if run.num(key) is None else f"{100 * run.num(key):.0f}%"

    rows = []
    for run in held:
        rows.append([run.row["experiment"], run.device, run.row.get("environment") or "(single completions)",
                     f"{run.num('reward_before'):.3f}" if run.num("reward_before") is not None else "",
                     f"{run.num('reward'):.3f}", share(run, "episode_success_before"), share(run, "episode_success"),
                     _fmt(run.num("episode_turns"), 2), _fmt(run.num("episode_calls"), 2),
                     share(run, "episode_calls_ok")])
    return [("Held-out reward (GRPO), before training and after",
             ["experiment", "device", "environment", "reward before", "reward after", "success before",
              "success after", "turns / episode", "calls / episode", "calls that ran"], rows)]


def charts(r: dict) -> list[tuple[str, bytes]]:
    out = []
    for name, png in [
        ("duration", bar_chart(r["cells"], "duration_seconds", "Duration per configuration and device", "seconds")),
        ("throughput", bar_chart(r["cells"], "tokens_per_s", "Throughput (real tokens/s)", "tokens/s")),
        ("memory", bar_chart(r["cells"], "peak_memory_mb", "Peak memory", "MB")),
        ("final_loss", bar_chart(r["cells"], "final_train_loss", "Final training loss", "loss")),
        ("batch_effect", batch_chart(r["cells"])),
        ("loss_curves", loss_chart(r["runs"])),
        ("quality_vs_speed", quality_chart(r["cells"])),
    ]:
        if png:
            out.append((name, png))
    return out


def _html_cell(text: str) -> str:
    if text.endswith("report.html") and Path(text).is_file():  # a run's own report: a link to it
        return f"<a href='{html.escape(Path(text).as_uri())}'>open</a>"
    return html.escape(text)


def write(paths: list[str], out_dir: str, baseline_device: str | None = None,
          baseline_config: str | None = None, extra_charts: list[tuple[str, bytes]] = ()) -> Path:
    """report.md and a self-contained report.html; `extra_charts` (name, PNG) follow the standard ones."""
    r = build(paths, baseline_device, baseline_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = charts(r) + list(extra_charts)
    sections = _sections(r)

    md = ["# tunebench report", "", f"Sources: {', '.join(paths)}", "", "## Findings", ""]
    md += [f"- {f}" for f in r["findings"]] + [""]
    for title, head, rows in sections:
        md += [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        md += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    md += ["## Charts", ""]
    for name, png in pngs:
        (out / f"{name}.png").write_bytes(png)
        md.append(f"![{name}]({name}.png)")
    with atomic_file(out / "report.md") as tmp:
        tmp.write_text("\n".join(md) + "\n", encoding="utf-8")

    esc = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>tunebench report</title><style>",
             "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
             "margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
             "th{background:#f0f0f0}td:first-child{text-align:left}img{max-width:100%;margin:1em 0}",
             "</style></head><body><h1>tunebench report</h1>",
             f"<p>Sources: {esc(', '.join(paths))}</p><h2>Findings</h2><ul>"]
    parts += [f"<li>{esc(f)}</li>" for f in r["findings"]] + ["</ul>"]
    for title, head, rows in sections:
        parts.append(f"<h2>{esc(title)}</h2><div style='overflow-x:auto'><table><tr>"
                     + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{_html_cell(c)}</td>" for c in row) + "</tr>" for row in rows]
        parts.append("</table></div>")
    parts.append("<h2>Charts</h2>")
    for name, png in pngs:
        parts.append(f"<img id='{name}' alt='{name}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    parts.append("</body></html>")
    with atomic_file(out / "report.html") as tmp:
        tmp.write_text("\n".join(parts), encoding="utf-8")
    return out / "report.html"
