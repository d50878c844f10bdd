"""Preference objectives, DPO, ORPO and KTO, as loss modules the one training loop runs like CausalLMLoss.

A micro-batch holds P pairs as 2P rows, chosen first (data.pairs.collate). The module returns the sum
of its per-pair losses and the sums of the field's metrics (TRL's names: rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/...); the loop divides both by the pairs
of the whole optimizer step, so accumulation gives the loss and gradients of one large batch.

- DPO (Rafailov et al., 2023): -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r)))),
  log-probabilities summed over each reply's tokens. With an adapter the reference is the same model with the
  adapter's starting values put back for its pass (StartingAdapter: for LoRA, DoRA and IA3, which start as the
  identity, the base), so it costs a forward pass and no second copy of the weights; full fine-tuning keeps a
  frozen copy.
- ORPO (Hong et al., 2024): the NLL of the chosen rows (prompt and reply, TRL's and the paper's code)
  minus lambda * log sigmoid(log odds(c) - log odds(r)), on log-probabilities averaged over each reply's
  tokens. No reference model.
- KTO (Ethayarajh et al., 2024), from single judgements (data.judged): a micro batch of N completions is 2N
  rows, the N judged ones and N mismatched ones (prompt i, completion i - 1). The reference point z is the KL
  estimate max(0, mean over the mismatched rows of log pi - log ref), no gradient; a desirable completion's loss
  is 1 - sigmoid(beta * (log pi/ref - z)), an undesirable one's 1 - sigmoid(beta * (z - log pi/ref)), weighted by
  desirable_weight / undesirable_weight. Like TRL's KTOTrainer, z is estimated per micro batch, so KTO's micro
  batch is part of its math (finetune sets it, never the probe); on several ranks, per global micro-step (every
  rank's rows, the mismatched ones drawn across them), so the ranks compute one process's z.

Written here rather than taken from TRL: TRL's trainers are Trainer subclasses with their own data
pipeline and loop, and these losses must run inside tunebench's loop (measured micro batch, exact
resume, accumulation). tests/golden/make_preference_golden.py checks them against TRL step by step.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

from tunebench.core.decision import Decision
from tunebench.core.precision import autocast
from tunebench.machine import distributed
from tunebench.model import methods
from tunebench.settings import objectives
from tunebench.settings.objectives import Objective
from tunebench.training.objective import Batch, body_and_head

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


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


def token_logps(model, batch: Batch, index: torch.Tensor, autocast_dtype, temperature: float = 1.0) -> torch.Tensor:
    """(N,) log-probability of the next token at each flat position `index` of (rows, T - 1), of the logits
    divided by `temperature` (GRPO's: the distribution its completions were sampled from, as TRL scores it)."""
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
    logits = picked.float() if temperature == 1.0 else picked.float() / temperature
    return -F.cross_entropy(logits, targets, reduction="none")


class StartingAdapter:
    """An adapter's trainable values at the start of training, kept (an adapter is small) to be put back for
    the reference pass: the reference is then the starting model computed by the very graph the policy runs,
    adapter on. Switching the adapter off (PEFT's disable_adapter, TRL's way) runs another graph, and
    compiled kernels round that one differently in 16-bit: DPO's first loss read 0.7126 instead of ln 2 on
    SmolLM2 in bf16 with compile on. A LoRA, DoRA or IA3 adapter starts as the identity (B = 0, unit scales), so
    its starting model is the base, as with the adapter off."""

    def __init__(self, model):
        self.model = model
        self.start = [(p, p.detach().clone()) for p in model.parameters() if p.requires_grad]

    def holds(self) -> bool:
        """The model still trains the tensors snapshotted (FSDP2 replaces them with shards: then the adapter is
        switched off instead, which is the same starting model for these identity-initialised adapters)."""
        now = {id(p) for p in self.model.parameters() if p.requires_grad}
        return len(now) == len(self.start) and all(id(p) in now for p, _ in self.start)

    @contextlib.contextmanager
    def put_back(self):
        """The starting values in the adapter's own tensors (in place: a compiled graph sees the same inputs),
        then the current ones again. In place, so it runs before the policy pass keeps tensors for backward."""
        with torch.no_grad():
            now = [p.detach().clone() for p, _ in self.start]
            for p, start in self.start:
                p.copy_(start)
        try:
            yield
        finally:
            with torch.no_grad():
                for (p, _), value in zip(self.start, now):
                    p.copy_(value)


def reference_logps(model, reference, batch: Batch, index: torch.Tensor, autocast_dtype,
                    temperature: float = 1.0) -> torch.Tensor:
    """token_logps of the reference, without gradients: the model with its adapter's starting values put back
    (`reference` a StartingAdapter), a frozen copy (a full fine-tune's), or, when None, the model with its
    adapter off (prompt-learning adapters, whose start is not the base). Call it before the policy's pass of
    the same batch (StartingAdapter writes the adapter in place)."""
    if isinstance(reference, StartingAdapter):
        if reference.holds():
            # in grad mode, its output detached: a compiled model then runs the training graph the policy's pass
            # runs next (a first pass under no_grad compiles an inference graph, which rounds 16-bit otherwise)
            with torch.enable_grad(), reference.put_back():
                return token_logps(model, batch, index, autocast_dtype, temperature).detach()
        reference = None
    off = model.disable_adapter() if reference is None else contextlib.nullcontext()
    with torch.no_grad(), off:
        return token_logps(reference or model, batch, index, autocast_dtype, temperature)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (Maechler, 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class PreferenceLoss(torch.nn.Module):
    """What DPO's, ORPO's and KTO's losses share, each a class of its own below (module docstring), a
    objective.Objective: (loss sum, stat sums). `strength` is DPO's and KTO's beta, ORPO's lambda."""

    stat_names: tuple[str, ...] = REWARDS
    stat_per: dict[str, str] = {}
    unit = "pairs"

    def __init__(self, model, strength: float, autocast_dtype: torch.dtype | None = None, reference=None):
        super().__init__()
        self.model, self.beta, self.autocast_dtype = model, strength, autocast_dtype
        self._reference = [reference]  # a list: not a submodule, so neither trained nor wrapped by DDP

    def reference_logps(self, batch: Batch, index: torch.Tensor) -> torch.Tensor:
        return reference_logps(self.model, self._reference[0], batch, index, self.autocast_dtype)

    def stat_finish(self, means: dict[str, float], units: float) -> dict[str, float]:
        return means  # every figure is a mean (objective.Objective)

    @staticmethod
    def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor, logps: torch.Tensor, pairs: int,
                   extra: list[torch.Tensor]) -> torch.Tensor:
        """TRL's pair figures, summed over the micro batch's pairs (REWARDS' order), then the loss's own."""
        chosen, rejected = chosen.detach(), rejected.detach()
        return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(),
                            (chosen - rejected).sum(), logps[:pairs].sum(), logps[pairs:].sum(), *extra])


