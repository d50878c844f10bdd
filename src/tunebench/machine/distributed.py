"""The process group a run belongs to: torch.distributed, as torchrun launched it (or a world of one).

Every collective a job uses goes through here, so the single-process path is the same code with
a world of size 1 and no process group. Rank 0 alone decides what needs measuring, writes files
and talks to the user; the others receive its answers (`agree`), never race it for a cache file.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import pathlib
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tunebench.core import startup
from tunebench.core.errors import TunebenchError

T = TypeVar("T")
LAUNCH_MARK = "TUNEBENCH_LAUNCHED"  # set by `tunebench launch`: OMP_NUM_THREADS is its own per-rank split


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1  # ranks on this machine
    backend: str | None = None  # None: no process group (a plain single-process run)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.size // self.local_size)

    def describe(self) -> str:
        if self.backend is None:
            return "1 process"
        return (f"{self.size} process(es) on {self.nodes} node(s), {self.local_size} per node; this is rank "
                f"{self.rank} (local rank {self.local_rank}); backend {self.backend}")


def launched() -> bool:
    """True under torchrun (or any launcher that sets the torch.distributed environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device_type: str, backend: str = "auto") -> World:
    """Join the process group torchrun set up: nccl on CUDA, gloo on CPU unless `backend` names one.
    Outside torchrun, a world of one with no process group."""
    if not launched():
        return World()
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:  # a torchrun rank: its own session, so only this reaches it when the agent
        startup.die_with_parent(os.getppid())  # (tunebench launch, or a compare above it) is killed
        startup.watch_parent(os.getppid())  # and a rank stuck in a collective, whose handler cannot run, too
    world = World(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                  int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    chosen = backend if backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    if chosen == "nccl" and device_type != "cuda":
        raise TunebenchError("--backend nccl needs CUDA GPUs; use --backend gloo (or auto) on CPU")
    if device_type == "cuda":
        torch.cuda.set_device(world.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(chosen, device_id=torch.device("cuda", world.local_rank)
                                if device_type == "cuda" else None)
    if dist.get_world_size() != world.size:  # the environment and the group must agree
        raise TunebenchError(f"torch.distributed reports {dist.get_world_size()} processes but WORLD_SIZE is "
                             f"{world.size}; launch with torchrun or tunebench launch")
    return World(world.rank, world.size, world.local_rank, world.local_size, chosen)


def shutdown(world: World) -> None:
    """Leave the process group together, and free it while the interpreter is alive. A gloo group last
    released at interpreter exit (a DDP reducer still holding it) can abort the process there
    ("terminate called without an active exception"), so callers drop their DDP module first."""
    if world.backend is not None and dist.is_initialized():

        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def device_for(world: World, device_type: str) -> torch.device:
    return torch.device("cuda", world.local_rank) if device_type == "cuda" else torch.device(device_type)


def barrier(world: World) -> None:
    if world.backend is not None:
        dist.barrier()


def _carrier(world: World) -> torch.device:
    """Where a collective's tensor must live: nccl only moves GPU tensors."""
    return torch.device("cuda", world.local_rank) if world.backend == "nccl" else torch.device("cpu")


def all_sum(values: list[float], world: World) -> list[float]:
    """Element-wise sum over ranks of a few host numbers (float64: exact for token counts)."""
    if world.backend is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_carrier(world))
    dist.all_reduce(t)
    return t.tolist()


_alone = [0]  # how deep this process is inside code its other ranks do not run (see alone)


@contextlib.contextmanager
def alone():
    """Code one rank runs while the others wait for it (agree's `decide`: rank 0's measurements, whose probe steps
    run the objective's loss): a collective there would wait for ranks that are not coming, so `sum_in_step`
    leaves a tensor as it is inside it. KTO's reference point all-reduced inside rank 0's probe step and hung
    both ranks at the defaults (issue 81)."""
    _alone[0] += 1
    try:
        yield
    finally:
        _alone[0] -= 1


def sum_in_step(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over the ranks in place, where every rank runs this same step (the loop's); as it is in one
    process, and inside `alone`."""
    if not _alone[0] and dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def _encode(value: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _decode(data: torch.Tensor, safe: Sequence[type]) -> Any:
    """A peer's value, read back by torch's weights_only unpickler: plain containers, numbers, strings,
    tensors and the classes in `safe` only. The rendezvous of a multi-node run is not authenticated, and
    torch.distributed's *_object collectives unpickle whatever a peer sends (code included)."""
    with torch.serialization.safe_globals([*SAFE, *safe]):
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)


SAFE: tuple[type, ...] = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)


def agree(world: World, decide: Callable[[], T], safe: Sequence[type] = ()) -> T:
    """Rank 0 runs `decide` and every rank returns its answer, or raises its error: ranks never disagree,
    and a refusal on rank 0 stops the others instead of leaving them waiting in a collective. The answer
    travels as bytes in a tensor and is read with `_decode` (classes beyond plain data: `safe`)."""
    if world.backend is None:
        return decide()
    if world.main:
        try:
            with alone():
                value = decide()
            _broadcast(("ok", value), world, safe)
            return value
        except TunebenchError as e:
            _broadcast(("error", (str(e), e.exit_code)), world, safe)
            raise
        except BaseException as e:  # noqa: BLE001 - told to the others, then raised here as it was
            _broadcast(("error", (f"rank 0 failed: {type(e).__name__}: {e}", 1)), world, safe)
            raise
    kind, value = _broadcast(None, world, safe)
    if kind == "error":
        error = TunebenchError(*value)
        error.echo = True  # an echo of rank 0's refusal, which rank 0 says; the others stay quiet
        raise error
    return value


def _broadcast(value: Any, world: World, safe: Sequence[type]) -> Any:
    """Rank 0's `value` on every rank: its length, then its bytes (two plain-tensor broadcasts)."""
    carrier = _carrier(world)
    data = _encode(value).to(carrier) if world.main else None
    size = torch.tensor([data.numel() if world.main else 0], dtype=torch.int64, device=carrier)
    dist.broadcast(size, src=0)
    if not world.main:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=carrier)
    dist.broadcast(data, src=0)
    return value if world.main else _decode(data, safe)


