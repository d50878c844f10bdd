"""The one training loop every job uses. It knows nothing of the CLI, configs or jobs.

One optimizer step = `grad_accum_steps` micro-batches on each of the world's ranks. The loss is
normalised by the number of loss tokens in the whole step, summed over micro-batches and ranks, not
per micro-batch or per rank, so accumulation 2 x micro batch 2 gives exactly the loss and gradients
of micro batch 4, and so do 2 ranks x micro batch 2, however unevenly the loss tokens fall.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tunebench.core.errors import TunebenchError
from tunebench.machine import distributed
from tunebench.machine.distributed import World
from tunebench.training.objective import Batch, example_lengths, prepare, split_output, stat_means, unwrap


@dataclass
class LoopState:
    """Everything besides weights/optimizer that a resumed run needs to continue exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    tokens: int = 0  # real (non-padding) tokens seen
    samples: int = 0  # examples seen (a packed row holds several)
    token_sq: int = 0  # sum over examples of length squared: tokens attend within their own example
    train_time_s: float = 0.0
    measured_tokens: int = 0  # tokens and time of the steps counted in throughput (warm-up excluded)
    measured_time_s: float = 0.0
    data_time_s: float = 0.0  # host time spent producing and preparing batches (input-bound check)
    losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def took_step(self, position: tuple[int, int], tokens: float, samples: float, token_sq: float) -> None:
        """One optimizer step more, its data consumed up to `position` (epoch, batch_in_epoch)."""
        self.step += 1
        self.epoch, self.batch_in_epoch = position
        self.tokens += int(tokens)
        self.samples += int(samples)
        self.token_sq += int(token_sq)


@dataclass(frozen=True)
class LoopSettings:
    total_steps: int
    grad_accum_steps: int
    max_grad_norm: float
    device: torch.device  # the autocast is the objective's own (CausalLMLoss, PreferenceLoss, GRPOLoss)
    logging_steps: int = 1
    eval_steps: int | None = None
    save_steps: int | None = None
    warmup_steps_excluded: int = 2  # from throughput figures
    progress: bool = True
    pin_memory: bool = False  # page-locked host batches, so copies to an accelerator overlap compute
    world: World = World()
    prefetch: bool | None = None  # next steps' batches made on a background thread; None: on CUDA
    # --time-budget of a run whose steps sample: the loop ends after the step that finishes past this many seconds
    # (its wall time, counted on from the training time a resumed checkpoint holds)
    time_limit_s: float | None = None


@dataclass
class Hooks:
    log: Callable[[dict[str, Any]], None] = lambda record: None
    step_done: Callable[[int, float, int, int], None] = lambda step, seconds, positions, tokens: None
    evaluate: Callable[[int], dict[str, float]] | None = None
    save: Callable[[LoopState], None] | None = None
    should_stop: Callable[[], bool] = lambda: False


class Interrupted(TunebenchError):
    def __init__(self, step: int, world: World = World()):
        super().__init__(f"interrupted at step {step}; a checkpoint was saved: rerun with --resume auto", 130)
        self.echo = not world.main  # every rank stops at this step; rank 0 says so


@dataclass
class _Step:
    """One optimizer step's input: its micro-batches prepared on the device, counted on the host."""

    prepared: list[tuple[Batch, int, int]]  # (batch on the device, loss tokens, real tokens)
    samples: int  # examples (a packed row holds several; a rank's empty filler row holds none)
    token_sq: int
    positions: int  # computed positions, padding included
    position: tuple[int, int]  # the data position (epoch, batch_in_epoch) after this step's micro-batches
    counts: list[int]  # the step's own loss units (a preference batch's `counts`, summed); empty for tokens
    ready: Any = None  # CUDA event: the copies to the device are done (prefetched on a side stream)


def _made(micro: list[Batch], position: LoopState, settings: LoopSettings) -> _Step:
    """A step's micro batches counted on the host and put on the device; `position` the data position after them."""
    lengths = torch.cat([example_lengths(b) for b in micro])
    lengths = lengths[lengths > 0]  # a rank's empty filler row is no example
    counts = torch.stack([b["counts"] for b in micro]).sum(0).tolist() if "counts" in micro[0] else []
    return _Step([prepare(b, settings.device, settings.pin_memory) for b in micro], len(lengths),
                 int((lengths.long() ** 2).sum()), sum(b["input_ids"].numel() for b in micro),
                 (position.epoch, position.batch_in_epoch), counts)


