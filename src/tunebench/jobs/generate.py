"""`tunebench generate` and `tunebench chat`: completions from a base model, a fine-tune or an adapter."""

from __future__ import annotations

import torch

from tunebench import models


def _render(tokenizer, messages: list[dict[str, str]], raw: bool) -> str:
    if raw or not getattr(tokenizer, "chat_template", None):
        return messages[-1]["content"] if raw else f"### Instruction:\n{messages[-1]['content']}\n\n### Response:\n"
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def complete(loaded: models.Loaded, messages: list[dict[str, str]], max_new_tokens: int = 128,
             temperature: float = 0.0, raw: bool = False, seed: int = 0) -> str:
    tok, model = loaded.tokenizer, loaded.model
    text = _render(tok, messages, raw)
    enc = tok(text, return_tensors="pt", add_special_tokens=False)
    limit = models.position_limit(model)
    if limit is not None:  # learned positions end there
        max_new_tokens = max(0, min(max_new_tokens, limit - enc["input_ids"].shape[1]))
    torch.manual_seed(seed)
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def generate(model: str | None, adapter: str | None, prompt: str, max_new_tokens: int, temperature: float,
             raw: bool, tokenizer: str | None = None, allow_download: bool = False) -> str:
    loaded = models.load_for_inference(model, adapter, tokenizer, allow_download)
    return complete(loaded, [{"role": "user", "content": prompt}], max_new_tokens, temperature, raw)


def chat(model: str | None, adapter: str | None, max_new_tokens: int, temperature: float,
         tokenizer: str | None = None, allow_download: bool = False) -> None:
    loaded = models.load_for_inference(model, adapter, tokenizer, allow_download)
    print(f"chatting with {loaded.source}; an empty line or Ctrl-D ends, /reset clears the history")
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
        reply = complete(loaded, history, max_new_tokens, temperature)
        history.append({"role": "assistant", "content": reply})
        print(f"bot> {reply}")
