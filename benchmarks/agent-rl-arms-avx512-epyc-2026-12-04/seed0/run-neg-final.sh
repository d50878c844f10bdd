#!/bin/bash
# seed 0: the arms judged on the held-out and compositional sets (only those not judged before are run)
cd /tmp/wt-arm
PYTHONPATH=/tmp/wt-arm/src /work/main/.venv/bin/python benchmarks/agent_rl_arms.py --seeds 0 --minutes 45 --out /work/arms --arm "rft=rft --attention tunebench" --arm "grpo=grpo --attention tunebench" --arm "grpo-weigh=grpo --attention tunebench --weigh-kinds on" --arm "grpo-neg25=grpo --attention tunebench --negative-weight 0.25" --final
echo "exit $?"
date
