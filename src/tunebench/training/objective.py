"""The objective the training loop runs, and what it needs of a batch: the Objective protocol every loss meets
(CausalLMLoss here, preference's and GRPO's beside it), the next-token loss summed over a batch's loss positions
(the head run on those positions alone where it can be), a batch prepared for the device and counted, the held-out
evaluation, and the per-unit means of an objective's stats. The loop (training/loop.py) steps through these."""

from __future__ import annotations

import math
from typing import ClassVar, Protocol, runtime_checkable

import torch

from tunebench.core.precision import autocast
from tunebench.machine import distributed
from tunebench.machine.distributed import World
from tunebench.model import methods
from tunebench.model.kernels import cross_entropy_sum, linear_cross_entropy_sum

Batch = dict[str, torch.Tensor]


def body_and_head(model):
    """(decoder body, output head) of a plain causal LM, or None where logits need more than a matmul.

    Running the head only on positions that carry loss skips the logits (and their gradient) of
    prompt and padding positions: with a 49k vocabulary that is a fifth of the model's FLOPs.
    """
    if methods.is_prompt_learning(model):
        return None  # prefix and prompt tuning add their virtual tokens in the PEFT model's own forward
    inner = methods.base_of(model)
    c = inner.config
    if getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", None) or getattr(
            c, "output_multiplier_scale", None):
        return None
    body = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    head = inner.get_output_embeddings()
    if body is None or body is inner or head is None:
        return None
    return body, head