class Prefetcher:
    """The next steps' inputs made on a background thread while the device computes this one: collated,
    pinned and copied to the GPU on a side stream of their own, so the step never waits for the host.
    It walks its own copy of the data position; the loop takes each step's position as it trains it,
    so a checkpoint records the data consumed, never the data prefetched."""

    def __init__(self, steps, state: LoopState, settings: LoopSettings, depth: int = 2):
        self.steps, self.settings = steps, settings
        self.at = LoopState(epoch=state.epoch, batch_in_epoch=state.batch_in_epoch)
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopped = threading.Event()
        device = settings.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._run, name="tunebench-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                while not self.stopped.is_set():
                    step = _made(self.steps.next(self.at), self.at, self.settings)
                    if self.stream is not None:
                        step.ready = torch.cuda.Event()
                        step.ready.record(self.stream)
                    self._put(step)
        except BaseException as e:  # noqa: BLE001 - raised in the loop, where the step asks for it
            self._put(e)

    def _put(self, item) -> None:

        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> _Step:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.ready is not None:  # compute waits for the copies, on the device only
            current = torch.cuda.current_stream(self.settings.device)
            current.wait_event(item.ready)
            for batch, _, _ in item.prepared:
                for t in batch.values():
                    t.record_stream(current)  # made on the side stream, used on this one
        return item

    def close(self) -> None:
        self.stopped.set()
        while not self.queue.empty():
            self.queue.get_nowait()
        self.thread.join(timeout=10)


class StepTimer:
    """Step times without a host sync: on CUDA a pair of events per step, read when the loop reads the
    losses; elsewhere the host clock (a CPU step is done when its last op returns)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started):
        if not self.cuda:
            return time.perf_counter() - started
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return started, event

    def seconds(self, mark) -> float:
        if not self.cuda:
            return mark
        started, ended = mark
        ended.synchronize()
        return started.elapsed_time(ended) / 1000


@dataclass
class _Done:
    """An optimizer step's figures; the device tensors are read at the next logging (or eval, save) step."""

    step: int
    epoch: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    stats: torch.Tensor | None  # sums of the objective's stat_names over the step's units (all ranks: at the read)
    units: int  # the step's loss units, all ranks
    lr: float
    tokens: int  # real tokens of the step, all ranks
    tokens_total: int  # state.tokens after it
    time: Any  # StepTimer mark
    positions: int


def to_host(tensors: list[torch.Tensor]) -> list[float]:
    """The loop's only device-to-host read (one sync for all of them, flattened): tests count its calls."""
    return torch.cat([t.float().reshape(-1) for t in tensors]).tolist()


