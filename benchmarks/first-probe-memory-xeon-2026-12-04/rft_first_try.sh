#!/bin/bash
# the seed-1 RFT arm's command as the arm first ran it (attention auto), on this session's code; stopped once its plan prints
rm -rf /tmp/oomcheck; cd /work/main
PYTHONPATH=/work/main/src /work/main/.venv/bin/python -m tunebench train --objective rft --model /work/arms/seed1/start --environment /work/main/benchmarks/agent_env.py --data /work/arms/seed1/data/train.jsonl --kind-column kind --num-generations 4 --max-completion-length 48 --max-turns 6 --max-length 1024 --effective-batch-size 4 --eval-fraction 0 --lr 2e-4 --schedule constant --temperature 1.0 --no-progress --seed 1 --output-dir /tmp/oomcheck --max-steps 400 --time-budget 45m > /tmp/oomcheck.log 2>&1 &
pid=$!
peak=0
while kill -0 $pid 2>/dev/null; do
  r=$(ps -o rss= -p $pid 2>/dev/null | tr -d ' '); [ -n "$r" ] && [ "$r" -gt "$peak" ] && peak=$r
  if grep -q "time_estimate" /tmp/oomcheck.log; then sleep 1; kill $pid; break; fi
  sleep 1
done
wait $pid; echo "rc $? max rss sampled ${peak} kB"
grep -E "^  (attention|micro_batch_size|gradient_checkpointing|memory_plan) " /tmp/oomcheck.log | cut -c1-700
grep -E "Killed|Error|error" /tmp/oomcheck.log | head -3