@runtime_checkable
class Objective(Protocol):
    """What the loop and evaluation ask of an objective (CausalLMLoss, preference.PreferenceLoss, grpo.GRPOLoss), the
    module DDP or FSDP wraps. `forward(batch)` gives its loss summed over the batch's units, or (that sum, the sums
    of its `stat_names` over them). The loss is normalised per `unit` over the whole optimizer step (tokens, or the
    counts a batch brings: pairs, judged examples, completions); each stat is reported as a mean per unit, or per
    the stat `stat_per` names for it; `stat_finish(means, units)` makes the figures that are no mean (GRPO's
    reward_std)."""

    unit: str
    stat_names: tuple[str, ...]
    stat_per: dict[str, str]

    def __call__(self, batch: Batch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def stat_finish(self, means: dict[str, float], units: float) -> dict[str, float]: ...


class CausalLMLoss(torch.nn.Module):
    """The training objective as a module: the sum of next-token cross-entropy over the loss positions
    of one prepared micro-batch. This is what DDP and FSDP wrap. Their hooks (gradient sync, gathering
    sharded weights) arm in the wrapped module's forward, so the loop calls this forward and never the
    model's submodules directly: a loss computed beside the wrapper would silently never synchronise."""

    unit: ClassVar[str] = "tokens"
    stat_names: ClassVar[tuple[str, ...]] = ()  # the loss alone: evaluation adds perplexity
    stat_per: ClassVar[dict[str, str]] = {}

    def __init__(self, model, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.autocast_dtype = autocast_dtype

    def stat_finish(self, means: dict[str, float], units: float) -> dict[str, float]:
        return means

    def forward(self, batch: Batch) -> torch.Tensor:
        model, autocast_dtype = self.model, self.autocast_dtype
        targets = batch["labels"][:, 1:].reshape(-1)
        keep = batch["loss_index"]  # flat positions that carry loss, computed on the host: no sync
        parts = body_and_head(model)
        # No KV cache: training needs none, and transformers only reads packed rows without one.
        inputs = {"input_ids": batch["input_ids"], "use_cache": False}
        if "position_ids" in batch:  # packed rows: restarting positions give the block-diagonal mask
            inputs["position_ids"] = batch["position_ids"]
        # Otherwise no attention mask: rows are right-padded, so under the causal mask no real position
        # sees a pad, and pad positions carry no loss. Attention kernels run their unmasked causal path.
        with autocast(batch["input_ids"].device, autocast_dtype):
            if parts is None:
                logits = model(**inputs).logits  # (B, T, V)
                logits = logits[:, -batch["input_ids"].shape[1]:]  # prompt tuning's virtual tokens come first
                picked = logits[:, :-1].reshape(-1, logits.shape[-1]).index_select(0, keep)  # (N, V)
            else:
                body, head = parts
                hidden = body(**inputs).last_hidden_state
                rows = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, keep)  # (N, H)
                if type(head) is torch.nn.Linear:  # head and loss in one: the (N, V) logits are never all held
                    dtype = autocast_dtype or head.weight.dtype
                    return linear_cross_entropy_sum(rows, head.weight, head.bias, targets.index_select(0, keep),
                                                    dtype)
                picked = head(rows)  # (N, V): a quantised or adapted head runs as itself
        return cross_entropy_sum(picked, targets.index_select(0, keep))


def loss_sum(model, batch: Batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Sum of next-token cross-entropy over the loss positions of one micro-batch (of a plain, unwrapped model)."""
    return CausalLMLoss(model, autocast_dtype)(batch)


def example_lengths(batch: Batch) -> torch.Tensor:
    """(N,) length of every example in a collated host batch: one per row, or several per packed row
    (an example ends where the next position restarts at 0, or where real tokens end)."""
    real = batch["attention_mask"].bool()
    if "position_ids" not in batch:
        return real.sum(1)
    positions = batch["position_ids"]
    after = torch.nn.functional.pad(positions[:, 1:], (0, 1), value=0)  # the next position; 0 past the row's end
    real_after = torch.nn.functional.pad(real[:, 1:], (0, 1), value=False)
    ends = real & ((after == 0) | ~real_after)
    return positions[ends] + 1


def prepare(batch: Batch, device: torch.device, pin_memory: bool | None = None) -> tuple[Batch, int, int]:
    """Move a collated batch to the device; return it with (loss units, real tokens) counted on the host.
    `pin_memory` (default: on CUDA) page-locks the host copies so the transfers overlap compute.

    The loss unit is a loss token, unless the batch brings its own `counts` (a preference batch: pairs
    first, then whatever else its objective normalises by); they reach the objective as `totals`, which
    the training loop replaces with the whole optimizer step's (see train)."""
    flat = batch["labels"][:, 1:].reshape(-1)
    loss_index = torch.nonzero(flat != -100).squeeze(1)
    counts = batch.get("counts")
    n_loss = int(loss_index.numel()) if counts is None else int(counts[0])
    n_real = int(batch["attention_mask"].sum())
    if device.type == "cuda" if pin_memory is None else pin_memory:
        batch = {k: v.pin_memory() for k, v in batch.items()}
        loss_index = loss_index.pin_memory()
    non_blocking = device.type == "cuda"
    out = {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}
    out["loss_index"] = loss_index.to(device, non_blocking=non_blocking)
    if counts is not None:
        out["totals"] = out.pop("counts").double()
    return out, n_loss, n_real


def split_output(out) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An objective returns its loss sum, or (loss sum, (len(stat_names),) sums of its metrics over the
    batch's units), each reported as a mean per unit (see preference.PreferenceLoss)."""
    return out if isinstance(out, tuple) else (out, None)


def unwrap(objective: torch.nn.Module) -> torch.nn.Module:
    """The objective itself under a DDP wrapper (FSDP shards it in place)."""
    return getattr(objective, "module", objective)


@torch.no_grad()
def evaluate(objective: torch.nn.Module, batches, device: torch.device, world: World = World(),
             split: bool = True) -> dict[str, float]:
    """Token-weighted mean loss and perplexity over `batches` (collated, on the host). `objective` is a
    CausalLMLoss; with `split`, each rank takes every world-size-th batch and the sums are added up
    (a sharded model instead runs every batch on every rank: its forward is a collective)."""
    was_training = objective.training
    objective.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    stats = None
    count = 0
    for batch in batches[world.rank::world.size] if split else batches:
        b, n_loss, _ = prepare(batch, device)
        if n_loss or not split:
            loss, part = split_output(objective(b))
            total += loss.double()
            if part is not None:
                stats = part.double() if stats is None else stats + part.double()
            count += n_loss
    objective.train(was_training)
    if hasattr(objective, "reshard"):  # FSDP: a forward without backward leaves the root's weights gathered
        objective.reshard()
    inner: Objective = unwrap(objective)
    names = inner.stat_names  # a rank whose share had no batch adds zeros: the same collective
    sums = [float(total), count] + (stats.tolist() if stats is not None else [0.0] * len(names))
    sums = distributed.all_sum(sums, world) if split else sums
    loss, count = sums[0] / max(sums[1], 1), sums[1]
    if not names:
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "eval_tokens": int(count)}
    return {"eval_loss": loss, f"eval_{inner.unit}": int(count),
            **{f"eval_{name}": value for name, value in stat_means(inner, sums[2:], count).items()}}


def stat_means(objective: torch.nn.Module, sums: list[float], units: float) -> dict[str, float]:
    """An objective's metric sums as means: per loss unit, or per the count another of its stats holds (its
    `stat_per`: KTO's rewards/chosen is a mean over the desirable rows); a mean over no rows is left out. Its
    `stat_finish(means, units)`, if any, makes the figures that are not means (GRPO's reward_std)."""
    inner: Objective = unwrap(objective)
    per = inner.stat_per
    named = dict(zip(inner.stat_names, sums))
    means = {name: v / (named[per[name]] if name in per else max(units, 1)) for name, v in named.items()
             if name not in per or named[per[name]]}
    return inner.stat_finish(means, units)
