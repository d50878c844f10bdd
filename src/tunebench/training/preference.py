"""Preference objectives, DPO and ORPO, as loss modules the one training loop runs like CausalLMLoss.

A micro-batch holds P pairs as 2P rows, chosen first (data.pairs.collate). The module returns the sum
of its per-pair losses and the sums of the field's metrics (TRL's names: rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/...); the loop divides both by the pairs
of the whole optimizer step, so accumulation gives the loss and gradients of one large batch.

- DPO (Rafailov et al., 2023): -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r)))),
  log-probabilities summed over each reply's tokens. With an adapter the reference is the same model
  with the adapter switched off, so it costs a forward pass and no second copy of the weights; full
  fine-tuning keeps a frozen copy.
- ORPO (Hong et al., 2024): the NLL of the chosen rows (prompt and reply, TRL's and the paper's code)
  minus lambda * log sigmoid(log odds(c) - log odds(r)), on log-probabilities averaged over each reply's
  tokens. No reference model.

Written here rather than taken from TRL: TRL's trainers are Trainer subclasses with their own data
pipeline and loop, and these losses must run inside tunebench's loop (measured micro batch, exact
resume, accumulation). tests/golden/make_preference_golden.py checks them against TRL step by step.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

from tunebench.training.loop import Batch, body_and_head
from tunebench.core.precision import autocast

OBJECTIVES = ("sft", "dpo", "orpo")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
STATS = {"dpo": REWARDS, "orpo": REWARDS + ("nll_loss", "log_odds_ratio", "log_odds_chosen")}


def reference_copy(model):
    """Full fine-tuning's DPO reference: a frozen copy of the starting weights."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()


def disable_dropout(model) -> int:
    """Dropout off in the base model (kept on an adapter where asked): DPO and ORPO compare the
    log-probabilities of two replies, and the policy against its reference, and dropout noise would
    enter those differences (TRL's default, disable_dropout=True). Returns the modules turned off."""
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and "lora_dropout" not in name and module.p > 0:
            module.p = 0.0
            n += 1
    return n


def token_logps(model, batch: Batch, index: torch.Tensor, autocast_dtype) -> torch.Tensor:
    """(N,) log-probability of the next token at each flat position `index` of (rows, T - 1)."""
    ids = batch["input_ids"]
    targets = ids[:, 1:].reshape(-1).index_select(0, index)
    parts = body_and_head(model)
    inputs = {"input_ids": ids, "use_cache": False}  # right-padded rows: no mask needed (see CausalLMLoss)
    with autocast(ids.device, autocast_dtype):
        if parts is None:
            logits = model(**inputs).logits[:, -ids.shape[1]:]  # prompt tuning's virtual tokens come first
            picked = logits[:, :-1].reshape(-1, logits.shape[-1]).index_select(0, index)
        else:
            body, head = parts
            hidden = body(**inputs).last_hidden_state
            picked = head(hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, index))
    return -F.cross_entropy(picked.float(), targets, reduction="none")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (Maechler, 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class PreferenceLoss(torch.nn.Module):
    unit = "pairs"

    def __init__(self, model, method: str, beta: float, autocast_dtype: torch.dtype | None = None,
                 reference=None):
        super().__init__()
        self.model, self.method, self.beta, self.autocast_dtype = model, method, beta, autocast_dtype
        self.stat_names = STATS[method]
        self._reference = [reference]  # a list: not a submodule, so neither trained nor wrapped by DDP

    def reference_logps(self, batch: Batch, index: torch.Tensor) -> torch.Tensor:
        reference = self._reference[0]
        off = self.model.disable_adapter() if reference is None else contextlib.nullcontext()
        with torch.no_grad(), off:
            return token_logps(reference or self.model, batch, index, self.autocast_dtype)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1
        pairs = rows // 2
        if self.method == "dpo":
            index = batch["loss_index"]
            row = index // width
            policy = torch.zeros(rows, device=index.device).index_add(
                0, row, token_logps(self.model, batch, index, self.autocast_dtype))
            reference = torch.zeros(rows, device=index.device).index_add(0, row, self.reference_logps(batch, index))
            ratios = policy - reference  # log pi - log ref, each reply
            chosen, rejected = self.beta * ratios[:pairs], self.beta * ratios[pairs:]
            loss = -F.logsigmoid(chosen - rejected).sum()
            logps = policy.detach()
            extra: list[torch.Tensor] = []
        else:
            index, is_reply = batch["target_index"], batch["is_response"]
            row = index // width
            logp = token_logps(self.model, batch, index, self.autocast_dtype)
            reply = is_reply.to(logp.dtype)
            mean = torch.zeros(rows, device=index.device).index_add(0, row, logp * reply) / torch.zeros(
                rows, device=index.device).index_add(0, row, reply)  # each reply's mean log-probability
            # The NLL over every real token of the chosen rows, as a mean over the step's such tokens:
            # totals = (pairs, chosen tokens) of the whole step, and the loop divides by its pairs.
            totals = batch["totals"]
            nll = -(logp * (row < pairs).to(logp.dtype)).sum() * (totals[0] / totals[1]).to(logp.dtype)
            log_odds = (mean[:pairs] - mean[pairs:]) - (log1mexp(mean[:pairs]) - log1mexp(mean[pairs:]))
            ratio = F.logsigmoid(log_odds)
            loss = nll - self.beta * ratio.sum()
            chosen, rejected = self.beta * mean[:pairs], self.beta * mean[pairs:]
            logps = mean.detach()
            extra = [nll.detach(), ratio.detach().sum(), log_odds.detach().sum()]
        chosen, rejected = chosen.detach(), rejected.detach()
        stats = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(),
                             (chosen - rejected).sum(), logps[:pairs].sum(), logps[pairs:].sum(), *extra])
        return loss, stats
