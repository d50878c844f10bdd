"""Whose number is Gemma 3 270M's q8_0 read-back agreement? python probe_q8.py RUN_DIR WORK

A: the merged model in PyTorch fp32 (what export compares against)
B: llama.cpp's converter at f32, run by llama.cpp        -> the writer and the reader
C: llama.cpp's converter at q8_0, run by llama.cpp       -> against A (the export's check) and against B
D: A's weights rounded to q8_0 (blocks of 32, absmax/127) in PyTorch -> the weights' rounding alone
E: llama.cpp's quantizer from B's f32 to q8_0 (the other route to the same type)
For each disagreement with A: A's margin between its top token and the file's.
"""
import json
import sys
from pathlib import Path

import torch

from tunebench.jobs import export as ex
from tunebench.model import inference, llama_cpp_tools

run, work = Path(sys.argv[1]), Path(sys.argv[2])
work.mkdir(parents=True, exist_ok=True)
loaded = inference.load_for_inference(None, str(run))
model = loaded.model.merge_and_unload().float().eval()
tok = loaded.tokenizer
template = ex.chat_template(tok, ex._trained_template(run))
vocab = model.get_input_embeddings().weight.shape[0]


@torch.no_grad()
def logits_of(fn):
    out = []
    for prompt in ex.CHECK_PROMPTS:
        ids = tok(ex.render(tok, template, prompt), return_tensors="pt", add_special_tokens=False).input_ids
        out.append(fn(ids).logits[0, :, :vocab].float())
    return torch.cat(out)


def agree(a, b):
    same = (a.argmax(-1) == b.argmax(-1))
    top2 = a.topk(2, -1).values
    flips = [(round((top2[i, 0] - top2[i, 1]).item(), 3), round((a[i].max() - a[i, b[i].argmax()]).item(), 3))
             for i in torch.nonzero(~same).flatten().tolist()]
    return {"top1": round(same.float().mean().item(), 4), "positions": len(same),
            "max_diff": round((a - b).abs().max().item(), 3),
            "mean_abs_diff": round((a - b).abs().mean().item(), 4),
            "kl": round(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                                   reduction="batchmean").item(), 5),
            "flips (A's top1-top2 margin, A's logit gap to the file's pick)": flips}


A = logits_of(model)
hf = work / "hf"
if not (hf / "config.json").is_file():
    ex._write_hf(model, tok, hf, "f32", template)
files = {}
for outtype in ("f32", "q8_0"):
    path = work / f"gemma-{outtype}.gguf"
    if not path.is_file():
        llama_cpp_tools.convert(hf, path, outtype)
    files[outtype] = path
quantized = work / "gemma-q8_0-quantizer.gguf"
if not quantized.is_file():
    llama_cpp_tools.quantize(files["f32"], quantized, "q8_0")
files["q8_0 (quantizer)"] = quantized
L = {}
for name, path in files.items():
    reader = llama_cpp_tools.Reader(path)
    try:
        L[name] = logits_of(reader)
    finally:
        reader.close()


def rounded_q8_0(w):
    rows, cols = w.shape
    if cols % 32:
        return w
    blocks = w.reshape(rows, cols // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / scale.clamp_min(1e-30)), torch.zeros_like(blocks))
    return (q * scale).reshape(rows, cols)


with torch.no_grad():
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and module.weight.dim() == 2:
            module.weight.copy_(rounded_q8_0(module.weight))
D = logits_of(model)
report = {
    "B llama.cpp f32 vs A": agree(A, L["f32"]),
    "C llama.cpp q8_0 (converter) vs A": agree(A, L["q8_0"]),
    "C llama.cpp q8_0 (converter) vs B llama.cpp f32": agree(L["f32"], L["q8_0"]),
    "E llama.cpp q8_0 (quantizer) vs A": agree(A, L["q8_0 (quantizer)"]),
    "D PyTorch, weights rounded to q8_0, vs A": agree(A, D),
}
print(json.dumps(report, indent=1))
(work / "report.json").write_text(json.dumps(report, indent=1))
