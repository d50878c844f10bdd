"""A GRPO (or RFT) step as a stage of its own: DrawnSteps is the loop's step source (training/feed.py's Steps) for a
run whose steps sample. For each optimizer step it draws this rank's prompts of the step (sampled completions, or
episodes played: the Draws), seeded by (seed, epoch, draw, rank), refills the groups that teach nothing
(--resample-alike), gives the completions their credit (StepRows.groups_of), and has feed.RowSteps cut the step's
micro batches from those groups (StepRows.collate). Nothing is kept for a later call to read but the groups of a
draw that --num-iterations trains on for more steps than one.

Under torchrun each rank makes the groups of its own prompts of the step, so a group is whole on one rank and its
advantages are its own; the draws are seeded by the rank as well, so a resume at the same world size samples again
what the run did."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tunebench.core import startup
from tunebench.training import feed
from tunebench.training.grpo import Advantages, Credit, Drawn, Draws, Groups, refill, rows_of, step_seed
from tunebench.training.grpo import watch as watch_
from tunebench.training.grpo.rft import balanced
from tunebench.training.loop import LoopState
from tunebench.training.objective import Batch


class DrawnSteps:
    """The steps of a run that samples, each drawn from the weights as they are when it starts (module docstring).
    With --num-iterations each draw serves that many steps in a row (grpo_run.epoch_steps repeats a step's prompts):
    a later one keeps the groups; a resume between them draws again, from the resumed policy."""

    sampled = True

    def __init__(self, rows: feed.RowSteps, step_rows: StepRows, seed: int, iterations: int, rank: int):
        self.rows, self.step_rows, self.seed, self.iterations, self.rank = rows, step_rows, seed, iterations, rank
        self.kept: Groups | None = None  # the last draw's groups, for the steps of it still to train

    def next(self, at: LoopState) -> list[Batch]:
        step, units = self.rows.at_step(at)
        keys = self.rows.share(units)
        if not (step % self.iterations and self.kept is not None and self.kept.keys == keys):
            self.kept = None
            if keys:  # the draw: seeded by (seed, epoch, draw, rank), played, scored, its alike groups drawn again
                draws, seed = self.step_rows.draws, step_seed(self.seed, at.epoch, step // self.iterations, self.rank)
                # Sampling and training each start from the memory they hold: the heap's free pages go back to the
                # OS before and after the draw. The command keeps freed memory (core/startup.py), and kept across
                # both phases' changing shapes (decode lengths, padded rows) the heap grew in stairs: a bf16 RFT
                # step of the towns benchmark peaked at 5,501 and 5,382 MB over 6 steps, 4,112 and 3,623 with
                # this, for 4% of the time (pages faulted in again; 2026-12-04, AVX512-BF16 EPYC,
                # benchmarks/sampled-memory-epyc-2026-12-04/). What still grows is bf16's kernels kept per new
                # shape: the memory left after a trim, 770 MB at step 1, 1,382 by step 6.
                startup.release_freed()
                with draws.seeded(seed):
                    played = draws.play(keys)
                startup.release_freed()
                drawn = refill(draws, draws.scored(keys, played), keys, seed)
                self.kept = self.step_rows.groups_of(keys, drawn)  # each completion's credit and stats
        return self.rows.next(at, self.kept)


class StepRows:
    """A step's groups and their micro batches, whatever drew them: `groups_of` gives each completion of a draw its
    credit and stats, `collate` cuts a micro batch's rows from the step's groups, `probe_rows` the largest rows a
    step can hold (what the probe times). `padding`: rows' widths a multiple, never past a cap (rows_of);
    `old_logps` (--num-iterations above 1): a micro batch -> its (loss positions,) log-probabilities now, no
    gradient."""

    def __init__(self, draws: Draws, kinds: watch_.Kinds | None = None, watch: watch_.Watch | None = None,
                 credit: Credit | None = None, padding: tuple[int, int | None] = (1, None),
                 old_logps: Callable[[Batch], torch.Tensor] | None = None):
        self.draws, self.s, self.kinds, self.watch = draws, draws.on.s, kinds, watch
        self.credit = credit or Advantages(draws.on.s)
        self.padding, self.old_logps = padding, old_logps

    def stat_names(self) -> tuple[str, ...]:
        """Every step stat but frac_groups_skipped, kl first: the draws', then watch.py's."""
        return self.draws.stat_names() + watch_.stat_names(self.kinds)

    def groups_of(self, keys: list[int], drawn: Drawn) -> Groups:
        """`keys`' groups of what was drawn: each completion's credit (`credit`: GRPO's advantage within its group,
        or RFT's weight where kept), and the step's stats per completion (stat_names' order, kl aside)."""
        scores, g = drawn.scores, self.s.num_generations
        kind = [self.kinds.of_row[self.draws.on.data.source(k)] for k in keys for _ in range(g)] if self.kinds else []
        adv, total, zero = self.credit.of(drawn, self.draws.weights, kind)
        per = [t for j in range(scores.shape[1]) for t in (torch.nan_to_num(scores[:, j]),
                                                           (~torch.isnan(scores[:, j])).float())]
        stats = torch.stack([torch.nan_to_num(total), torch.nan_to_num(total) ** 2, zero.float(), drawn.lengths,
                             drawn.clipped, *per], 1)
        if drawn.figures is not None:
            stats = torch.cat([stats, drawn.figures], 1)
        credit = self.credit
        groups = Groups(keys, drawn.completions, adv, stats, credit.masks(drawn, adv), credit.per_token(drawn))
        taught = torch.tensor([float(not groups.silent(i, g)) for i in range(len(adv))])
        if getattr(self.s, "weigh_kinds", False) and kind:
            # GRPO's --weigh-kinds: RFT's rule for its kept completions (rft.balanced) over the groups that teach, so
            # each kind among them carries the same share of the update and their factors average 1; a silent
            # group's 0 credit stays 0. Under torchrun each rank weighs its own prompts' groups, as RFT does.
            groups.scale(balanced(taught.bool().tolist()[::g], kind[::g]).repeat_interleave(g))
        if self.watch is not None:
            self.watch.see(kind, total, taught, drawn.entropy, g)
        groups.row_stats = torch.cat([stats, watch_.columns(drawn.entropy, self.kinds, kind, total, taught)], 1)
        return groups

    def filler(self, keys: list[int], length: int) -> Groups:
        """Groups of `keys` whose completions are `length` EOS tokens each, advantages and stats 0: nothing drawn."""
        g, eos = self.s.num_generations, self.draws.on.tokenizer.eos_token_id
        return Groups(keys, [[eos] * length] * (len(keys) * g), torch.zeros(len(keys) * g),
                      torch.zeros(len(keys) * g, len(self.stat_names()) - 1))

    def collate(self, keys: list[int], micro_step_keys: list[int], groups: Groups | None) -> Batch:
        """The rows of `keys`' groups, cut from the step's `groups` (DrawnSteps drew them; None: this rank had no
        prompt in the step; the global micro-step's keys add nothing here)."""
        drawn = groups is not None and keys[0] in groups.keys
        if not drawn:
            # feed.RowSteps' filler for a rank with no prompts in this micro-step (its counts and `live` are zeroed
            # there): one EOS a completion, nothing sampled
            groups = self.filler(keys, 1)
        batch = rows_of(groups, keys, self.draws.on.data, self.s.num_generations,
                        self.draws.on.tokenizer.pad_token_id, self.credit.skip, *self.padding)
        if self.old_logps is not None and drawn:
            if tuple(keys) not in groups.old_logps:  # the draw's first update: the policy that sampled it
                groups.old_logps[tuple(keys)] = self.old_logps(batch)
            batch["old_logps"] = groups.old_logps[tuple(keys)]
        return batch

    def probe_rows(self, keys: list[int]) -> Batch:
        """A micro batch as large as `keys` can make (every completion as long as the draws' can be, zero
        advantages), without drawing: what the probe times and sizes."""
        groups = self.filler(keys, self.draws.probe_length(keys))
        return rows_of(groups, keys, self.draws.on.data, self.s.num_generations, self.draws.on.tokenizer.pad_token_id,
                       "", *self.padding)
