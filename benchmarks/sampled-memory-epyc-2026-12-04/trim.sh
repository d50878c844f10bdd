#!/bin/bash
# The heap handed back around each draw (grpo/steps.py), measured as two pairs of 6-step runs of memexp.py, alone:
# B: base (the code before, 2264e11, from a worktree at /tmp/wt-base) then trim (the change), one cache warmed by
# the first; then B-caps (the change, oneDNN's and ideep's kernel caches capped at 8, a cache of its own);
# C: trim then base, each from an empty cache. Run from the repository root.
KEEP="glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4611686018427387904:glibc.malloc.tcache_max=16"
M=benchmarks/sampled-memory-epyc-2026-12-04/memexp.py
W=/work/memexp2
TUNEBENCH_CACHE=$W/cache GLIBC_TUNABLES=$KEEP PYTHONPATH=/tmp/wt-base/src .venv/bin/python $M $W/base 6 > B-base.txt 2>&1
TUNEBENCH_CACHE=$W/cache GLIBC_TUNABLES=$KEEP .venv/bin/python $M $W/trim 6 > B-trim.txt 2>&1
TUNEBENCH_CACHE=$W/cache-caps GLIBC_TUNABLES=$KEEP ONEDNN_PRIMITIVE_CACHE_CAPACITY=8 LRU_CACHE_CAPACITY=8 \
    .venv/bin/python $M $W/caps 6 > B-caps.txt 2>&1
TUNEBENCH_CACHE=$W/c-trim2 GLIBC_TUNABLES=$KEEP .venv/bin/python $M $W/trim2 6 > C-trim.txt 2>&1
TUNEBENCH_CACHE=$W/c-base2 GLIBC_TUNABLES=$KEEP PYTHONPATH=/tmp/wt-base/src .venv/bin/python $M $W/base2 6 > C-base.txt 2>&1
