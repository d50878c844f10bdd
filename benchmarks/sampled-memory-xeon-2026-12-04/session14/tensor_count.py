"""`tunebench` with a count of the tensors Python can reach after each optimizer step (their storages' bytes) beside
the resident memory: whether memory that grows from step to step is held by live tensors.

    GLIBC_TUNABLES=<tunebench.core.startup.KEEP_FREED> python tensor_count.py train ...

GLIBC_TUNABLES naming malloc settings keeps the command from starting itself again (core.startup), which would
lose the patch below."""

import gc
import runpy
import sys

import torch

import tunebench.training.loop as loop

_update = loop._update


def counted(*args, **kwargs):
    out = _update(*args, **kwargs)
    gc.collect()
    tensors = [o for o in gc.get_objects() if torch.is_tensor(o)]
    storages: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))
    print(f"TENSORS {len(tensors)} storages {len(storages)} {sum(storages.values()) / 2**20:.1f} MB; "
          f"objects {len(gc.get_objects())}; rss {rss} MB", flush=True)
    return out


loop._update = counted
sys.argv = ["tunebench", *sys.argv[1:]]
runpy.run_module("tunebench", run_name="__main__")
