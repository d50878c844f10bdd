#!/bin/bash
# seed 0: GRPO at its default with --kind-column (kinds weighed) and two updates a draw, judged on validation
cd /tmp/wt-arm
PYTHONPATH=/tmp/wt-arm/src /work/main/.venv/bin/python benchmarks/agent_rl_arms.py --seeds 0 --minutes 45 --out /work/arms --arm "grpo-iter2=grpo --attention tunebench --num-iterations 2"
echo "exit $?"
date
