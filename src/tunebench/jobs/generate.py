"""`tunebench generate` and `tunebench chat`: completions from a base model, a fine-tune or an adapter."""

from __future__ import annotations

import torch

from tunebench.core.errors import TunebenchError
from tunebench.data.tokenize import render_prompt
from tunebench.model import inference
from tunebench.settings.rundir import RunDir


def trained_template(*run_dirs: str | None) -> str:
    """The prompt template (data.template) of the training run that wrote one of these directories;
    "auto" when none did."""
    for d in run_dirs:
        if d is None:
            continue
        try:
            template = RunDir(d).template()
        except TunebenchError:  # a config.yaml that is not a run's: look no further in it
            continue
        if template is not None:
            return template
    return "auto"


def complete(placed: inference.Placed, messages: list[dict[str, str]], max_new_tokens: int = 128,
             temperature: float = 0.0, raw: bool = False, seed: int = 0, template: str = "auto") -> str:
    tok = placed.tokenizer
    enc = placed.encode(messages[-1]["content"] if raw else render_prompt(messages, tok, template))
    limit = inference.position_limit(placed.model)
    if limit is not None:  # learned positions end there
        max_new_tokens = max(0, min(max_new_tokens, limit - enc["input_ids"].shape[1]))
    torch.manual_seed(seed)
    out = placed.decode(enc["input_ids"], enc["attention_mask"], max_new_tokens,
                        temperature if temperature > 0 else None)
    return tok.decode(out[0].cpu(), skip_special_tokens=True).strip()


def generate(model: str | None, adapter: str | None, prompt: str, max_new_tokens: int, temperature: float,
             raw: bool, tokenizer: str | None = None, allow_download: bool = False, template: str | None = None,
             device: str = "auto", precision: str = "auto") -> str:
    """One completion. The prompt format is `template`, else the one the run (adapter or model dir) trained with.
    The model runs on the device and in the precision training would pick (or those asked)."""
    placed = inference.load(model, adapter, tokenizer, allow_download, device, precision)
    return complete(placed, [{"role": "user", "content": prompt}], max_new_tokens, temperature, raw,
                    template=template or trained_template(adapter, model))


def chat(model: str | None, adapter: str | None, max_new_tokens: int, temperature: float,
         tokenizer: str | None = None, allow_download: bool = False, template: str | None = None,
         device: str = "auto", precision: str = "auto") -> None:
    placed = inference.load(model, adapter, tokenizer, allow_download, device, precision)
    template = template or trained_template(adapter, model)
    print(f"chatting with {placed.source} on {placed.device}; an empty line or Ctrl-D ends, /reset clears the history")
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return
        if not line:
            return
        if line == "/reset":
            history = []
            continue
        history.append({"role": "user", "content": line})
        reply = complete(placed, history, max_new_tokens, temperature, template=template)
        history.append({"role": "assistant", "content": reply})
        print(f"bot> {reply}")