def gather(world: World, value: T, safe: Sequence[type] = ()) -> list[T] | None:
    """Every rank's `value`, on rank 0 (None elsewhere); it travels as bytes in a tensor, read with `_decode`."""
    if world.backend is None:
        return [value]
    carrier = _carrier(world)
    data = _encode(value).to(carrier)
    sizes = [torch.zeros(1, dtype=torch.int64, device=carrier) for _ in range(world.size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=carrier))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=carrier)
    padded[:data.numel()] = data
    # all_gather, not gather: every backend has it, and a few kilobytes per rank cost nothing
    parts = [torch.empty(longest, dtype=torch.uint8, device=carrier) for _ in range(world.size)]
    dist.all_gather(parts, padded)
    if not world.main:
        return None
    return [value if r == 0 else _decode(part[:int(size.item())], safe)
            for r, (part, size) in enumerate(zip(parts, sizes))]


@contextlib.contextmanager
def local_rank0_first(world: World):
    """Local rank 0 runs the body (tokenizing into the cache, say) before the other ranks on its machine
    run it: they then read what it wrote instead of racing it for the same file."""
    if world.backend is not None and world.local_rank != 0:
        dist.barrier()
    yield
    if world.backend is not None and world.local_rank == 0:
        dist.barrier()


def shard(rows: list[int], world: World, micro_batch_size: int) -> list[int]:
    """This rank's rows of one global micro-step (`micro_batch_size` rows per rank, contiguous):
    rank r's rows are those a single process with micro batch x world size would hold at r's place.
    A short last batch leaves later ranks fewer rows, possibly none."""
    return rows[world.rank * micro_batch_size:(world.rank + 1) * micro_batch_size]


