#!/usr/bin/env bash
# issue 95 item 5 on this class: the README's compare three times from an empty measurement cache, then the
# AVX2 stand-in (fp32 forced by a copy of the quick matrix with hardware.precision: fp32) three times.
set -u
cd /tmp/bench
py=/work/main/.venv/bin/python
for tag in ${TAGS:-c1 c2 c3 f1 f2 f3}; do
  rm -rf runs/compare /tmp/cache-$tag
  matrix=()
  [[ $tag == f* ]] && matrix=(--matrix /work/results/quick-fp32.yaml)
  start=$(date +%s)
  TUNEBENCH_CACHE=/tmp/cache-$tag PYTHONPATH=/tmp/bench/src $py -m tunebench compare "${matrix[@]}" > /work/results/compare-$tag.log 2>&1
  echo "$tag rc $? $(( $(date +%s) - start )) s" >> /work/results/compares.txt
  cp -r runs/compare /work/results/compare-$tag
  cp /tmp/cache-$tag/autotune.json /work/results/compare-$tag/autotune-cache.json 2>/dev/null
done
