"""The probe step every measurement times: forward + backward on real rows, with no side effects.

A probe must not change the run it measures: it runs in train mode (dropout on, compiled blocks
traced for training, as the loop will run them), restores the RNG afterwards and leaves no
gradient behind, so a run whose settings were measured gives the same losses and weights as the
same run given those settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tunebench.machine.metrics import peak_memory_mb, reset_peak_memory
from tunebench.training.objective import Batch, loss_sum, prepare, split_output

StepFn = Callable[[int], tuple[float, float]]  # micro batch -> (tokens/s, peak memory MB)


def probe_step(model, rows: Callable[[int], Batch], device: torch.device, autocast,
               objective: torch.nn.Module | None = None) -> StepFn:
    """A step function for the measurements: `rows(size)` gives the collated batch to time, through
    `objective` (default: the next-token loss), so a preference run's probe times pairs with their
    reference passes.

    Each repeat lets go of its loss and its gradients before the next, as the loop's optimizer step does: kept,
    the gradients the first backward put in the heap's freed middle (glibc, with the tunables core.startup sets)
    split the blocks the next forward needs, and a GRPO-shaped probe (4 rows x 1,024 tokens, SmolLM2-135M LoRA
    fp32, tunebench's kernel) grew 12.0 -> 17.6 GB on its second repeat; let go, 12.2 GB in every repeat, and its
    repeats took 15.1 s against 38.2 and 15.9 (2-core Xeon, 2026-12-04)."""

    def step(size: int) -> tuple[float, float]:
        batch = rows(size)
        times = []
        was_training = model.training
        model.train()
        reset_peak_memory(device)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                for _ in range(3):
                    t0 = time.perf_counter()
                    b, n_loss, n_real = prepare(batch, device)
                    loss = loss_sum(model, b, autocast) if objective is None else split_output(objective(b))[0]
                    (loss / max(n_loss, 1)).backward()
                    del loss, b
                    model.zero_grad(set_to_none=True)  # each repeat a step's first micro batch, as the loop runs it
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
        finally:  # also after an OOM part-way through a backward: its gradients must not reach the run's first step
            model.zero_grad(set_to_none=True)
            model.train(was_training)
        # The best repeat: a busy machine only ever slows a step down, so the minimum is the steadiest.
        return n_real / min(times[1:]), peak_memory_mb(device)

    step.model = model  # type: ignore[attr-defined]
    return step


def is_oom(e: BaseException) -> bool:
    """A step that ran out of memory. Not only torch.OutOfMemoryError (the caching allocator's): an allocation
    the driver makes itself (a stream, a library's workspace) fails as torch.AcceleratorError with CUDA's
    "out of memory", as an H200 run of torch 2.11 showed when a full GPU could not create a stream."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return accelerator_error is not None and isinstance(e, accelerator_error) and "out of memory" in str(e)


def free_after_oom(model) -> None:
    """Drop what a step that ran out of memory left behind, so the next try starts where it did."""
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_initialized():  # hand the failed step's cached blocks back to the driver
        torch.cuda.empty_cache()


def memory_free_mb(device: torch.device, ranks_sharing: int = 1) -> float:
    """Memory a step may still allocate: free GPU memory (the driver's free memory plus blocks this
    process's allocator holds unused), or 80% of available RAM (never into swap), split evenly
    between the ranks that share this machine's RAM."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return (free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)) / 2**20
    import psutil

    return 0.8 * psutil.virtual_memory().available / 2**20 / ranks_sharing


def memory_budget_mb(device: torch.device, ranks_sharing: int = 1) -> tuple[float, float]:
    """(baseline, budget) for the batch probe: what the process holds now, and the peak a step may reach.

    On a GPU the budget is what is held plus 92% of what is still free: memory held by other
    processes (or by this one before the probe) is never counted as room, and 8% is left for the
    allocator's fragmentation."""
    if device.type == "cuda":
        baseline = torch.cuda.memory_allocated(device) / 2**20
        return baseline, baseline + 0.92 * memory_free_mb(device)
    import psutil

    baseline = psutil.Process().memory_info().rss / 2**20
    return baseline, baseline + memory_free_mb(device, ranks_sharing)


def checkpointing_on(model) -> bool:
    """Whether `model` recomputes activations: transformers 5.2x renamed is_gradient_checkpointing (which warns
    there) to is_activation_checkpointing; earlier 5.x has only the old name."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def enable_checkpointing(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need a grad path
