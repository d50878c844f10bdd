"""`tunebench launch`: a tunebench job on several processes (and machines) through torchrun itself
(torch.distributed.run), not a launcher of our own. What it adds: one line per failure instead of
torchrun's tracebacks, threads per rank split from the cores this process may use, where
torchrun would set OMP_NUM_THREADS=1 for every rank, and, on one machine, its coordination stores listening on
the loopback interface alone (`loopback_stores`). A run on several machines keeps torchrun's rendezvous, which
listens on every interface: run it on a trusted network (docs/tutorials/distributed.md)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Callable

from tunebench.core.errors import TunebenchError
from tunebench.machine import distributed, hardware

JOBS = ("train", "pretrain")


def run(job_args: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
        rdzv_endpoint: str | None = None, rdzv_id: str = "tunebench",
        check: Callable[[list[str], int], None] | None = None) -> int:
    """torchrun on `job_args`; `check(job_args, world_size)` (the command line's settings check) runs first, so
    a refused setting stops the launch before any rank starts."""
    if job_args[:1] == ["--"]:
        job_args = job_args[1:]
    if not job_args or job_args[0] not in JOBS:
        raise TunebenchError("launch runs a training job: tunebench launch --nproc-per-node 2 -- train [options] "
                             "(or -- pretrain ...)")
    if nproc_per_node < 1 or nnodes < 1:
        raise TunebenchError(f"--nproc-per-node ({nproc_per_node}) and --nnodes ({nnodes}) must be 1 or more")
    if nnodes > 1 and not rdzv_endpoint:
        raise TunebenchError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, an address every node can reach "
                             "(the first node's), the same on every node")
    if not 0 <= node_rank < nnodes:
        raise TunebenchError(f"--node-rank {node_rank} is outside 0..{nnodes - 1}")
    if check is not None:
        check(job_args, nproc_per_node * nnodes)
    if "OMP_NUM_THREADS" not in os.environ:  # the ranks split the cores themselves (see hardware.plan)
        threads = hardware.plan("cpu", "fp32", hardware.detect(), env={"RANK": "0",
                                "LOCAL_WORLD_SIZE": str(nproc_per_node)}).threads
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ[distributed.LAUNCH_MARK] = "1"
    args = ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(nnodes)]
    if rdzv_endpoint:
        args += ["--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                 "--rdzv-id", rdzv_id]
    else:
        # one machine: a rendezvous on a free local port, the ranks told to reach it at the loopback address,
        # and each rank's gloo listener on loopback too (gloo binds what the host name resolves to, a LAN address
        # on most hosts, unless told an interface)
        args += ["--standalone", "--local-addr", "127.0.0.1"]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    args += ["-m", "tunebench", *job_args]

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    try:
        with loopback_stores() if not rdzv_endpoint else contextlib.nullcontext():
            torchrun(parse_args(args))
    except ChildFailedError as e:
        # Each rank has printed its own one-line error; say which ones failed, and exit as the first to fail
        # did (torchrun then stops the others, so theirs is its SIGTERM).
        codes = ", ".join(f"rank {rank} exit {f.exitcode}" for rank, f in sorted(e.failures.items()))
        first = e.get_first_failure()[1].exitcode
        print(f"tunebench: launch: {codes}", file=sys.stderr)
        return first if isinstance(first, int) and first > 0 else 1
    return 0


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 ("lo" on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


@contextlib.contextmanager
def loopback_stores():
    """torchrun's stores (the rendezvous's and the one its ranks share) served on 127.0.0.1 alone while it runs
    in this process. torchrun makes them with TCPStore(host, port, is_master=True), whose server listens on every
    interface whatever the host, so on one machine a host on the LAN could reach a run's unauthenticated store
    and flood or delete its keys. A store's server here is handed a socket bound to loopback (TCPStore's
    master_listen_fd); its clients, the ranks on this machine, reach it there."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    real = dist.TCPStore

    class LoopbackStore(real):
        def __init__(self, host_name, port, *args, is_master=False, **kwargs):
            if is_master and kwargs.get("master_listen_fd") is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.bind(("127.0.0.1", int(port)))
                listener.listen(128)
                host_name, port = "127.0.0.1", listener.getsockname()[1]
                kwargs["master_listen_fd"] = listener.detach()  # the store's now: it listens and closes it
                kwargs["use_libuv"] = False  # the libuv server takes no socket handed to it
            super().__init__(host_name, port, *args, is_master=is_master, **kwargs)

    dist.TCPStore = c10d_rendezvous_backend.TCPStore = LoopbackStore
    try:
        yield
    finally:
        dist.TCPStore = c10d_rendezvous_backend.TCPStore = real
