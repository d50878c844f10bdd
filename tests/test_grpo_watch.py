"""GRPO's collapse watch (training/grpo/watch.py) against hand-computed cases: the entropy the decode records, each
kind's stat terms, and the two warnings."""

import math

import pytest
import torch

from tunebench.core.errors import TunebenchError
from tunebench.model import decoding
from tunebench.settings.objectives import GRPO, RFT
from tunebench.training.grpo import watch


def test_the_entropy_is_of_the_tempered_distribution_in_nats():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]])
    assert decoding.entropy(logits, 1.0).tolist() == pytest.approx([math.log(4), -(0.25 * math.log(0.25)
                                                                                  + 0.75 * math.log(0.75))])
    assert decoding.entropy(logits[1:], 1e-3).item() == pytest.approx(0.0, abs=1e-6)  # all but greedy


def test_each_sampled_decode_records_its_rows_entropy_until_their_eos_and_a_greedy_one_nothing():
    """Row 0 draws from 4 even tokens (ln 4 a token) for 3 steps; row 1 makes its EOS (token 0, its only token) at
    once: one token of entropy 0 counted, none after it."""
    even, certain = [0.0, 0.0, 0.0, 0.0], [0.0, -1e9, -1e9, -1e9]

    def steps():
        rows = [even, certain]
        while True:
            _, keep = yield torch.tensor(rows)
            if keep is not None:  # rows that made their EOS leave
                rows = [r for r, k in zip(rows, keep.tolist()) if k]

    with decoding.entropies() as recorded:
        decoding._run(steps(), 2, 3, eos=0, pad=9, temperature=1.0, top_p=1.0, top_k=0, each=None, shrink=True)
        decoding._run(steps(), 2, 3, eos=0, pad=9, temperature=None, top_p=1.0, top_k=0, each=None, shrink=True)
    assert len(recorded) == 1  # the greedy decode recorded nothing
    summed, counted, first = recorded[0]
    row0 = counted[0].item()  # row 0 may draw its own EOS (token 0) before the third step
    assert summed[0].item() == pytest.approx(row0 * math.log(4)) and 1 <= row0 <= 3
    assert (summed[1].item(), counted[1].item()) == pytest.approx((0.0, 1.0), abs=1e-6)
    assert first.tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


def test_a_kind_column_is_refused_with_the_fix_where_rows_lack_it_or_it_names_no_kinds():
    with pytest.raises(TunebenchError, match=r"--kind-column kind: 1 of 2 prompt rows have no 'kind'"):
        watch.Kinds.of("kind", [{"kind": "a"}, {}])
    with pytest.raises(TunebenchError, match=rf"{watch.MAX_KINDS + 1} distinct values, more than {watch.MAX_KINDS}"):
        watch.Kinds.of("id", [{"id": i} for i in range(watch.MAX_KINDS + 1)])
    assert watch.Kinds.of(None, [{}]) is None


def test_each_completion_adds_its_entropy_and_its_kinds_reward_informative_and_count():
    kinds = watch.Kinds.of("kind", [{"kind": "b"}, {"kind": "a"}])
    assert kinds.names == ("a", "b") and kinds.of_row == (1, 0)
    names = watch.stat_names(kinds)
    cols = watch.columns(torch.tensor([[1.0, 2.0], [0.5, 0.25]]), kinds, [1, 0], torch.tensor([1.0, torch.nan]),
                         torch.tensor([1.0, 0.0]))
    got = dict(zip(names, cols.T.tolist()))
    assert got["entropy"] == [1.0, 0.5] and got["entropy/first_token"] == [2.0, 0.25] and got["count/entropy"] == [1, 1]
    assert got["kinds/b/reward"] == [1.0, 0.0] and got["kinds/b/informative"] == [1.0, 0.0]
    assert got["kinds/a/count"] == [0.0, 1.0] and got["kinds/a/reward"] == [0.0, 0.0]  # an unscored reward: 0
    assert watch.stat_per(kinds)["kinds/a/informative"] == "kinds/a/count"
    none = watch.columns(None, None, [], torch.zeros(3), torch.zeros(3))  # nothing recorded: not counted
    assert none.tolist() == [[0.0, 0.0, 0.0]] * 3


def test_a_kind_whose_groups_score_alike_below_the_runs_best_for_n_steps_is_warned_of_once():
    kinds = watch.Kinds.of("kind", [{"kind": "one town"}, {"kind": "two towns"}])
    said = []
    w = watch.Watch(kinds, said.append, GRPO().alike_fix())
    # groups of 2: kind 0 learns (one right, one wrong), kind 1 always wrong alike
    for _ in range(watch.ALIKE_STEPS + 3):
        w.see([0, 0, 1, 1], torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 0.0]), None, 2)
    assert len(said) == 1 and said[0].startswith("warning: kind 'two towns' (kind): its groups have scored alike "
                                                 f"below the run's best (1) for {watch.ALIKE_STEPS} steps in a row")
    # all right alike is no collapse; a step with a taught group starts the count again
    said.clear()
    w = watch.Watch(kinds, said.append, GRPO().alike_fix())
    for step in range(2 * watch.ALIKE_STEPS):
        taught = 1.0 if step == watch.ALIKE_STEPS - 1 else 0.0
        w.see([0, 0, 1, 1], torch.tensor([1.0, 1.0, 0.0, taught]), torch.tensor([0.0, 0.0, taught, taught]), None, 2)
    assert len(said) == 1 and "'two towns'" in said[0] and w.alike[0] == 0


def test_the_kinds_warning_names_a_fix_the_objective_has():
    """An RFT run was told "a KL anchor, --beta 0.04, keeps them in the update": RFT has no --beta (refused)."""
    kinds = watch.Kinds.of("kind", [{"kind": "one town"}, {"kind": "two towns"}])
    for objective, fix in ((RFT(), "RFT keeps none of its episodes, so this kind is not trained on (more "
                                    "--num-generations give it more tries a step)"),
                           (GRPO(), "at --beta 0 nothing pulls this kind back (a KL anchor, --beta 0.04"),
                           (GRPO(beta=0.04), "only the KL anchor (--beta 0.04) keeps them in the update")):
        said = []
        w = watch.Watch(kinds, said.append, objective.alike_fix())
        for _ in range(watch.ALIKE_STEPS):
            w.see([0, 0, 1, 1], torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 0.0]), None, 2)
        assert len(said) == 1 and f"teach nothing; {fix}" in said[0], said
        assert ("--beta" in said[0]) == (objective.name == "grpo")


def test_an_entropy_falling_under_a_quarter_of_step_ones_is_warned_of_once_until_it_recovers():
    said = []
    w = watch.Watch(None, said.append, GRPO().alike_fix())
    for mean in (2.0, 1.0, 0.4, 0.3, 0.9, 0.2):
        w.see([], torch.zeros(2), torch.zeros(2), torch.tensor([[mean, mean / 2]] * 2), 2)
    assert len(said) == 2 and said[0].startswith("warning: the sampled tokens' entropy fell to 0.400 nats a token "
                                                 "(0.200 at each turn's first), under 25% of step 1's 2.000")
