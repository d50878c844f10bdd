"""Time to quality against nanoGPT's own CPU recipe, both measured in one run on this machine.

    python benchmarks/vs_nanogpt.py --nanogpt ~/src/nanoGPT          # a checkout of github.com/karpathy/nanoGPT
    python benchmarks/vs_nanogpt.py --nanogpt DIR -- training.max_steps=1200   # tunebench overrides after --

nanoGPT runs its README's CPU recipe ("I only have a macbook": shakespeare_char, 4 layers x 128, block 64,
batch 12, 2,000 iterations, dropout 0); tunebench runs `benchmarks/shakespeare_char.yaml`. Both read the
same tinyshakespeare file, each side in its own process, one after the other. Each side's data preparation
(nanoGPT's prepare.py, tunebench's character tokenizer) is done first and not timed. Timed: the whole
training command (start-up, evaluations and saving included) and its training loop alone.

The two print validation losses measured differently (nanoGPT: 20 random batches; tunebench: every
validation block), so both final models are also scored by one evaluator here, on the same characters:
nanoGPT's validation split (the last 10% of the file, which tunebench's training blocks never reach), in
windows of 64 characters, each predicting its last 63 from what precedes them.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
NANOGPT_CPU_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                      "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                      "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
WINDOW = 64


def timed(cmd: list[str], cwd: Path, log: Path) -> dict:
    """Run `cmd` to completion; its wall time and this child's own peak RSS (from wait4, not the sum of
    every child this script has run)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def run_nanogpt(src: Path, corpus: Path, work: Path) -> dict:
    home = work / "nanogpt"
    shutil.copytree(src, home, ignore=shutil.ignore_patterns(".git", "out*"))
    data = home / "data" / "shakespeare_char"
    shutil.copy(corpus, data / "input.txt")  # prepare.py downloads the file only when it is missing
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    log = work / "nanogpt.log"
    # always_save_checkpoint: the final weights are saved whatever the noisy estimate says, so they can be scored
    result = timed([sys.executable, "train.py", *NANOGPT_CPU_RECIPE, "--always_save_checkpoint=True",
                    f"--out_dir={home / 'out'}"], home, log)
    text = log.read_text()
    evals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", text)
    iter_ms = [float(ms) for ms in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", text)]
    return {**result, "loop_s": sum(iter_ms) / 1000, "own_val_loss": float(evals[-1][2]), "steps": int(evals[-1][0])}


def run_tunebench(corpus: Path, work: Path, recipe: Path, overrides: list[str]) -> dict:
    tok = work / "char-tok"
    cli = [sys.executable, "-m", "tunebench"]
    subprocess.run([*cli, "tokenizer", "train", "--data", str(corpus), "--vocab-size", "128", "--type", "char",
                    "-o", str(tok)], check=True, capture_output=True)
    out = work / "tunebench"
    result = timed([*cli, "pretrain", str(recipe), "--data", str(corpus), "--tokenizer", str(tok), "--output-dir",
                    str(out), "--no-progress", *overrides], ROOT, work / "tunebench.log")
    summary = json.loads((out / "summary.json").read_text())
    return {**result, "loop_s": summary["train_time_s"], "own_val_loss": summary["eval_loss"],
            "steps": summary["steps"], "tokens_per_s": summary["tokens_per_s"]}


def windows(encoded: list[int]) -> torch.Tensor:
    n = len(encoded) // WINDOW * WINDOW
    return torch.tensor(encoded[:n]).view(-1, WINDOW)


@torch.no_grad()
def mean_loss(logits_of, ids: torch.Tensor, batch: int = 128) -> float:
    """Mean cross-entropy of each window's characters 2..64 given those before them."""
    total = 0.0
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch]
        logits = logits_of(x)[:, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                         reduction="sum"))
    return total / (len(ids) * (WINDOW - 1))


def score_nanogpt(work: Path, val_text: str) -> float:
    home = work / "nanogpt"
    sys.path.insert(0, str(home))
    from model import GPT, GPTConfig  # nanoGPT's own model.py

    ckpt = torch.load(home / "out" / "ckpt.pt", map_location="cpu", weights_only=False)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    model.eval()
    stoi = pickle.loads((home / "data" / "shakespeare_char" / "meta.pkl").read_bytes())["stoi"]
    ids = windows([stoi[c] for c in val_text])
    # nanoGPT's forward returns logits for the last position only unless given targets
    return mean_loss(lambda x: model(x, x)[0], ids)


def score_tunebench(work: Path, val_text: str) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = work / "tunebench"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    encoded = tok(val_text, add_special_tokens=False)["input_ids"]
    if len(encoded) != len(val_text):
        raise SystemExit("tunebench's tokenizer is not one token per character; this comparison needs --type char")
    return mean_loss(lambda x: model(input_ids=x).logits, windows(encoded))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanogpt", required=True, type=Path, help="a checkout of github.com/karpathy/nanoGPT")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/tinyshakespeare/input.txt")
    ap.add_argument("--recipe", type=Path, default=ROOT / "benchmarks/shakespeare_char.yaml")
    ap.add_argument("--keep", type=Path, help="keep both runs' outputs and logs here (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help="tunebench settings after --, e.g. training.max_steps=1200")
    args = ap.parse_args()
    if not (args.nanogpt / "train.py").is_file():
        raise SystemExit(f"--nanogpt {args.nanogpt}: no train.py there; clone github.com/karpathy/nanoGPT")
    if not args.data.is_file():
        raise SystemExit(f"--data {args.data}: not found; give tinyshakespeare's input.txt")
    work = args.keep or Path(tempfile.mkdtemp(prefix="vs-nanogpt-"))
    work.mkdir(parents=True, exist_ok=True)
    text = args.data.read_text()
    val_text = text[int(len(text) * 0.9):]  # nanoGPT's validation split

    sides = {"nanoGPT": run_nanogpt(args.nanogpt, args.data, work),
             "tunebench": run_tunebench(args.data, work, args.recipe, args.overrides)}
    sides["nanoGPT"]["val_loss"] = score_nanogpt(work, val_text)
    sides["tunebench"]["val_loss"] = score_tunebench(work, val_text)

    print(f"{'':10} {'steps':>6} {'wall s':>8} {'loop s':>8} {'own val loss':>13} {'val loss (one evaluator)':>25} "
          f"{'peak RSS MB':>12}")
    for name, s in sides.items():
        print(f"{name:10} {s['steps']:>6} {s['wall_s']:>8.1f} {s['loop_s']:>8.1f} {s['own_val_loss']:>13.4f} "
              f"{s['val_loss']:>25.4f} {s['peak_rss_mb']:>12,.0f}")
    nano, tb = sides["nanoGPT"], sides["tunebench"]
    print(f"tunebench / nanoGPT: wall {tb['wall_s'] / nano['wall_s']:.2f}x, loop {tb['loop_s'] / nano['loop_s']:.2f}x, "
          f"val loss {tb['val_loss'] - nano['val_loss']:+.4f} nats per character")
    reached = tb["val_loss"] <= nano["val_loss"] and tb["wall_s"] <= nano["wall_s"] / 2
    print(f"goal (nanoGPT's val loss in at most half its wall time): {'reached' if reached else 'not reached'}")
    (work / "result.json").write_text(json.dumps(sides, indent=1))
    print(f"outputs and logs: {work}")


if __name__ == "__main__":
    main()
