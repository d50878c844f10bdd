#!/usr/bin/env bash
# issue 95 items 4/6 for judgements: KTO on 240 Bitext judgements, bf16 forced on this AVX512-BF16 Xeon, micro 1 x 4,
# 30 steps, max length 128, each from an empty cache; before (0d0247a: judged rows padded to their longest) and
# after (ec55360: to a multiple of 16), alternating, two rounds.
set -u
py=/work/main/.venv/bin/python
for round in 1 2; do
  for side in before after; do
    tree=/tmp/bench; [[ $side == after ]] && tree=/tmp/bench2
    out=/tmp/kto-$side-$round; rm -rf $out /tmp/cache-kto
    TUNEBENCH_CACHE=/tmp/cache-kto PYTHONPATH=$tree/src $py -m tunebench train --objective kto \
      --data /work/results/kto/judged.jsonl --precision bf16 --batch-size 1 --effective-batch-size 4 \
      --max-steps 30 --max-length 128 --output-dir $out --no-progress > /work/results/kto/$side-$round.log 2>&1
    echo "$side $round rc $?" >> /work/results/kto/ab.txt
    mkdir -p /work/results/kto/$side-$round && cp $out/summary.json $out/plan.json $out/metrics.jsonl /work/results/kto/$side-$round/
  done
done
