"""Where a sampled (RFT) step's resident memory grows: while it samples or while it trains. RSS is read every 5 ms
on a thread, each reading labelled with the phase the main thread is in (DrawnSteps.next: sampling; the rest:
training). Run by hand from the repository root, with the towns benchmark's seed 0 kept in /work/arms:

    GLIBC_TUNABLES=<tunebench's KEEP_FREED> python memexp.py OUT STEPS [tunebench train flags]

(in-process, so the command's own restart with the malloc tunables does not happen: pass them as above)."""

import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil

from tunebench.interfaces import cli
from tunebench.training.grpo import steps as steps_

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import agent_rl  # noqa: E402 - the benchmark's environment, beside this folder

phase, step, samples = ["setup"], [0], []
stop = threading.Event()


def watch() -> None:
    proc = psutil.Process()
    while not stop.is_set():
        samples.append((time.time(), phase[0], step[0], proc.memory_info().rss / 2**20))
        time.sleep(0.005)


drawn = steps_.DrawnSteps.next


def labelled(self, at):
    phase[0], step[0] = "sample", step[0] + 1
    try:
        return drawn(self, at)
    finally:
        phase[0] = "train"


def main() -> int:
    steps_.DrawnSteps.next = labelled
    threading.Thread(target=watch, daemon=True).start()
    out = sys.argv[1]
    code = cli.main(["train", "--objective", "rft", "--model", "/work/arms/seed0/start", "--environment",
                     str(agent_rl.ENV), "--data", "/work/arms/seed0/data/train.jsonl", "--kind-column", "kind",
                     "--num-generations", "4", "--max-completion-length", "48", "--max-turns", "6", "--max-length",
                     "1024", "--effective-batch-size", "4", "--eval-fraction", "0", "--lr", "2e-4", "--schedule",
                     "constant", "--temperature", "1.0", "--no-progress", "--seed", "0", "--output-dir", out,
                     "--max-steps", sys.argv[2], "--attention", "tunebench", *sys.argv[3:]])
    stop.set()
    peaks: dict[tuple[str, int], float] = {}
    for _, p, s, rss in samples:
        peaks[(p, s)] = max(peaks.get((p, s), 0.0), rss)
    for (p, s), rss in sorted(peaks.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"step {s:3d} {p:7s} max RSS {rss:8.0f} MB")
    print("GLIBC_TUNABLES", os.environ.get("GLIBC_TUNABLES"), "exit", code)
    Path(out + "-rss.json").write_text(json.dumps({"samples": samples}))
    return code


if __name__ == "__main__":
    sys.exit(main())
