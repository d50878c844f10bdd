#!/bin/bash
# seed 1: RFT again, on this EPYC at a8d0292 (its first RFT arm trained on a Xeon in fp32 at 443864b), judged on every set
cd /tmp/wt-arm
export PYTHONPATH=/tmp/wt-arm/src
PY=/work/main/.venv/bin/python
date
$PY benchmarks/agent_rl_arms.py --seeds 1 --minutes 45 --out /work/arms --arm "rft-epyc=rft --attention tunebench" --final
echo "exit $?"
date
