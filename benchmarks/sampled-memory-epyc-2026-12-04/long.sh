#!/bin/bash
# 40 RFT steps of memexp.py from an empty measurement cache, alone (the fixes of the seventeenth session in: the heap
# handed back around each draw, whole rows to the output head while decoding): does the floor keep climbing over a
# longer run? Run from the repository root; I-long.txt is its output, I-long-summary.json the run's summary.json.
KEEP="glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4611686018427387904:glibc.malloc.tcache_max=16"
TUNEBENCH_CACHE=/work/memlong/cache GLIBC_TUNABLES=$KEEP PYTHONPATH=src .venv/bin/python \
    benchmarks/sampled-memory-epyc-2026-12-04/memexp.py /work/memlong/rft40 40 > I-long.txt 2>&1