def optimizer_steps(
    objective: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    steps,
    state: LoopState,
    settings: LoopSettings,
    hooks: Hooks,
    scaler: torch.amp.GradScaler | None = None,
) -> LoopState:
    """Run optimizer steps from `state.step` to `settings.total_steps`.

    `objective` is a CausalLMLoss, or the DDP/FSDP module wrapping one. `steps` is where the steps come from
    (training/feed.py's Steps): `steps.next(at)` hands this rank's micro batches of the step at the data position
    `at` (epoch, batch_in_epoch) and moves it past them. Every rank must get the same number of micro-batches per
    step (one with no loss tokens still runs: its backward joins the gradient sync). Counts, the logged loss and a
    stop request are summed over ranks, so all ranks log the same figures and stop at the same step.

    The host never waits for the device inside a step: losses, gradient norms and step times stay on the device
    until a logging, eval or save step reads them all at once (`to_host`; _after_step), and with `settings.prefetch`
    the next steps' batches are made on a background thread. (Several ranks still sum their token counts before
    each step; with NCCL that collective is a sync of its own.)"""
    from tqdm.auto import tqdm

    device, world = settings.device, settings.world
    # The optimizer's parameters, not objective.parameters(): FSDP swaps a module's registered parameters
    # for gathered copies while they are in use (its root's stay gathered after an eval forward).
    params = [p for group in optimizer.param_groups for p in group["params"]]
    objective.train()
    bar = tqdm(total=settings.total_steps, initial=state.step, disable=not (settings.progress and world.main),
               unit="step", dynamic_ncols=True)
    feed = _feed(steps, state, settings)
    at = LoopState(epoch=state.epoch, batch_in_epoch=state.batch_in_epoch)  # where the next step's data starts
    timer = StepTimer(device)
    done: list[_Done] = []
    deadline = None if settings.time_limit_s is None else time.monotonic() + settings.time_limit_s - state.train_time_s
    try:
        while state.step < settings.total_steps:
            mark = timer.start()
            waited = time.perf_counter()
            item = feed.next() if feed else _made(steps.next(at), at, settings)
            step_loss_tokens, step_tokens, step_samples, step_sq, scale, totals = _step_totals(item, settings)
            state.data_time_s += time.perf_counter() - waited
            loss_acc = torch.zeros((), device=device)
            stats_acc = None
            for i, (b, n_loss, _) in enumerate(item.prepared):
                if n_loss == 0 and world.backend is None:
                    continue
                if totals is not None:
                    b["totals"] = totals  # the whole step's normalisers, not this micro-batch's
                with distributed.gradient_sync(objective, enabled=i == len(item.prepared) - 1):
                    loss, stats = split_output(objective(b))
                    if "live" in b:  # feed.RowSteps' filler (a rank with no rows here): no loss, no figures
                        loss, stats = loss * b["live"], None if stats is None else stats * b["live"]
                    loss = loss * scale
                    (scaler.scale(loss) if scaler else loss).backward()
                loss_acc += loss.detach()
                if stats is not None:
                    stats_acc = stats if stats_acc is None else stats_acc + stats
            grad_norm, lr = _update(optimizer, scheduler, scaler, params, settings.max_grad_norm)
            state.took_step(item.position, step_tokens, step_samples, step_sq)
            done.append(_Done(state.step, state.epoch, loss_acc, grad_norm, stats_acc, int(step_loss_tokens), lr,
                              int(step_tokens), state.tokens, timer.stop(mark), item.positions))
            bar.update(1)
            done = _after_step(done, state, settings, hooks, timer, bar, objective)
            if deadline is not None and _past(deadline, world):
                break
        if done:  # the time budget ran out before total_steps: its last step logged too
            _read(done, state, settings, hooks, timer, bar, objective, last=True)
    finally:
        if feed:
            feed.close()
        bar.close()
    return state


def _step_totals(item: _Step, settings: LoopSettings) -> tuple[float, float, float, float, float, torch.Tensor | None]:
    """The step's one collective before its forwards, over every rank: (loss units, real tokens, samples, the
    squares of the rows' tokens, the loss's scale, an objective's own counts on the device or None). The loss is
    normalised by the loss units (tokens, or an objective's own counts) of all ranks; DDP and FSDP average
    gradients over ranks, and the world-size factor in the scale turns that into the sum."""
    world = settings.world
    step_loss_tokens, step_tokens, step_samples, step_sq, *step_counts = distributed.all_sum(
        [sum(n for _, n, _ in item.prepared), sum(n for _, _, n in item.prepared), item.samples,
         item.token_sq, *item.counts], world)
    scale = world.size / max(step_loss_tokens, 1)
    totals = torch.tensor(step_counts, dtype=torch.float64).to(settings.device, non_blocking=True) \
        if step_counts else None
    return step_loss_tokens, step_tokens, step_samples, step_sq, scale, totals


def _past(deadline: float, world: World) -> bool:
    """Whether any rank's clock has passed `deadline` (time.monotonic): every rank ends at the same step."""
    return distributed.all_sum([float(time.monotonic() >= deadline)], world)[0] > 0


def _feed(steps, state: LoopState, settings: LoopSettings) -> Prefetcher | None:
    """The steps' inputs made on a background thread (settings.prefetch; by default on CUDA, never for steps that
    sample from the live weights), or None: made by the loop as it takes them."""
    device = settings.device
    prefetch = settings.prefetch if settings.prefetch is not None else device.type == "cuda"
    if not prefetch or steps.sampled:
        return None
    if device.type == "cuda":
        # The batch probe and the eval before training leave their blocks cached in PyTorch's allocator. The
        # driver's own allocations (the prefetch stream, a kernel module loaded on first use) cannot use that
        # cache: after a probe near the memory's edge, creating the stream failed with "CUDA error: out of
        # memory" (an H200, micro 8 out of memory, 4 chosen). Hand the cache back once; the first step
        # reserves what it needs again.
        torch.cuda.empty_cache()
    return Prefetcher(steps, state, settings)


