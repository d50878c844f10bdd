#!/bin/bash
# seed 1: GRPO at its default with --kind-column (kinds weighed), failures' credit x 0.5; trained, judged on validation, then held-out
cd /tmp/wt-arm
export PYTHONPATH=/tmp/wt-arm/src
PY=/work/main/.venv/bin/python
date
$PY benchmarks/agent_rl_arms.py --seeds 1 --minutes 45 --out /work/arms --arm "grpo-neg50=grpo --attention tunebench --negative-weight 0.5"
echo "exit $?"
date
$PY benchmarks/agent_rl_arms.py --seeds 1 --minutes 45 --out /work/arms --arm "grpo-neg50=grpo --attention tunebench --negative-weight 0.5" --arm "rft=rft --attention tunebench" --arm "grpo=grpo --attention tunebench" --arm "grpo-levers=grpo --attention tunebench --turn-credit state --resample-alike 2 --balance-kinds on --beta 0.04" --arm "grpo-weigh=grpo --attention tunebench --weigh-kinds on" --final
echo "exit $?"
date
