"""Golden per-step GRPO losses, rewards and KL from TRL's GRPOTrainer, for tests/test_grpo.py.

The reference is TRL's own trainer, not tunebench's code. Sampling is the one part left out: TRL's rollout_func
hook hands it fixed completions (a table, step by step), so everything after generation is TRL's: the rewards
(the two functions below, with weights), the group advantages, the reference pass (the adapter off), the
per-token loss with its normalisation, transformers.Trainer's AdamW, linear schedule and clipping. Each step is one
prompt's group of four completions, scored at temperature 0.7 (TRL divides the logits by it). Three settings:
dapo with beta 0.04, dr_grpo with beta 0, grpo with beta 0.04 and scale_rewards none. Only the fixtures are shared
with the test: the tiny preset's weights and tokenizer, and the prompt, completions and settings written into the
JSON.

TRL is not a tunebench dependency; install it to regenerate:

    .venv/bin/pip install --no-deps trl
    .venv/bin/python tests/golden/make_grpo_golden.py    # rewrites tests/golden/grpo.json
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from make_preference_golden import SEED, TEMPLATE, Record, lora

HERE = Path(__file__).parent
STEPS = 4
LR = 1e-2
GROUP = 4
MAX_COMPLETION = 16
TEMPERATURE = 0.7
WEIGHTS = [1.0, 0.5]
PROMPT = "What is 2 plus 3?"
COMPLETIONS = [  # step by step, a group of four
    ["5", "The answer is 5.", "6", "It is 5 or 6, I think"],
    ["2 plus 3 is 5", "five", "3", "5"],
    ["I do not know", "5.", "The sum is 5", "23"],
    ["5", "5", "5", "4"],
]
SETTINGS = {"dapo": {"loss_type": "dapo", "beta": 0.04, "scale_rewards": "group"},
            "dr_grpo": {"loss_type": "dr_grpo", "beta": 0.0, "scale_rewards": "group"},
            "grpo": {"loss_type": "grpo", "beta": 0.04, "scale_rewards": "none"}}
REWARDS = '''
def length(prompts, completions, **kwargs):
    return [len(c) / 20 for c in completions]


def five(prompts, completions, **kwargs):
    return [1.0 if "5" in c else 0.0 for c in completions]
'''
METRICS = ("grad_norm", "kl", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "rewards/length/mean",
           "rewards/five/mean")


def completion_ids(tok) -> list[list[list[int]]]:
    return [[tok(c + tok.eos_token, add_special_tokens=False)["input_ids"] for c in group] for group in COMPLETIONS]


def grpo(settings: dict) -> list[dict]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tunebench.model.models import resolve

    namespace: dict = {}
    exec(REWARDS, namespace)
    tiny = resolve("tiny")
    tok = tiny.tokenizer
    prompt_ids = tok(TEMPLATE.format(instruction=PROMPT), add_special_tokens=False)["input_ids"]
    table = completion_ids(tok)
    calls = []

    def rollout(prompts, trainer):  # the group of this step, from the table
        group = table[len(calls)]
        calls.append(prompts)
        return {"prompt_ids": [prompt_ids] * len(prompts), "completion_ids": group,
                "logprobs": [[0.0] * len(c) for c in group]}

    record = Record(METRICS)
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, max_steps=STEPS, per_device_train_batch_size=GROUP,
                          gradient_accumulation_steps=1, learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0,
                          weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", logging_steps=1,
                          save_strategy="no", report_to=[], use_cpu=True, seed=SEED, data_seed=SEED, disable_tqdm=True,
                          bf16=False, gradient_checkpointing=False, num_generations=GROUP,
                          max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE, reward_weights=WEIGHTS,
                          epsilon=0.2, **settings)
        GRPOTrainer(model=lora(tiny.model), reward_funcs=[namespace["length"], namespace["five"]], args=args,
                    train_dataset=Dataset.from_list([{"prompt": PROMPT}] * 8), processing_class=tok,
                    rollout_func=rollout, callbacks=[record]).train()
    assert len(calls) == STEPS, calls
    return record.steps


def main() -> None:
    import peft
    import transformers
    import trl

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    out = {"template": TEMPLATE, "steps": STEPS, "seed": SEED, "lr": LR, "group": GROUP,
           "max_completion_length": MAX_COMPLETION, "temperature": TEMPERATURE, "weights": WEIGHTS, "prompt": PROMPT,
           "completions": COMPLETIONS, "rewards": REWARDS, "settings": SETTINGS,
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                        "trl": trl.__version__}}
    for name, settings in SETTINGS.items():
        out[name] = grpo(settings)
        print(name, [round(s["loss"], 6) for s in out[name]])
    (HERE / "grpo.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
