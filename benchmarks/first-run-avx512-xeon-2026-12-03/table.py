"""Each compare's rows: train s plan/run, steady tokens/s plan/run, first steps' extra, peak MB plan/run, micro x accum,
measuring, and auto against the best hand-picked row (training; counting measuring)."""
import json
import sys
from pathlib import Path

for tag in sys.argv[1:]:
    root = Path("/work/results") / f"compare-{tag}" / "runs"
    rows = {}
    for run in sorted(p for p in root.iterdir() if (p / "summary.json").is_file()):
        s = json.loads((run / "summary.json").read_text())
        pc = s["plan_check"]
        rows[run.name.split("-cpu")[0]] = s
        t, v, m, f = pc["train_time_s"], pc["steady_tokens_per_s"], pc["peak_memory_mb"], pc["first_steps_s"]
        print(f"{tag} {run.name.split('-cpu')[0]:8} {s['micro_batch_size']}x{s['grad_accum_steps']} steps {s['steps']:3} "
              f"train {t['predicted']} / {t['measured']} ({t['ratio']}) tok/s {v['predicted']} / {v['measured']} "
              f"({v['ratio']}) first {f['predicted']} / {f['measured']} ({pc['first_steps']}) "
              f"peak {m['predicted']} / {m['measured']} ({m['ratio']}) measure {s.get('measure_s')} dur {s['duration_s']}")
    hand = {k: v for k, v in rows.items() if k != "auto"}
    if "auto" in rows and hand:
        best = min(hand, key=lambda k: hand[k]["train_time_s"])
        a = rows["auto"]
        best_m = min(hand, key=lambda k: hand[k]["train_time_s"] + (hand[k].get("measure_s") or 0))
        with_m = lambda r: r["train_time_s"] + (r.get("measure_s") or 0)
        print(f"{tag} auto vs {best}: training {hand[best]['train_time_s'] / a['train_time_s']:.2f}x; "
              f"counting measuring vs {best_m} {with_m(hand[best_m]) / with_m(a):.2f}x")
    report = root.parent / "report" / "report.md"
    if report.is_file():
        for line in report.read_text().splitlines():
            if "tunebench auto trained" in line or "auto" in line and "x the best" in line:
                print("  ", line[:400])
