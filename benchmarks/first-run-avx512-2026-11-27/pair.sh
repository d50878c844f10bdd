#!/bin/bash
# alternate auto and 4x2 on the study's rows; print each run's trained time and tokens/s
D=/work/shared/data/bitext-early-official-4514rows/Bitext_Sample_Customer_Support_Training_Dataset.csv
extra="$@"
for i in 1 2 3; do
  for cfg in auto 4; do
    out=/tmp/study/pair-$cfg-$i; rm -rf $out
    if [ $cfg = auto ]; then b="--batch-size auto"; else b="--batch-size 4 --grad-accum 2"; fi
    /work/main/.venv/bin/tunebench train --data $D --max-samples 102 --max-length 128 --effective-batch-size 8 $b --output-dir $out --no-progress $extra > $out.log 2>&1
    python3 -c "import json;s=json.load(open('$out/summary.json'));print('$cfg', $i, s.get('micro_batch_size'), round(s['train_time_s'],1) if 'train_time_s' in s else s.get('duration_seconds'), s.get('measure_s'), round(s.get('tokens_per_s') or 0))"
  done
done
