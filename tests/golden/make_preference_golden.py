"""Golden per-step DPO and ORPO losses and reward metrics from TRL, for tests/test_preference.py.

The reference is TRL's own trainers (DPOTrainer; ORPOTrainer from trl.experimental), not tunebench's
code: the pairs are tokenized here by hand (prompt template, reply + EOS), the adapters come from
peft.get_peft_model, the steps from TRL on top of transformers.Trainer (its AdamW, its linear schedule,
its clipping), one batch of all pairs per step. Only the fixtures are shared with the tests: the tiny
preset's weights and tokenizer, and the pairs written into the JSON.

TRL is not a tunebench dependency; install it to regenerate:

    .venv/bin/pip install trl
    .venv/bin/python tests/golden/make_preference_golden.py    # rewrites tests/golden/preference.json
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from transformers import TrainerCallback

HERE = Path(__file__).parent
TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
STEPS = 5
SEED = 42
LR = 1e-2
BETA = 0.1  # DPO's beta and ORPO's lambda (TRL calls both beta)
PAIRS = [
    {"prompt": "How do I reset my password?",
     "chosen": "Open Settings, choose Security, then Reset password and follow the email link.",
     "rejected": "I don't know."},
    {"prompt": "Where is my order?",
     "chosen": "Send me your order number and I will look up where it is right now.",
     "rejected": "Orders arrive when they arrive."},
    {"prompt": "Can I get a refund?",
     "chosen": "Yes: refunds are possible within 30 days. I can start one for you.",
     "rejected": "No."},
    {"prompt": "How do I cancel my subscription?",
     "chosen": "Go to Account, then Subscription, and press Cancel; you keep access until the period ends.",
     "rejected": "You cannot cancel."},
    {"prompt": "What are your opening hours?",
     "chosen": "Our support team is available from 9am to 6pm, Monday to Friday.",
     "rejected": "Sometimes."},
    {"prompt": "How do I change my delivery address?",
     "chosen": "Open the order, choose Edit address, and save the new one before it ships.",
     "rejected": "Addresses cannot be changed ever."},
]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def tokenized(tok) -> list[dict[str, list[int]]]:
    out = []
    for p in PAIRS:
        prompt = tok(TEMPLATE.format(instruction=p["prompt"]), add_special_tokens=False)["input_ids"]
        out.append({"prompt_ids": prompt,
                    "chosen_ids": tok(p["chosen"] + tok.eos_token, add_special_tokens=False)["input_ids"],
                    "rejected_ids": tok(p["rejected"] + tok.eos_token, add_special_tokens=False)["input_ids"]})
    return out


def lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)  # as a tunebench run seeds before it builds the adapters
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))


def common(tmp: str) -> dict:
    return dict(output_dir=tmp, max_steps=STEPS, per_device_train_batch_size=len(PAIRS), gradient_accumulation_steps=1,
                learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                optim="adamw_torch", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=SEED,
                data_seed=SEED, disable_tqdm=True, beta=BETA,
                bf16=False, gradient_checkpointing=False)  # TRL's defaults are bf16 and checkpointing; tunebench: fp32


class Record(TrainerCallback):
    """Each step's logged loss and metrics (logging_steps 1: one log per step)."""

    def __init__(self, names):
        self.names, self.steps = names, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append({k: float(logs[k]) for k in ("loss", *self.names) if k in logs})


def dpo() -> list[dict]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from tunebench.model.models import resolve

    tiny = resolve("tiny")
    data = Dataset.from_list(tokenized(tiny.tokenizer))
    DPOTrainer._prepare_dataset = lambda self, dataset, *a, **k: dataset  # already tokenized, by hand above
    record = Record(METRICS)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(**common(tmp), max_length=None, loss_type=["sigmoid"], precompute_ref_log_probs=False)
        DPOTrainer(model=lora(tiny.model), args=args, train_dataset=data, processing_class=tiny.tokenizer,
                   callbacks=[record]).train()
    return record.steps


def orpo() -> list[dict]:
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from tunebench.model.models import resolve

    tiny = resolve("tiny")
    rows = tokenized(tiny.tokenizer)

    class Pretokenized(ORPOTrainer):
        def tokenize_row(self, feature, model=None):  # the hand-tokenized ids, in ORPO's column layout
            out = {"prompt_input_ids": feature["prompt_ids"], "prompt_attention_mask": [1] * len(feature["prompt_ids"])}
            for side in ("chosen", "rejected"):
                ids = feature["prompt_ids"] + feature[f"{side}_ids"]
                out[f"{side}_input_ids"] = ids
                out[f"{side}_attention_mask"] = [1] * len(ids)
                out[f"{side}_labels"] = [-100] * len(feature["prompt_ids"]) + feature[f"{side}_ids"]
            return out

    data = Dataset.from_list([{**p, **r} for p, r in zip(PAIRS, rows)])
    record = Record(METRICS + ("nll_loss", "log_odds_ratio", "log_odds_chosen"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ORPOConfig(**common(tmp), max_length=256, remove_unused_columns=False)
        Pretokenized(model=lora(tiny.model), args=args, train_dataset=data, processing_class=tiny.tokenizer,
                     callbacks=[record]).train()
    return record.steps


def main() -> None:
    import peft
    import transformers
    import trl

    out = {"template": TEMPLATE, "steps": STEPS, "seed": SEED, "lr": LR, "beta": BETA, "pairs": PAIRS,
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                        "trl": trl.__version__},
           "dpo": dpo(), "orpo": orpo()}
    for name in ("dpo", "orpo"):
        print(name, [round(s["loss"], 6) for s in out[name]])
    (HERE / "preference.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