def _update(optimizer: torch.optim.Optimizer, scheduler, scaler: torch.amp.GradScaler | None,
            params: list[torch.Tensor], max_grad_norm: float) -> tuple[torch.Tensor, float]:
    """The optimizer step on the accumulated gradients, clipped (fp16's scale taken out first), then the schedule's:
    (the gradient norm before clipping, on the device; the lr the step used)."""
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # a sharded model's norm is a DTensor
        grad_norm = grad_norm.full_tensor()
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    return grad_norm, lr


def _after_step(done: list[_Done], state: LoopState, settings: LoopSettings, hooks: Hooks, timer: StepTimer, bar,
                objective: torch.nn.Module) -> list[_Done]:
    """What follows an optimizer step: the figures read (at a logging, eval or save step, or a stop), the
    evaluation and the checkpoint when due, a stop asked on any rank (raised as Interrupted once saved). Returns
    the steps not read yet."""
    world = settings.world
    due_eval = bool(hooks.evaluate and settings.eval_steps and state.step % settings.eval_steps == 0
                    and state.step < settings.total_steps)
    due_save = bool(hooks.save and settings.save_steps and state.step % settings.save_steps == 0)
    if due_eval or due_save or state.step % settings.logging_steps == 0 or state.step == settings.total_steps:
        _read(done, state, settings, hooks, timer, bar, objective)
        done = []
    if due_eval:
        hooks.log({"step": state.step, **hooks.evaluate(state.step)})
    stop = distributed.all_sum([float(hooks.should_stop())], world)[0] > 0  # a signal to any rank stops all
    if stop and done:  # a checkpoint holds every loss up to its step
        _read(done, state, settings, hooks, timer, bar, objective)
        done = []
    if hooks.save and (due_save or stop):
        hooks.save(state)
    if stop:
        raise Interrupted(state.step, world)
    return done


def _read(done: list[_Done], state: LoopState, settings: LoopSettings, hooks: Hooks, timer: StepTimer, bar,
          objective: torch.nn.Module, last: bool = False) -> None:
    """Read the steps' device figures in one sync, check them, and log the logging steps among them (and the
    last of them where the loop ends there: `last`)."""
    world = settings.world
    names = unwrap(objective).stat_names if done[0].stats is not None else ()
    width = 2 + len(names)
    values = to_host([t for d in done for t in (d.loss, d.grad_norm, *([d.stats] if names else []))])
    # The second collective, once per read: each step's loss (and metric sums) over all ranks.
    losses = distributed.all_sum([v / world.size for v in values[0::width]], world)
    sums = distributed.all_sum([v for i, v in enumerate(values) if i % width >= 2], world) if names else []
    for n, (d, loss_value, grad_norm) in enumerate(zip(done, losses, values[1::width])):
        dt = timer.seconds(d.time)
        state.train_time_s += dt
        if d.step > settings.warmup_steps_excluded:
            state.measured_tokens += d.tokens
            state.measured_time_s += dt
        if not math.isfinite(loss_value):
            raise TunebenchError(
                f"loss became {loss_value} at step {d.step}; lower --lr, or use --precision fp32 "
                "(the last good checkpoint is kept)"
            )
        state.losses.append(loss_value)
        tokens_per_s = state.measured_tokens / state.measured_time_s if state.measured_time_s else d.tokens / dt
        if d.step % settings.logging_steps == 0 or d.step == settings.total_steps or last and d is done[-1]:
            metrics = stat_means(objective, sums[n * len(names):(n + 1) * len(names)], d.units) if names else {}
            hooks.log({
                "step": d.step, "epoch": d.epoch, "loss": loss_value, **metrics, "lr": d.lr, "grad_norm": grad_norm,
                "tokens": d.tokens_total, "tokens_per_s": tokens_per_s, "elapsed_s": state.train_time_s,
            })
        hooks.step_done(d.step, dt, d.positions, d.tokens)
    bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{done[-1].lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
