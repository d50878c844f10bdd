"""checkpoint.py and bench_data on their own: atomic saves, exact restores, refusals that name the fix."""

import json
import random

import numpy as np
import pytest
import torch

from tunebench.core.errors import TunebenchError
from tunebench.jobs import bench_data
from tunebench.settings.finetune import DataConfig
from tunebench.training import checkpoint
from tunebench.training.loop import LoopState

IDENTITY = {"model": "tiny", "seed": 1}


def _run_parts(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # frozen: not part of a checkpoint
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _step(model, opt, sched):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def test_save_then_load_restores_weights_optimizer_schedule_rng_and_position(tmp_path):
    model, opt, sched = _run_parts()
    for _ in range(3):
        _step(model, opt, sched)
    state = LoopState(step=3, epoch=1, batch_in_epoch=2, tokens=99, losses=[1.0, 0.5, 0.25])
    path = checkpoint.save(tmp_path, model, opt, sched, state, IDENTITY, keep=2)
    after_save = (random.random(), np.random.rand(), torch.rand(1))
    _step(model, opt, sched)
    expected = [p.detach().clone() for p in model.parameters()]

    model2, opt2, sched2 = _run_parts(seed=5)  # other weights: everything trainable must come from the file
    model2[0].weight.data.copy_(model[0].weight)  # the frozen base is the base model's, not the checkpoint's
    restored = checkpoint.load(path, model2, opt2, sched2, IDENTITY)
    assert restored == state
    assert (random.random(), np.random.rand(), torch.rand(1)) == after_save
    _step(model2, opt2, sched2)
    for a, b in zip(expected, model2.parameters()):
        assert torch.equal(a, b)


class _QuantizedLinear(torch.nn.Linear):
    """Saves entries that are not attributes beside its weights, as bitsandbytes' 8-bit layers do ('SCB')."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "SCB"] = torch.ones(self.out_features)
        destination[prefix + "weight_format"] = torch.tensor(0)


def test_a_frozen_layer_with_extra_state_dict_entries_saves_and_resumes(tmp_path):
    """torch.distributed.checkpoint looks every state-dict key up as an attribute; an 8-bit QLoRA run's
    first save on a GPU failed on 'SCB'. A checkpoint holds the trainable state alone."""
    def parts(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(_QuantizedLinear(4, 4), torch.nn.Linear(4, 2))
        model[0].weight.requires_grad_(False)
        model[0].bias.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    model, opt, sched = parts(0)
    _step(model, opt, sched)
    path = checkpoint.save(tmp_path, model, opt, sched, LoopState(step=1), IDENTITY, keep=1)
    assert "SCB" in "".join(model.state_dict())  # the layer still saves them outside a checkpoint
    model2, opt2, sched2 = parts(1)
    model2[0].load_state_dict(model[0].state_dict(), strict=False)
    checkpoint.load(path, model2, opt2, sched2, IDENTITY)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_a_failed_save_leaves_the_earlier_checkpoints_and_no_partial_one(tmp_path, monkeypatch):
    model, opt, sched = _run_parts()
    checkpoint.save(tmp_path, model, opt, sched, LoopState(step=1), IDENTITY, keep=2)
    real_save = torch.save

    def disk_full(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        checkpoint.save(tmp_path, model, opt, sched, LoopState(step=2), IDENTITY, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_only_the_newest_are_kept_and_incomplete_ones_are_not_listed(tmp_path):
    model, opt, sched = _run_parts()
    for step in range(1, 5):
        checkpoint.save(tmp_path, model, opt, sched, LoopState(step=step), IDENTITY, keep=2)
    (tmp_path / "step-00000009").mkdir()  # a directory without its files (copied by hand, say)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert checkpoint.find("auto", tmp_path).name == "step-00000004"
    assert checkpoint.find("auto", tmp_path / "none") is None


def test_refusals_name_the_problem_and_the_fix(tmp_path):
    model, opt, sched = _run_parts()
    path = checkpoint.save(tmp_path, model, opt, sched, LoopState(step=1), IDENTITY, keep=2)
    with pytest.raises(TunebenchError, match="not a tunebench checkpoint directory.*--resume auto"):
        checkpoint.find(str(tmp_path / "step-00000009"), tmp_path)
    with pytest.raises(TunebenchError, match="made with different seed.*same settings"):
        checkpoint.check_identity(path, {"model": "tiny", "seed": 2})
    # a section names each setting that differs; one the checkpoint does not hold was added after it was made
    sectioned = checkpoint.save(tmp_path / "sectioned", model, opt, sched, LoopState(step=1),
                                {"model": "tiny", "adapter": {"r": 4, "objective": "grpo"}}, keep=2)
    with pytest.raises(TunebenchError, match=r"different adapter \(negative_weight: unrecorded \(as before the "
                       r"setting\) then, 0.5 now; r: 4 then, 8 now\); resume with the same settings"):
        checkpoint.check_identity(sectioned, {"model": "tiny", "adapter": {"r": 8, "objective": "grpo",
                                                                            "negative_weight": 0.5}})

    # a path typed relative by one run and held whole by its resume (a child now starts in its run folder, its
    # paths made absolute first) is the same data; another file, or a name, is not
    named = checkpoint.save(tmp_path / "named", model, opt, sched, LoopState(step=1),
                            {"model": "tiny", "data": "data/d.jsonl", "seed": 1}, keep=2)
    checkpoint.check_identity(named, {"model": "tiny", "data": "/srv/work/data/d.jsonl", "seed": 1})
    for other in ("/srv/work/data/e.jsonl", "d.jsonl", "/srv/d.jsonl"):
        with pytest.raises(TunebenchError, match="made with different data"):
            checkpoint.check_identity(named, {"model": "tiny", "data": other, "seed": 1})
    mixed = checkpoint.save(tmp_path / "mixed", model, opt, sched, LoopState(step=1),
                            {"model": "tiny", "data": [["a.csv", 0.7], ["b.csv", 0.3]], "seed": 1}, keep=2)
    checkpoint.check_identity(mixed, {"model": "tiny", "data": [["/w/a.csv", 0.7], ["/w/b.csv", 0.3]], "seed": 1})
    with pytest.raises(TunebenchError, match="made with different data"):
        checkpoint.check_identity(mixed, {"model": "tiny", "data": [["/w/a.csv", 0.5], ["/w/b.csv", 0.5]], "seed": 1})
    (path / checkpoint.STATE).write_text("{not json")
    with pytest.raises(TunebenchError, match="unreadable state.json"):
        checkpoint.check_identity(path, IDENTITY)


def test_bench_data_measures_whole_passes_over_the_data(tmp_path, capsys, monkeypatch):
    """Two datasets of 12 rows alike but for 10 more ASCII characters in every response of the second: with the
    tiny model's one-token-per-byte tokenizer, every batch of 4 of the second holds exactly 40 more real tokens,
    whatever the template adds (an expectation that does not come from the pipeline under test). The cached load
    reads this run's own cache (an empty cache directory of its own)."""
    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))
    per_batch = {}
    for extra in (0, 10):
        path = tmp_path / f"d{extra}.jsonl"
        path.write_text("".join(json.dumps({"instruction": f"question {i:02d}", "response": f"answer {i:02d}"
                                            + "x" * extra}) + "\n" for i in range(12)))
        result = bench_data.run("tiny", DataConfig(path=str(path), max_length=256), micro_batch_size=4, seconds=0.2)
        assert result["rows"] == 12 and f"{path}: 12 rows" in capsys.readouterr().out
        per_batch[extra] = result["tokens_per_s"] / result["batches_per_s"]
        assert result["ms_per_batch"] == pytest.approx(1000 / result["batches_per_s"], rel=0.01, abs=1e-3)
    assert per_batch[10] - per_batch[0] == pytest.approx(40, rel=0.02)
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.npz"))) == 2  # one cache file per dataset


def test_rotation_keeps_the_good_checkpoints_when_a_later_one_is_damaged(tmp_path):
    """Steps 3 and 6 saved, step 6's tensors truncated, the run resumed from 3 with keep 1: saving 4 and 5
    used to delete every good checkpoint (the damaged step 6 sorted last and took the one place kept)."""
    model, opt, sched = _run_parts()
    for step in (3, 6):
        checkpoint.save(tmp_path, model, opt, sched, LoopState(step=step), IDENTITY, keep=2)
    tensors = tmp_path / "step-00000006" / checkpoint.TENSORS
    tensors.write_bytes(tensors.read_bytes()[:100])
    assert checkpoint.find("auto", tmp_path).name == "step-00000003"
    for step in (4, 5):
        checkpoint.save(tmp_path, model, opt, sched, LoopState(step=step), IDENTITY, keep=1)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000005", "step-00000006"]
    assert checkpoint.find("auto", tmp_path).name == "step-00000005"  # a good one is left to resume from
