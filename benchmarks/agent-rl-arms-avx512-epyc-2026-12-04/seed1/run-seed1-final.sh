#!/bin/bash
cd /tmp/wt-arm
export PYTHONPATH=/tmp/wt-arm/src
PY=/work/main/.venv/bin/python
date
$PY /work/arms/judge_start.py /work/arms/seed1/arms/grpo-weigh /work/arms/seed1/start /work/arms/seed1/data/val.jsonl /work/arms/seed1/start-remade-judged-val.json 2>&1 | tail -3
date
$PY benchmarks/agent_rl_arms.py --seeds 1 --minutes 45 --out /work/arms --arm "rft=rft --attention tunebench" --arm "grpo=grpo --attention tunebench" --arm "grpo-levers=grpo --attention tunebench --turn-credit state --resample-alike 2 --balance-kinds on --beta 0.04" --arm "grpo-weigh=grpo --attention tunebench --weigh-kinds on" --final
echo "exit $?"
date
