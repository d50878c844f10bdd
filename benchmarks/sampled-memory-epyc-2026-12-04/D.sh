#!/bin/bash
# The keys' length rounded up to 64 in bf16 decoding (D-key-multiple.diff applied to 615d6db: "pad") against
# 615d6db as it is ("base", a worktree at /tmp/wt-base): pad, base, base, pad; each from an empty cache, alone
cd /work/main
KEEP="glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4611686018427387904:glibc.malloc.tcache_max=16"
M=benchmarks/sampled-memory-epyc-2026-12-04/memexp.py
W=/work/memexp2
rm -rf $W/D-* $W/cD-*
for name in pad1 base1 base2 pad2; do
  if [[ $name == base* ]]; then PP=/tmp/wt-base/src; else PP=; fi
  TUNEBENCH_CACHE=$W/cD-$name GLIBC_TUNABLES=$KEEP PYTHONPATH=$PP .venv/bin/python $M $W/D-$name 6 > $W/D-$name.txt 2>&1
done