def wrap_ddp(module: torch.nn.Module, world: World, device: torch.device) -> torch.nn.Module:
    """DistributedDataParallel over `module` (its forward is the loss). Buffers are not broadcast on
    every forward: ours (rotary frequencies, position ids) are the same everywhere from the start."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)


def gradient_sync(module: torch.nn.Module, enabled: bool):
    """Context for one micro-batch's backward: without sync (accumulate locally) on all but the last
    micro-batch of an optimizer step, so gradients cross the network once per step."""
    if enabled:
        return contextlib.nullcontext()
    if hasattr(module, "no_sync"):  # DDP
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        @contextlib.contextmanager
        def off():
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
        return off()
    return contextlib.nullcontext()


def _state_options(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, ignore_frozen_params=True, **extra)


def full_state(model: torch.nn.Module, optimizer, world: World) -> tuple[dict | None, dict | None]:
    """(trainable weights, optimizer state), whole and on the CPU, keyed by parameter name, from
    torch.distributed.checkpoint: one format whether the model is plain, a DDP replica or sharded by
    FSDP, so a checkpoint resumes under any world size. Every rank calls it; rank 0 gets the dicts."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _state_options(cpu_offload=True)
    with _frozen_extras_hidden(model):
        weights = get_model_state_dict(model, options=options)
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not world.main:
        return None, None
    clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731 - not views of live weights
    return ({k: clone(v) for k, v in weights.items()},
            {"state": {k: {n: clone(v) for n, v in s.items()} for k, s in optim_state["state"].items()},
             "param_groups": optim_state["param_groups"]})


def load_full_state(model: torch.nn.Module, optimizer, weights: dict, optim_state: dict, world: World) -> None:
    """Put whole weights and optimizer state (from `full_state`) into this rank's model and optimizer,
    sharding them again where the model is sharded."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    options = _state_options(strict=False)
    with _frozen_extras_hidden(model):
        set_model_state_dict(model, weights, options=options)
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)


@contextlib.contextmanager
def _frozen_extras_hidden(model: torch.nn.Module):
    """Frozen layers that add their own entries to a state dict save only their parameters and buffers
    meanwhile. bitsandbytes' 8-bit layers add 'SCB' and 'weight_format', which are not attributes, and
    torch.distributed.checkpoint looks every key up as one (AttributeError on the first save of an 8-bit
    QLoRA run on a GPU). A checkpoint holds trainable state only; the frozen base is rebuilt on resume."""
    plain = torch.nn.Module._save_to_state_dict
    hidden = [m for m in model.modules() if type(m)._save_to_state_dict is not plain
              and any(True for _ in m.parameters(recurse=False))
              and not any(p.requires_grad for p in m.parameters(recurse=False))]
    for m in hidden:
        m._save_to_state_dict = types.MethodType(plain, m)
    try:
        yield
    finally:
        for m in hidden:
            del m._save_to_state_dict


def shard_fsdp(root: torch.nn.Module, model: torch.nn.Module, world: World, device: torch.device) -> None:
    """FSDP2 over `root` (the loss module around `model`): each decoder block its own unit (its weights are
    gathered just before it runs and freed after), the embeddings, final norm and head in the root's.
    On a CPU the device mesh is named explicitly: FSDP2 would otherwise look for an accelerator."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world.size,))
    block_types = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_types]
    if not blocks:
        raise TunebenchError(f"{type(model).__name__} names no decoder block type to shard; use --parallel ddp")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(root, mesh=mesh)


def full_weights(model: torch.nn.Module, world: World) -> dict | None:
    """A sharded model's whole state dict on rank 0's CPU (every rank calls it: gathering is a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A tied weight (the head sharing the embeddings) appears under both names, now as two copies that
    # save_pretrained cannot tell are one: keep the name named_parameters() gives it.
    own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return {k: v for k, v in weights.items() if k in own} if world.main else None
