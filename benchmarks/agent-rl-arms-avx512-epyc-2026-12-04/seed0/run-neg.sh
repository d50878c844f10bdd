#!/bin/bash
# seed 0: GRPO at its default with --kind-column (kinds weighed), failures' credit x 0.25, judged on validation
cd /tmp/wt-arm
PYTHONPATH=/tmp/wt-arm/src /work/main/.venv/bin/python benchmarks/agent_rl_arms.py --seeds 0 --minutes 45 --out /work/arms --arm "grpo-neg25=grpo --attention tunebench --negative-weight 0.25"
echo "exit $?"
date
