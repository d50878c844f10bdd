#!/usr/bin/env bash
# issue 95 item 3 on this class: three compares on ONE measurement cache, each a new shape (the built-in data, then
# alpaca_en_demo, then GSM8K): the third's rows are predicted from their probes corrected by what the first two
# compares' runs trained at against theirs (per micro batch where two agree).
set -u
cd /tmp/bench
py=/work/main/.venv/bin/python
rm -rf /tmp/cache-warm runs
for tag in w1 w2 w3; do
  case $tag in
    w1) data=() ;;
    w2) data=(--data /tmp/shared/data/llamafactory-demo-data/alpaca_en_demo.json) ;;
    w3) data=(--data /tmp/shared/data/gsm8k/train.jsonl) ;;
  esac
  start=$(date +%s)
  TUNEBENCH_CACHE=/tmp/cache-warm PYTHONPATH=/tmp/bench/src $py -m tunebench compare "${data[@]}" --output runs/$tag/results.csv > /work/results/warm/compare-$tag.log 2>&1
  echo "$tag rc $? $(( $(date +%s) - start )) s" >> /work/results/warm/compares.txt
  cp -r runs/$tag /work/results/warm/compare-$tag
  cp /tmp/cache-warm/autotune.json /work/results/warm/compare-$tag/autotune-cache.json 2>/dev/null
done
