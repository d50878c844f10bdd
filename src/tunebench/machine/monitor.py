"""A background sampler (about once a second, off the training thread) of CPU, RAM and GPU use."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunebench.core.durable import open_no_follow


class Monitor:
    """Samples into monitor.jsonl; `summary()` gives means and peaks for summary.json."""

    def __init__(self, path: Path | None, interval_s: float = 1.0, gpu_indices: tuple[int, ...] = (),
                 sink: Callable[[dict[str, Any]], None] | None = None):
        import psutil

        self._sink = sink  # each sample also goes here (the run's trackers)
        self._proc = psutil.Process()
        self._psutil = psutil
        self._path = path
        self._interval = interval_s
        self._stop = threading.Event()
        self._samples: list[dict[str, Any]] = []
        self._nvml = []
        if gpu_indices:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in gpu_indices]
                self._pynvml = pynvml
            except Exception:  # no NVML (no driver, no nvidia-ml-py): GPU columns stay empty
                self._nvml = []
        self._thread = threading.Thread(target=self._run, name="tunebench-monitor", daemon=True)

    def sample(self) -> dict[str, Any]:
        mem = self._psutil.virtual_memory()
        row: dict[str, Any] = {
            "time": time.time(),
            "cpu_percent": self._psutil.cpu_percent(interval=None),  # of all CPUs together
            "process_cpu_percent": self._proc.cpu_percent(interval=None),  # 100 per CPU this process keeps busy
            "process_rss_mb": self._proc.memory_info().rss / 2**20,
            "ram_used_mb": (mem.total - mem.available) / 2**20,
        }
        for i, handle in self._nvml:
            nv = self._pynvml
            util = nv.nvmlDeviceGetUtilizationRates(handle)
            info = nv.nvmlDeviceGetMemoryInfo(handle)
            row[f"gpu{i}_util_percent"] = util.gpu
            row[f"gpu{i}_memory_mb"] = info.used / 2**20
            row[f"gpu{i}_power_w"] = nv.nvmlDeviceGetPowerUsage(handle) / 1000
        return row

    def _run(self) -> None:
        self._psutil.cpu_percent(interval=None)  # the first readings are meaningless; prime them
        self._proc.cpu_percent(interval=None)
        f = self._file
        try:
            while not self._stop.wait(self._interval):
                row = self.sample()
                self._samples.append(row)
                if self._sink:
                    self._sink(row)
                if f:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
        finally:
            if f:
                f.close()

    def __enter__(self) -> Monitor:
        # opened here, not in the thread: a link planted in the run directory is refused in one line
        self._file = open_no_follow(self._path, "a") if self._path else None
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def summary(self) -> dict[str, float]:
        if not self._samples:
            return {}
        out: dict[str, float] = {}
        keys = {k for s in self._samples for k in s if k != "time"}
        for k in sorted(keys):
            values = [s[k] for s in self._samples if k in s]
            if k.endswith(("_percent", "_power_w")):
                out[f"mean_{k}"] = round(sum(values) / len(values), 1)
            else:
                out[f"peak_{k}"] = round(max(values), 1)
        return out


def other_load(own_threads: int, interval_s: float = 0.5) -> tuple[float | None, str | None]:
    """(runnable threads beyond this run's own, the busiest other process) right now.

    CPU shares cannot tell who is waiting: beside another busy process, this run's OpenMP threads
    spin while they wait and still show as busy. The load average counts threads that want a CPU, so
    what exceeds this run's threads is the others' demand. Linux and macOS; (None, None) elsewhere.
    """
    import psutil

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None, None
    me = os.getpid()
    procs = [p for p in psutil.process_iter(["name"]) if p.pid != me]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(interval_s)
    usage = []
    for p in procs:
        try:
            usage.append((p.cpu_percent(None), f"{p.info['name']} (pid {p.pid})"))
        except psutil.Error:
            pass
    busiest = max(usage, default=None)
    name = f"{busiest[1]} at {busiest[0] / 100:.1f} CPUs" if busiest and busiest[0] >= 10 else None
    return max(0.0, load - own_threads), name



class CoreShare:
    """How much of the cores this run's threads needed went to someone else while it ran: other processes, or the
    host (a VM's steal time), from the kernel's per-CPU counters of the CPUs this process may run on.

    The CPU time each process got cannot say whether it waited (OpenMP threads spin while they wait and read as
    busy), but the counters are conserved: over `wall` seconds the run's threads could have had what stayed idle
    plus what the run itself used. needed = threads x wall; shared = 1 - (idle + own) / needed, at least 0. On 2
    cores with one other busy process that is about half; on a 64-core host whose other 30 busy cores leave 32
    idle, nothing. Ranks on one machine count as alike (`ranks` of this one's own time). Linux (psutil's per-CPU
    times); None elsewhere."""

    def __init__(self, threads: int, ranks: int = 1):

        import psutil

        self._psutil, self.threads, self.ranks = psutil, threads, ranks
        try:
            self._cpus = sorted(os.sched_getaffinity(0))
        except AttributeError:  # macOS, Windows: no affinity
            self._cpus = None
        self._start = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        """(monotonic seconds, idle CPU seconds on our CPUs, this process tree's CPU seconds)."""
        psutil = self._psutil
        if self._cpus is None:
            return None
        try:
            per_cpu = psutil.cpu_times(percpu=True)
            idle = sum(t.idle + getattr(t, "iowait", 0.0) for i, t in enumerate(per_cpu) if i in self._cpus)
            me = psutil.Process()
            own = sum(me.cpu_times()[:4])  # user, system, and the children waited for
            for child in me.children(recursive=True):
                try:
                    own += sum(child.cpu_times()[:2])
                except psutil.Error:
                    pass
        except (psutil.Error, OSError):
            return None
        return time.monotonic(), idle, own

    def shared(self) -> float | None:
        """The share of the needed core time that went elsewhere since this was made (0..1), or None."""
        end = self._read()
        if self._start is None or end is None:
            return None
        wall = end[0] - self._start[0]
        needed = min(self.threads * self.ranks, len(self._cpus)) * wall
        if needed <= 0:
            return None
        available = (end[1] - self._start[1]) + self.ranks * (end[2] - self._start[2])
        return round(max(0.0, 1.0 - available / needed), 3)
