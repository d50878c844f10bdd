#!/bin/bash
# seed 0: RFT again on this EPYC at the current code (its first RFT arm ran older code), so every GRPO-RFT pair is one machine and code; judged on every set
cd /tmp/wt-arm
export PYTHONPATH=/tmp/wt-arm/src
PY=/work/main/.venv/bin/python
date
$PY benchmarks/agent_rl_arms.py --seeds 0 --minutes 45 --out /work/arms --arm "rft-now=rft --attention tunebench" --arm "grpo-neg50=grpo --attention tunebench --negative-weight 0.5" --arm "rft=rft --attention tunebench" --final
echo "exit $?"
date
