#!/bin/bash
# seed 1's start made again as the Xeon made it (fp32, micro 4 x 2, tunebench attention, no compile, no
# checkpointing: its plan.json), then the weighed GRPO arm at 45 minutes, judged on validation
cd /tmp/wt-arm
export PYTHONPATH=/tmp/wt-arm/src
PY=/work/main/.venv/bin/python
S=/work/arms/seed1
date
if [ ! -f $S/start/config.json ]; then
$PY -m tunebench train --model smollm2-135m-instruct --data $S/data/sft.jsonl --output-dir $S/sft \
  --epochs 2 --max-length 1024 --eval-fraction 0 --no-progress --lr 1e-3 --lora-r 16 --lora-alpha 32 \
  --target-modules all-linear --seed 1 --precision fp32 --batch-size 4 --grad-accum 2 --attention tunebench \
  --compile off --gradient-checkpointing off || exit 1
$PY -m tunebench merge --adapter $S/sft --output-dir $S/start || exit 1
fi
date
$PY benchmarks/agent_rl_arms.py --seeds 1 --minutes 45 --out /work/arms --arm "grpo-weigh=grpo --attention tunebench --weigh-kinds on"
echo "exit $?"
date
