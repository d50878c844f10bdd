"""Golden per-step training losses for lora, full and qlora on the tiny model, from HF Trainer + PEFT.

The reference is not tunebench's training code: the examples are tokenized here by hand (prompt
template, response + EOS, loss on the response only), the adapters come from peft.get_peft_model,
the 4-bit base from transformers + bitsandbytes, and the steps from transformers.Trainer (its AdamW,
its linear schedule, its clipping). Only the fixtures are shared with the tests: the tiny preset's
weights and the byte-level tokenizer. tests/test_golden.py trains the same recipe with tunebench and
compares losses step by step.

    .venv/bin/python tests/golden/make_golden.py     # rewrites tests/golden/losses.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from conftest import ROWS  # noqa: E402  (the 12 rows every test trains on)

TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
STEPS = 5
SEED = 42
RECIPES = {  # name -> (tunebench method, lr); LoRA r 8, alpha 16, dropout 0 on q_proj, v_proj
    "lora": ("lora", 1e-2),
    "full": ("full", 1e-3),
    "qlora": ("qlora", 1e-2),
}


def examples(tok) -> list[dict[str, list[int]]]:
    out = []
    for row in ROWS:
        prompt = tok(TEMPLATE.format(instruction=row["instruction"]), add_special_tokens=False)["input_ids"]
        reply = tok(row["response"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        out.append({"input_ids": prompt + reply, "labels": [-100] * len(prompt) + reply})
    return out


def collate(rows, pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def reference_losses(method: str, lr: float) -> list[float]:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    from tunebench.model.models import resolve  # the tiny preset's weights (a fixture, built with its own seed)

    tiny = resolve("tiny")
    tok = tiny.tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(SEED)  # as a tunebench run seeds before it builds the adapters
        if method == "qlora":
            tiny.model.save_pretrained(tmp)
            bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                     bnb_4bit_compute_dtype=torch.float32)
            model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=bnb, dtype=torch.float32)
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        else:
            model = tiny.model
        if method != "full":
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                     target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        data = examples(tok)
        args = TrainingArguments(
            output_dir=tmp, max_steps=STEPS, per_device_train_batch_size=len(data), gradient_accumulation_steps=1,
            learning_rate=lr, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            optim="adamw_torch", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=SEED,
            data_seed=SEED, disable_tqdm=True, remove_unused_columns=False,
        )
        losses: list[float] = []

        class Recording(Trainer):
            def training_step(self, *a, **k):
                loss = super().training_step(*a, **k)
                losses.append(float(loss))  # one micro batch per step: the step's token-mean loss
                return loss

        Recording(model=model, args=args, train_dataset=data,
                  data_collator=lambda rows: collate(rows, tok.pad_token_id)).train()
    return losses


def main() -> None:
    import peft
    import transformers

    out = {"template": TEMPLATE, "steps": STEPS, "seed": SEED, "batch": len(ROWS),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "peft": peft.__version__},
           "losses": {}, "lr": {}}
    for name, (method, lr) in RECIPES.items():
        out["losses"][name] = reference_losses(method, lr)
        out["lr"][name] = lr
        print(name, [round(x, 6) for x in out["losses"][name]])
    (HERE / "losses.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
