"""Each compare's rows (this folder's w1, w2, w3): train s plan/run, steady positions/s plan/run, peak memory's
ratio, what the speed was predicted from; and auto against the best hand-picked row."""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
for tag in ("w1", "w2", "w3"):
    rows = {}
    for path in sorted((HERE / tag).glob("*-cpu-r1/summary.json")):
        s, name = json.loads(path.read_text()), path.parent.name.split("-cpu")[0]
        rows[name], pc = s, s["plan_check"]
        t, v, m = pc["train_time_s"], pc["steady_positions_per_s"], pc["peak_memory_mb"]
        print(tag, f"{name:8} {s['micro_batch_size']}x{s['grad_accum_steps']} train {t['predicted']}/{t['measured']} "
              f"({t['ratio']}) positions/s {v['predicted']}/{v['measured']} ({v['ratio']}) peak ({m['ratio']}) | "
              f"{pc['speed_from']}")
    hand = {k: v for k, v in rows.items() if k != "auto"}
    a, with_m = rows["auto"], lambda r: r["train_time_s"] + (r.get("measure_s") or 0)
    best, best_m = min(hand, key=lambda k: hand[k]["train_time_s"]), min(hand, key=lambda k: with_m(hand[k]))
    print(tag, f"auto vs {best}: {hand[best]['train_time_s'] / a['train_time_s']:.2f}x training; counting measuring "
               f"vs {best_m}: {with_m(hand[best_m]) / with_m(a):.2f}x")
