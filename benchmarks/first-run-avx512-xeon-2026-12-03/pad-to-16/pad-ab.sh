#!/usr/bin/env bash
# bf16 forced on this CPU, micro 1 x 8, 12 steps of the built-in rows, empty caches: before (padded to the longest
# row, /tmp/bench at 6c50162) against after (rounded to 16, /work/main), twice each, alternating
cd /tmp
py=/work/main/.venv/bin/python
for round in 1 2; do
  for side in before after; do
    src=/tmp/bench/src; [[ $side == after ]] && src=/work/main/src
    out=/work/results/pad-$side-$round; rm -rf $out /tmp/cache-pad-$side-$round
    TUNEBENCH_CACHE=/tmp/cache-pad-$side-$round PYTHONPATH=$src $py -m tunebench train --precision bf16 \
      --batch-size 1 --effective-batch-size 8 --max-samples 104 --max-length 128 --output-dir $out > $out.log 2>&1
    echo "$side $round rc $?" >> /work/results/pad-ab.txt
  done
done