class DPOLoss(PreferenceLoss):
    """-log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r)))), log-probabilities summed over
    each reply's tokens."""

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, stat sums) of the micro batch (a filler's, `live` 0, the loop multiplies by 0)."""
        rows, width = batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1
        pairs = rows // 2
        index = batch["loss_index"]
        row = index // width
        reference = torch.zeros(rows, device=index.device).index_add(0, row, self.reference_logps(batch, index))
        policy = torch.zeros(rows, device=index.device).index_add(
            0, row, token_logps(self.model, batch, index, self.autocast_dtype))
        ratios = policy - reference  # log pi - log ref, each reply
        chosen, rejected = self.beta * ratios[:pairs], self.beta * ratios[pairs:]
        loss = -F.logsigmoid(chosen - rejected).sum()
        return loss, self.pair_stats(chosen, rejected, policy.detach(), pairs, [])


class ORPOLoss(PreferenceLoss):
    """The NLL of the chosen rows minus lambda * log sigmoid(log odds(c) - log odds(r)), on each reply's mean
    log-probability; no reference."""

    stat_names = REWARDS + ("nll_loss", "log_odds_ratio", "log_odds_chosen")

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1
        pairs = rows // 2
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
        return loss, self.pair_stats(chosen, rejected, mean.detach(), pairs,
                                     [nll.detach(), ratio.detach().sum(), log_odds.detach().sum()])


class KTOLoss(PreferenceLoss):
    """Single judged completions against the KL reference point z (module docstring); a micro batch of N judged
    rows is 2N rows, the N judged ones and N mismatched ones for z."""

    stat_names = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "desirable",
                  "undesirable")
    # its means over one kind of row (TRL's): divided by that kind's count, not by all rows
    stat_per = {"rewards/chosen": "desirable", "logps/chosen": "desirable", "rewards/rejected": "undesirable",
                "logps/rejected": "undesirable"}
    unit = "examples"

    def __init__(self, model, beta: float, autocast_dtype: torch.dtype | None = None, reference=None,
                 weights: tuple[float, float] = (1.0, 1.0)):
        super().__init__(model, beta, autocast_dtype, reference)
        self.weights = weights  # (desirable_weight, undesirable_weight)

    def reference_point(self, kl_terms: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """KTO's z: max(0, the mean of log pi - log ref over the mismatched rows), TRL's estimate over a micro
        batch. On several ranks in training, over the global micro-step: each rank's sum and count are added up
        (a filler's are 0), so 2 ranks x N rows give one process's N x 2. Evaluation keeps each batch's own."""
        sums = torch.stack([kl_terms.sum(), torch.tensor(float(len(kl_terms)), device=kl_terms.device,
                                                         dtype=kl_terms.dtype)])
        if live is not None:
            sums = sums * live
        if self.training:
            distributed.sum_in_step(sums)
        return (sums[0] / sums[1].clamp(min=1)).clamp(min=0)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..n-1 judged (labels in batch["label"]), rows n..2n-1 their mismatched KL rows."""
        n, width = batch["input_ids"].shape[0] // 2, batch["input_ids"].shape[1] - 1
        index = batch["loss_index"]
        judged = index < n * width  # flat positions are row-major: the judged rows' come first
        ids = batch["input_ids"]
        own, other = {"input_ids": ids[:n]}, {"input_ids": ids[n:]}
        own_index, kl_index = index[judged], index[~judged] - n * width

        def summed(logps: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:  # (n,) each row's tokens summed
            return torch.zeros(n, device=flat.device, dtype=logps.dtype).index_add(0, flat // width, logps)

        reference = summed(self.reference_logps(own, own_index), own_index)  # first: see reference_logps
        kl_reference = summed(self.reference_logps(other, kl_index), kl_index)
        policy = summed(token_logps(self.model, own, own_index, self.autocast_dtype), own_index)
        with torch.no_grad():
            kl_policy = summed(token_logps(self.model, other, kl_index, self.autocast_dtype), kl_index)
        kl = self.reference_point(kl_policy - kl_reference, batch.get("live"))
        ratios = policy - reference
        good = batch["label"].bool()
        losses = torch.where(good, self.weights[0] * (1 - torch.sigmoid(self.beta * (ratios - kl))),
                             self.weights[1] * (1 - torch.sigmoid(self.beta * (kl - ratios))))
        rewards, logps, g = self.beta * ratios.detach(), policy.detach(), good.to(policy.dtype)
        stats = torch.stack([kl * n, (rewards * g).sum(), (rewards * (1 - g)).sum(), (logps * g).sum(),
                             (logps * (1 - g)).sum(), g.sum(), (1 - g).sum()])
        return losses.sum(), stats


def loss_for(model, o: Objective, full: bool, autocast_dtype) -> tuple[PreferenceLoss, Decision]:
    """The DPO, ORPO or KTO objective `o` over `model`, and its settings row (see reference_for)."""
    dropped = disable_dropout(model)
    dropout = f"; base dropout off in {dropped} module(s) (TRL's default)" if dropped else ""
    if isinstance(o, objectives.ORPO):
        return (ORPOLoss(model, o.orpo_lambda, autocast_dtype),
                Decision("objective", o.name, f"lambda {o.orpo_lambda:g}; no reference model{dropout}"))
    reference, words = reference_for(model, full)
    if isinstance(o, objectives.KTO):
        weights = (o.desirable_weight, o.undesirable_weight)
        return (KTOLoss(model, o.beta, autocast_dtype, reference, weights),
                Decision("objective", o.name, f"beta {o.beta:g}, desirable/undesirable weights {weights[0]:g}/"
                         f"{weights[1]:g}; reference: {words}{dropout}"))
    return (DPOLoss(model, o.beta, autocast_dtype, reference),
            Decision("objective", o.name, f"beta {o.beta:g}; reference: {words}{dropout}"))


def scoring_loss(model, o: Objective, autocast_dtype, reference) -> PreferenceLoss:
    """The DPO, ORPO or KTO objective `o` over `model` against a reference given (`reference_logps`' kinds): how
    `tunebench eval` scores a finished run's held-out pairs (jobs/eval_preference.py)."""
    if isinstance(o, objectives.ORPO):
        return ORPOLoss(model, o.orpo_lambda, autocast_dtype)
    if isinstance(o, objectives.KTO):
        return KTOLoss(model, o.beta, autocast_dtype, reference, (o.desirable_weight, o.undesirable_weight))
    return DPOLoss(model, o.beta, autocast_dtype, reference)


def reference_for(model, full: bool):
    """(the reference, its description) of an objective that compares the policy with its start (DPO, KTO, GRPO
    with beta): under full fine-tuning a frozen copy made here, before any step, so the probe counts its memory;
    else the adapter's starting values, put back for the reference pass (StartingAdapter: the same computation as
    the policy's, compiled or not); a prompt-learning adapter, whose start is not the base, switched off."""
    if full:
        return reference_copy(model), "a frozen copy of the starting weights"
    if methods.is_prompt_learning(model):
        return None, "the base with the adapter off (no copy)"
    return StartingAdapter(model), "the base: the adapter at its starting values (no copy of the base)"
