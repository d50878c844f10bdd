"""Golden per-step KTO losses and metrics from TRL's KTOTrainer, for tests/test_kto.py.

The reference is TRL's own trainer, not tunebench's code: the judged completions are tokenized here by hand
(prompt template, completion + EOS), the adapter comes from peft.get_peft_model, the steps from TRL on top of
transformers.Trainer (its AdamW, its linear schedule, its clipping), one batch of all rows a step in file order
(TRL's sequential sampling: the KL rows pair each prompt with the previous row's completion). Only the fixtures
are shared with the test: the tiny preset's weights and tokenizer, and the rows written into the JSON.

TRL is not a tunebench dependency; install it to regenerate:

    .venv/bin/pip install --no-deps trl
    .venv/bin/python tests/golden/make_kto_golden.py    # rewrites tests/golden/kto.json
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from make_preference_golden import PAIRS, SEED, TEMPLATE, Record, lora

HERE = Path(__file__).parent
STEPS = 5
LR = 1e-2
BETA = 0.1
WEIGHTS = (1.0, 1.33)  # desirable, undesirable: unequal, so that each weight is seen applied
# Unpaired: five pairs' chosen replies desirable, their rejected ones undesirable, interleaved, so that every
# KL row pairs a prompt with another prompt's completion.
ROWS = [row for p in PAIRS for row in (
    {"prompt": p["prompt"], "completion": p["chosen"], "label": True},
    {"prompt": p["prompt"], "completion": p["rejected"], "label": False})][:10]
METRICS = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def kto() -> list[dict]:
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from tunebench.model.models import resolve

    tiny = resolve("tiny")
    tok = tiny.tokenizer
    prompts = [tok(TEMPLATE.format(instruction=r["prompt"]), add_special_tokens=False)["input_ids"] for r in ROWS]
    completions = [tok(r["completion"] + tok.eos_token, add_special_tokens=False)["input_ids"] for r in ROWS]
    data = Dataset.from_list([{"prompt_ids": p, "completion_ids": c, "KL_completion_ids": completions[i - 1],
                               "label": r["label"]} for i, (p, c, r) in enumerate(zip(prompts, completions, ROWS))])
    KTOTrainer._prepare_dataset = lambda self, dataset, *a, **k: dataset  # already tokenized, by hand above
    record = Record(METRICS)
    with tempfile.TemporaryDirectory() as tmp:
        args = KTOConfig(output_dir=tmp, max_steps=STEPS, per_device_train_batch_size=len(ROWS),
                         gradient_accumulation_steps=1, learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0,
                         weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", logging_steps=1,
                         save_strategy="no", report_to=[], use_cpu=True, seed=SEED, data_seed=SEED,
                         disable_tqdm=True, beta=BETA, desirable_weight=WEIGHTS[0], undesirable_weight=WEIGHTS[1],
                         bf16=False, gradient_checkpointing=False, max_length=256, remove_unused_columns=False)
        KTOTrainer(model=lora(tiny.model), args=args, train_dataset=data, processing_class=tok,
                   callbacks=[record]).train()
    return record.steps


def main() -> None:
    import peft
    import transformers
    import trl

    out = {"template": TEMPLATE, "steps": STEPS, "seed": SEED, "lr": LR, "beta": BETA, "weights": WEIGHTS,
           "rows": ROWS, "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                      "peft": peft.__version__, "trl": trl.__version__},
           "kto": kto()}
    print("kto", [round(s["loss"], 6) for s in out["kto"]])
    (HERE / "kto.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
