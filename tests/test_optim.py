"""The optimizer and learning-rate schedules every training job uses (tunebench.training.optim)."""

import copy
import math

import pytest
import torch


def test_adamw_is_fused_on_cpu_decays_only_matrices_and_takes_foreachs_steps():
    from tunebench.training import optim
    cpu = torch.device("cpu")
    assert optim.optimizer_row(cpu, 0.0)[1] == "AdamW, fused"
    assert optim.optimizer_row(torch.device("mps"), 0.0)[1] == "AdamW, foreach"
    torch.manual_seed(0)
    start = torch.nn.Linear(7, 300)
    reference = lambda m: torch.optim.AdamW(  # noqa: E731 - the standard grouping, written out
        [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}], lr=1e-2,
        foreach=True)
    runs = []
    for make in (lambda m: optim.adamw(m, 1e-2, 0.1, cpu), reference):
        m = copy.deepcopy(start)
        opt = make(m)
        for step in range(3):
            for i, p in enumerate(m.parameters()):
                p.grad = torch.sin(p.detach() * (step + i + 1))
            opt.step()
        runs.append((opt.defaults.get("fused"), [p.detach() for p in m.parameters()]))
    assert runs[0][0] is True and not runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # With zero gradients only weight decay moves a parameter: the matrix shrinks, the bias stays.
    m = copy.deepcopy(start)
    opt = optim.adamw(m, 1e-2, 0.5, cpu)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(m.bias, start.bias) and not torch.equal(m.weight, start.weight)


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "warmup_stable_decay"])
def test_schedules_warm_up_then_follow_their_shape(name):
    from tunebench.training import optim
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = optim.scheduler(opt, name, warmup_steps=10, total_steps=100)
    lrs = []
    for _ in range(100):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] < lrs[5] < lrs[9] < 1.0 and lrs[10] == pytest.approx(1.0)  # linear warm-up to the peak
    if name == "constant":
        assert lrs[99] == pytest.approx(1.0)
    elif name == "warmup_stable_decay":  # flat until the last fifth, then down to ~0
        assert lrs[79] == pytest.approx(1.0) and lrs[90] < 0.7 and lrs[99] < 0.01
    else:
        assert lrs[50] < 0.9 and lrs[99] < 0.03


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "warmup_stable_decay"])
def test_schedules_are_transformers_own_float_for_float(name):
    """optim writes transformers.get_scheduler's formulas out (importing them costs ~1.8 s): every value,
    past the end too, is the one get_scheduler gives, exactly, for odd and degenerate lengths alike."""
    from transformers import get_scheduler

    from tunebench.training import optim
    for warmup, total in [(0, 1), (0, 37), (3, 37), (10, 100), (7, 8), (8, 8), (20, 1000)]:
        ours = optim.scheduler(torch.optim.SGD([torch.zeros(1)], lr=3e-3), name, warmup, total)
        decay = max(1, math.ceil(optim.WSD_DECAY_FRACTION * total))
        kwargs = {"num_decay_steps": min(decay, max(1, total - warmup))} if name == "warmup_stable_decay" else None
        theirs = get_scheduler("constant_with_warmup" if name == "constant" else name,
                               torch.optim.SGD([torch.zeros(1)], lr=3e-3), num_warmup_steps=warmup,
                               num_training_steps=total, scheduler_specific_kwargs=kwargs)
        for step in range(total + 3):
            assert ours.get_last_lr() == theirs.get_last_lr(), (warmup, total, step)
            ours.optimizer.step(), ours.step(), theirs.optimizer.step(), theirs.step()
