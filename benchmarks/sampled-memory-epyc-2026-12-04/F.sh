#!/bin/bash
# Room for a decode's tokens reserved in its KV cache at once (F-reserve.diff applied to 41a5630: "res") against
# 41a5630 as it is ("base", a worktree at /tmp/wt-base): res, base, base, res; each from an empty cache, alone
cd /work/main
KEEP="glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4611686018427387904:glibc.malloc.tcache_max=16"
M=benchmarks/sampled-memory-epyc-2026-12-04/memexp.py
W=$W
rm -rf $W/F-* $W/cF-*
for name in res1 base1 base2 res2; do
  if [[ $name == base* ]]; then PP=/tmp/wt-base/src; else PP=; fi
  TUNEBENCH_CACHE=$W/cF-$name GLIBC_TUNABLES=$KEEP PYTHONPATH=$PP .venv/bin/python $M $W/F-$name 6 > $W/F-$name.txt 2>&1
done
