#!/bin/bash
# GRPO on GSM8K prompts in bf16 (forced) on SmolLM2-135M-Instruct, 6 steps of 4 prompts x 4 completions of up to 64
# tokens; the run's plan against itself (summary.json's plan_check). Run alone, from the repository root, four times in
# a row on one measurement cache: runs 1-2 on the code before plancheck.learn_memory read the as-fed figure, 3-4 after.
for n in 1 2 3 4; do
  .venv/bin/python -m tunebench train --method grpo --reward gsm8k --data ../shared/data/gsm8k/train.jsonl \
    --precision bf16 --num-generations 4 --max-completion-length 64 --effective-batch-size 4 --max-steps 6 \
    --eval-fraction 0 --output-dir /tmp/grpo-bf16/run$n --overwrite --no-progress > run$n.log 2>&1
done
