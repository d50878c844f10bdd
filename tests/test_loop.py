import copy
import json

import pytest
import torch

from conftest import (
    ROWS,
    add_lora,
    assert_resumed,
    pairs_file,
    run_losses,
    run_weights,
    sigterm_after_step,
    tiny_run_config,
)
from tunebench.core.errors import TunebenchError
from tunebench.data import batching
from tunebench.data.tokenize import tokenize_messages
from tunebench.jobs import finetune
from tunebench.model import inference
from tunebench.model.models import byte_tokenizer
from tunebench.settings.finetune import DataConfig
from tunebench.training import checkpoint, feed
from tunebench.training.loop import Hooks, LoopSettings, LoopState, optimizer_steps
from tunebench.training.objective import CausalLMLoss


def _data():
    tok = byte_tokenizer()
    tok.chat_template = None
    msgs = [[{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["response"]}]
            for r in ROWS[:4]]
    return tok, tokenize_messages(msgs, tok, DataConfig(max_length=256), "instruction")


class _Given:
    """Steps of the micro batches given, all in one step (feed.Steps)."""

    sampled = False

    def __init__(self, batches):
        self.batches = batches

    def next(self, at):
        return self.batches


def _one_step(model, batches):
    queue = list(batches)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    settings = LoopSettings(total_steps=1, grad_accum_steps=len(batches), max_grad_norm=1e9,
                            device=torch.device("cpu"), progress=False)
    logs = []
    optimizer_steps(CausalLMLoss(model), opt, sched, _Given(queue), LoopState(), settings, Hooks(log=logs.append))
    return logs[-1]["loss"], logs[-1]["grad_norm"]


def test_accumulation_2x2_matches_batch_4(tiny):
    tok, data = _data()
    assert len(set(data.lengths().tolist())) > 1  # uneven lengths: per-micro-batch means would differ
    a, b = copy.deepcopy(tiny.model), copy.deepcopy(tiny.model)
    loss4, norm4 = _one_step(a, [batching.collate(data, [0, 1, 2, 3], tok.pad_token_id)])
    loss22, norm22 = _one_step(b, [batching.collate(data, [0, 1], tok.pad_token_id),
                                   batching.collate(data, [2, 3], tok.pad_token_id)])
    assert loss22 == pytest.approx(loss4, rel=1e-5)
    assert norm22 == pytest.approx(norm4, rel=1e-4)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=2e-6, rtol=1e-5)


_cfg = tiny_run_config


_losses, _weights = run_losses, run_weights


@pytest.mark.parametrize("extra", [
    {},  # LoRA, padded rows
    {"adapter.method": "full", "train.lr": 1e-3},  # fused AdamW state of every weight
    {"data.packing": "on"},
    {"adapter.method": "prefix", "adapter.num_virtual_tokens": 4},  # virtual tokens: PEFT's own forward
    {"adapter.method": "dora"},  # LoRA plus learned magnitudes
    {"train.objective": "dpo"},  # preference pairs, the reference through the adapter at its starting values
    {"train.objective": "orpo"},  # its normalisers: pairs and the chosen rows' tokens of each step
], ids=["lora", "full", "packed", "prefix", "dora", "dpo", "orpo"])
def test_resume_after_sigterm_reproduces_the_uninterrupted_run(tmp_path, dataset, extra):
    """Killed at step 3 and resumed, a run ends with the same losses and the same weights, bit for bit."""
    if "train.objective" in extra:
        dataset = pairs_file(tmp_path)
    full = tmp_path / "full"
    finetune.run(_cfg(dataset, full, **extra))
    expected = _losses(full)
    assert len(expected) == 6

    part = tmp_path / "part"
    with sigterm_after_step(3), pytest.raises(TunebenchError, match="interrupted at step 3.*--resume auto") as e:
        finetune.run(_cfg(dataset, part, **extra))
    assert e.value.exit_code == 130
    assert [p.name for p in checkpoint.list_checkpoints(part / "checkpoints")] == ["step-00000003"]
    finetune.run(_cfg(dataset, part, **extra, **{"train.resume": "auto"}))
    assert_resumed(part, 3)
    resumed = _losses(part)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == expected[step], step
    want, got = _weights(full), _weights(part)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_resume_refuses_other_settings(tmp_path, dataset):
    out = tmp_path / "r"
    finetune.run(_cfg(dataset, out, **{"train.max_steps": 2}))
    with pytest.raises(TunebenchError, match="different adapter"):
        finetune.run(_cfg(dataset, out, **{"train.max_steps": 4, "train.resume": "auto", "adapter.r": 4}))


def test_resume_with_another_micro_batch_is_refused_not_replaced(tmp_path, dataset):
    out = tmp_path / "m"
    finetune.run(_cfg(dataset, out, **{"train.max_steps": 2}))
    with pytest.raises(TunebenchError, match="continues at micro batch 2 x accumulation 2 on 1 rank.*--batch-size 2"):
        finetune.run(_cfg(dataset, out, **{"train.max_steps": 4, "train.resume": "auto", "train.micro_batch_size": 1,
                                            "train.grad_accum_steps": 4}))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, dataset, monkeypatch):
    import tunebench.training.loop as loop

    real, real_train = CausalLMLoss.forward, loop.optimizer_steps
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        value = real(*args, **kwargs)
        return value * float("nan") if calls["n"] > 4 else value  # steps 1-2 (2 micro-batches each) fine, then NaN

    def train_poisoned(*args, **kwargs):  # from the first training step on: probes and eval run clean
        monkeypatch.setattr(CausalLMLoss, "forward", poisoned)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(loop, "optimizer_steps", train_poisoned)
    out = tmp_path / "nan"
    with pytest.raises(TunebenchError, match="loss became nan at step 3.*--lr"):
        finetune.run(_cfg(dataset, out, **{"train.save_steps": 2}))
    kept = checkpoint.list_checkpoints(out / "checkpoints")
    assert [p.name for p in kept] == ["step-00000002"]
    state = json.loads((kept[0] / "state.json").read_text())
    assert state["loop"]["step"] == 2 and all(l == l for l in state["loop"]["losses"])


def test_checkpoints_keep_the_newest(tmp_path, dataset):
    out = tmp_path / "k"
    finetune.run(_cfg(dataset, out, **{"train.save_steps": 1, "train.save_total_limit": 2}))
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step-00000005", "step-00000006"]
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_matches_torch(dtype):
    import torch.nn.functional as F

    from tunebench.model.kernels import cross_entropy_sum

    torch.manual_seed(0)
    logits = (torch.randn(150, 300) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 300, (150,))
    ours = cross_entropy_sum(logits, targets, rows=64)
    (ours * 0.5).backward()
    g_ours = logits.grad.clone()
    logits.grad = None
    ref = F.cross_entropy(logits.float(), targets, reduction="sum")
    (ref * 0.5).backward()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-4)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(g_ours.float(), logits.grad.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_matches_head_then_loss(monkeypatch, dtype, bias):
    """Loss and the gradients of hidden states, weight and bias equal autograd's through
    F.linear + F.cross_entropy; chunks and loss passes smaller than N exercise every boundary."""
    import torch.nn.functional as F

    from tunebench.model import kernels
    monkeypatch.setitem(kernels._CHUNK_BYTES, "cpu", 48 * 300 * (torch.finfo(dtype).bits // 8))  # 48-row chunks
    monkeypatch.setattr(kernels, "_MIN_CHUNK_ROWS", 16)
    monkeypatch.setitem(kernels._LOSS_BYTES, "cpu", 20 * 300 * 4)  # 20-row loss passes of fp32 logits
    monkeypatch.setattr(kernels, "_WEIGHT_GRAD_ROWS", 48)  # the weight's gradient summed over chunks too
    torch.manual_seed(0)
    hidden = torch.randn(150, 32).to(dtype).requires_grad_()
    weight = torch.randn(300, 32).requires_grad_()  # fp32 master weight, run in `dtype`, as under autocast
    b = torch.randn(300).requires_grad_() if bias else None
    targets = torch.randint(0, 300, (150,))

    ours = kernels.linear_cross_entropy_sum(hidden, weight, b, targets, dtype)
    (ours * 0.5).backward(retain_graph=True)
    got = [t.grad.clone() for t in (hidden, weight, b) if t is not None]
    with pytest.raises(RuntimeError, match="inplace"):  # the gradients were scaled in place: never twice
        (ours * 0.5).backward()
    for t in (hidden, weight, b):
        if t is not None:
            t.grad = None
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if b is None else b.to(dtype))
    ref = F.cross_entropy(logits.float(), targets, reduction="sum")
    (ref * 0.5).backward()
    want = [t.grad for t in (hidden, weight, b) if t is not None]

    assert got[0].dtype == hidden.dtype and got[1].dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, ref, rtol=tol, atol=1e-3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol * w.abs().max().item())


@pytest.mark.parametrize("tied", [False, True])
def test_loss_sum_equals_the_models_own_loss_and_gradients(tied):
    """Full fine-tuning through the fused head (tied: the head's gradient lands on the embedding
    too) against transformers' own loss on the same rows."""
    from tunebench.model import models
    from tunebench.training.objective import loss_sum, prepare

    model, _ = models.tiny()
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tok, data = _data()
    b, n, _ = prepare(batching.collate(data, [0, 1], tok.pad_token_id), torch.device("cpu"))
    (loss_sum(model, b, None) / n).backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
    ref.backward()
    assert ours.keys() == {k for k, p in model.named_parameters() if p.grad is not None}
    for k, p in model.named_parameters():
        torch.testing.assert_close(ours[k], p.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_linear_cross_entropy_keeps_no_logits_between_forward_and_backward(tiny, monkeypatch):
    """The point of the fused head: nothing of the vocabulary's width waits for the backward, and
    no gradient is made when none is wanted (evaluation)."""
    from tunebench.model import kernels
    from tunebench.training.objective import loss_sum, prepare

    vocab = tiny.model.config.vocab_size
    tok, data = _data()
    b, n, _ = prepare(batching.collate(data, [0, 1], tok.pad_token_id), torch.device("cpu"))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = loss_sum(tiny.model, b, None)
    assert n > 0 and loss.requires_grad
    assert saved and not [s for s in saved if s and s[-1] == vocab], saved

    grads = []
    real = kernels._cross_entropy_rows
    monkeypatch.setattr(kernels, "_cross_entropy_rows", lambda x, t, grad, rows: grads.append(grad) or real(x, t, grad, rows))
    with torch.no_grad():
        loss_sum(tiny.model, b, None)
    assert grads and all(g is None for g in grads)


@pytest.mark.parametrize("attention", ["eager", "sdpa", "tunebench"])
def test_padded_rows_give_each_row_its_own_loss_and_gradient(tiny, attention):
    """No attention mask is passed for right-padded rows: the loss and gradients must equal those of
    each row run alone without padding, for every attention kernel (tiny has grouped-query heads)."""
    from tunebench.model import kernels
    from tunebench.training.objective import loss_sum, prepare

    tok, data = _data()
    kernels.register()
    model = tiny.model
    rows = [0, 1, 2, 3]
    assert len({len(data.example(i)[0]) for i in rows}) > 1  # really padded

    def loss_and_grads(batch_rows, impl):
        model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        b, n, _ = prepare(batching.collate(data, batch_rows, tok.pad_token_id), torch.device("cpu"))
        loss = loss_sum(model, b, None)
        loss.backward()
        return loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_n, ref_grads = 0.0, 0, {}
    for r in rows:  # one row at a time: no padding anywhere
        loss, n, grads = loss_and_grads([r], "eager")
        ref_loss, ref_n = ref_loss + loss, ref_n + n
        for k, g in grads.items():
            ref_grads[k] = ref_grads.get(k, 0) + g
    loss, n, grads = loss_and_grads(rows, attention)
    assert n == ref_n
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("attention", ["eager", "sdpa", "tunebench"])
def test_packed_and_unpacked_losses_and_gradients_match(tiny, attention):
    """In train mode (dropout 0 in the tiny model), so the gradients a packed step applies are checked too."""
    from tunebench.model import kernels
    from tunebench.training.objective import loss_sum, prepare
    tok, data = _data()
    kernels.register()
    model = add_lora(tiny.model, 4, 8, 0.0, ["q_proj", "v_proj"])
    model.base_model.model.set_attn_implementation(attention)
    model.train()
    rows = [0, 1, 2, 3]
    unpacked, n_u, real_u = prepare(batching.collate(data, rows, tok.pad_token_id), torch.device("cpu"))
    packed, n_p, real_p = prepare(batching.collate_packed(data, rows, tok.pad_token_id, capacity=256),
                                  torch.device("cpu"))
    assert packed["input_ids"].shape[0] < unpacked["input_ids"].shape[0]  # really packed
    assert (n_p, real_p) == (n_u, real_u)

    def loss_and_grads(batch, n):
        model.zero_grad(set_to_none=True)
        loss = loss_sum(model, batch, None) / n
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    a, grads_a = loss_and_grads(unpacked, n_u)
    b, grads_b = loss_and_grads(packed, n_p)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert grads_a and grads_a.keys() == grads_b.keys()
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], rtol=1e-4, atol=1e-6, msg=k)
    # and packing really isolates examples: a wrong (continuous) position layout changes the loss
    leaky = dict(packed, position_ids=torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"]))
    with torch.no_grad():
        c = loss_sum(model, leaky, None) / n_p
    assert abs(c.item() - a.item()) > 1e-4


def test_gradient_checkpointing_gives_the_same_losses_and_gradients(tiny):
    from tunebench.training.autotune.probe import enable_checkpointing
    from tunebench.training.objective import loss_sum, prepare

    tok, data = _data()
    model = add_lora(tiny.model, 4, 8, 0.0, ["q_proj", "v_proj"])
    model.train()
    batch, n, _ = prepare(batching.collate(data, [0, 1, 2, 3], tok.pad_token_id), torch.device("cpu"))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = loss_sum(model, batch, None) / n
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain = loss_and_grads()
    enable_checkpointing(model)
    assert model.base_model.model.model.gradient_checkpointing
    ckpt_loss, ckpt = loss_and_grads()
    torch.testing.assert_close(ckpt_loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert plain and plain.keys() == ckpt.keys()
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-5, atol=1e-7, msg=k)


def test_a_fresh_run_never_replaces_an_earlier_one(tmp_path, dataset):
    out = tmp_path / "kept"
    finetune.run(_cfg(dataset, out, **{"train.max_steps": 2}))
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(TunebenchError, match="already holds a run.*--resume auto.*--overwrite"):
        finetune.run(_cfg(dataset, out, **{"train.max_steps": 2}))
    assert (out / "metrics.jsonl").read_text() == before
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step-00000002"]
    finetune.run(_cfg(dataset, out, **{"train.max_steps": 1, "train.overwrite": True}))
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step-00000001"]


def test_a_sigterm_whose_raise_python_swallowed_still_stops_the_run_before_its_loop(tmp_path, dataset, monkeypatch):
    """A run's SIGTERM handler raises in whatever the main thread runs; landing in a finalizer (or an at-fork hook,
    a thread's start), the raise is printed as "Exception ignored" and lost, and the run trained on as if never
    asked to stop (a search's trial outlived its SIGTERM). The stop is kept and raised again between the run's
    stages: exit 130 before the first step, nothing trained or written."""
    import os
    import signal

    from tunebench.jobs.parts import recipe

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the finalizer

    planned = recipe.plan_run
    swallowed = []

    def plan_then_signal(*args):
        made = planned(*args)
        Finalized()
        swallowed.append(True)  # the raise did not reach this frame
        return made

    monkeypatch.setattr(recipe, "plan_run", plan_then_signal)
    out = tmp_path / "run"
    with pytest.raises(TunebenchError, match="SIGTERM before the first training step") as stopped:
        finetune.run(_cfg(dataset, out, **{"train.max_steps": 2}))
    assert swallowed and stopped.value.exit_code == 130
    assert not checkpoint.list_checkpoints(out / "checkpoints") and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("method, precision", [("full", "bf16"), ("full", "fp32"), ("lora", "fp32")])
def test_methods_and_precisions_train_and_save(tmp_path, dataset, method, precision):
    """What a run saves is what it trained: reloaded, it gives the run's own final eval loss."""
    from tunebench.core.precision import DTYPES
    from tunebench.data.tokenize import load_tokenized, split
    from tunebench.model import models
    from tunebench.training.objective import CausalLMLoss, evaluate

    out = tmp_path / f"{method}-{precision}"
    cfg = _cfg(dataset, out, **{"adapter.method": method, "train.precision": precision,
                                "train.lr": 1e-3 if method == "full" else 1e-2})
    summary = finetune.run(cfg)
    plan = json.loads((out / "plan.json").read_text())
    row = next(d for d in plan["decisions"] if d["setting"] == "precision")
    assert row["value"] == precision and row["reason"].startswith("asked for")
    if method == "full":
        reloaded = models.resolve(str(out))  # a full fine-tune is a plain HF directory
        assert type(reloaded.model).__name__ == "LlamaForCausalLM"
    else:
        reloaded = inference.load_for_inference("tiny", str(out))
    data = load_tokenized(cfg.data, reloaded.tokenizer, None)
    _, eval_idx = split(len(data), cfg.data.eval_fraction, cfg.schedule.seed, None)
    batches = batching.eval_batches(data, eval_idx, 4, reloaded.tokenizer.pad_token_id)
    autocast = None if precision == "fp32" else DTYPES[precision]
    again = evaluate(CausalLMLoss(reloaded.model, autocast), batches, torch.device("cpu"))["eval_loss"]
    assert again == pytest.approx(summary["eval_loss"], rel=1e-3 if autocast else 1e-5)
    assert abs(summary["eval_loss"] - summary["eval_loss_before"]) > 1e-3  # and training changed the weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["eager", "sdpa", "tunebench"])
def test_attention_weights_estimate_is_what_autograd_keeps(tiny, attention, dtype):
    """attention.pick skips kernels by this estimate (a CPU past its RAM is OOM-killed, not raised),
    so it must match the T x T tensors autograd really saves for the backward."""
    from tunebench.model import kernels
    kernels.register()
    model = tiny.model.to(dtype)
    model.train()
    model.set_attn_implementation(attention)
    rows, length = 3, 40
    ids = torch.randint(5, 100, (rows, length), generator=torch.Generator().manual_seed(0))
    kept: dict[int, int] = {}

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == length and t.shape[-2] % length == 0:  # (.., T, T), ours stacks heads
            kept[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    estimate = kernels.saved_weights_mb(model.config, rows, length, attention, dtype.itemsize) * 2**20
    assert estimate == sum(kept.values())


def test_measured_settings_leave_no_trace_on_the_run(tmp_path, dataset):
    """Probes run in train mode with the RNG restored and no gradients left: a run whose micro batch
    was measured gives the same losses and weights as the same run given that micro batch."""
    from safetensors.torch import load_file

    auto = _cfg(dataset, tmp_path / "auto", **{"train.micro_batch_size": "auto", "adapter.lora_dropout": 0.1})
    chosen = finetune.run(auto)["micro_batch_size"]
    given = _cfg(dataset, tmp_path / "given", **{"train.micro_batch_size": chosen, "adapter.lora_dropout": 0.1})
    finetune.run(given)
    assert _losses(tmp_path / "auto") == _losses(tmp_path / "given")
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("auto", "given"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_probe_step_runs_in_train_mode_and_restores_the_mode(tiny):
    from tunebench.training.autotune.probe import probe_step

    tok, data = _data()
    seen = []
    model = tiny.model
    model.model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(m.training))
    model.eval()
    step = probe_step(model, lambda size: batching.collate(data, list(range(size)), tok.pad_token_id),
                      torch.device("cpu"), None)
    before = torch.get_rng_state()
    step(2)
    assert seen and all(seen) and not model.training  # probed in train mode, left as found
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in model.parameters())


def test_a_probe_step_that_runs_out_of_memory_leaves_no_gradient_behind(tiny):
    """A CUDA OOM can strike part-way through the backward, after some gradients were written; the
    batch probe goes on to a smaller size, and the run's first step must not add those stale gradients."""
    from tunebench.training.autotune.probe import probe_step

    tok, data = _data()
    model = tiny.model
    model.eval()

    def out_of_memory_midway(grad):  # the first layer's gradient is reached last: the head's are written
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    handle = model.model.layers[0].self_attn.q_proj.weight.register_hook(out_of_memory_midway)
    step = probe_step(model, lambda size: batching.collate(data, list(range(size)), tok.pad_token_id),
                      torch.device("cpu"), None)
    with pytest.raises(torch.OutOfMemoryError):
        step(2)
    handle.remove()
    assert all(p.grad is None for p in model.parameters())
    assert not model.training


def test_the_gpu_probe_budget_counts_only_free_memory_as_room(monkeypatch):
    """Memory other processes (or this one) already hold is not room for the probe: the budget is what is
    held plus 92% of what is free, with the allocator's unused cached blocks counted as free. (On the
    H100 a budget of 92% of the whole card made micro batch 1 'over budget' beside a 76 GiB tenant.)"""
    from tunebench.training.autotune import probe

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 77 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 78 * gib)
    baseline, budget = probe.memory_budget_mb(torch.device("cuda", 0))
    assert baseline == 77 * 1024
    assert budget == pytest.approx(77 * 1024 + 0.92 * 4 * 1024)


def _loop_run(tiny, prefetch, steps=6, logging_steps=1, source=None, time_limit_s=None):
    """A few AdamW steps of the tiny model on 4 rows, 2 micro-batches of 1 a step, epochs wrapping."""
    import numpy as np

    from tunebench.machine.distributed import World

    tok, data = _data()
    model = copy.deepcopy(tiny.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    source = source or feed.Batches(lambda epoch: batching.epoch_steps(np.arange(len(data)), 2, 0, epoch),
                                    lambda rows, _: batching.collate(data, rows, tok.pad_token_id)).feed(World(), 1, 2)
    settings = LoopSettings(total_steps=steps, grad_accum_steps=2, max_grad_norm=1.0, device=torch.device("cpu"),
                            progress=False, logging_steps=logging_steps, prefetch=prefetch, time_limit_s=time_limit_s)
    logs = []
    state = optimizer_steps(CausalLMLoss(model), opt, sched, source, LoopState(), settings, Hooks(log=logs.append))
    return state, logs, model


def test_prefetched_batches_train_exactly_as_inline_ones(tiny):
    inline, logs_a, a = _loop_run(tiny, prefetch=False)
    ahead, logs_b, b = _loop_run(tiny, prefetch=True)
    assert inline.losses == ahead.losses and len(inline.losses) == 6
    assert (inline.epoch, inline.batch_in_epoch) == (ahead.epoch, ahead.batch_in_epoch) == (2, 4)  # consumed, not prefetched
    assert [r["grad_norm"] for r in logs_a] == [r["grad_norm"] for r in logs_b]
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)

    class Broken(_Given):
        def next(self, at):
            raise ValueError("a bad row")

    with pytest.raises(ValueError, match="a bad row"):  # the background thread's error reaches the loop
        _loop_run(tiny, prefetch=True, source=Broken([]))


def test_a_time_limit_ends_the_loop_after_the_step_that_passes_it_and_logs_that_step(tiny):
    """--time-budget of a run whose steps sample: a deadline, not a step count. Past it after the first step, the
    loop ends there with that step read and logged (it logs every third); far off, every step runs."""
    ended, logs, _ = _loop_run(tiny, prefetch=False, steps=6, logging_steps=3, time_limit_s=0.0)
    assert ended.step == 1 and len(ended.losses) == 1 and [r["step"] for r in logs] == [1]
    whole, _, _ = _loop_run(tiny, prefetch=False, steps=6, time_limit_s=3600.0)
    assert whole.step == 6 and whole.losses[0] == ended.losses[0]


def test_the_loop_reads_the_device_only_on_logging_steps(tiny, monkeypatch):
    """Losses, gradient norms and step times stay on the device between logging steps: the step itself
    reads no tensor (each read is a host-device sync on a GPU), and one read per logging step fetches all."""
    import sys

    import tunebench.training.loop as loop

    reads, stray = [], []
    real_to_host = loop.to_host
    monkeypatch.setattr(loop, "to_host", lambda tensors: reads.append(len(tensors)) or real_to_host(tensors))
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        def spy(self, *args, _real=getattr(torch.Tensor, name), _name=name):
            caller = sys._getframe(1).f_code
            if caller.co_filename == loop.__file__ and caller.co_name == "train":
                stray.append(_name)
            return _real(self, *args)
        monkeypatch.setattr(torch.Tensor, name, spy)
    state, logs, _ = _loop_run(tiny, prefetch=False, steps=7, logging_steps=3)
    assert stray == []
    assert reads == [6, 6, 2]  # steps 1-3 at step 3, 4-6 at step 6, 7 at the last step: (loss, grad norm) each
    assert [r["step"] for r in logs] == [3, 6, 7] and len(state.losses) == 7 and state.train_time_s > 0


def test_a_run_ends_with_its_peak_memory_beside_its_speed(tmp_path, dataset, capsys):
    summary = finetune.run(_cfg(dataset, tmp_path / "run"))
    closing = [line for line in capsys.readouterr().out.splitlines() if " steps in " in line][-1]
    assert f"real tokens/s over {summary['steady_time_s']:.1f}s of steps after the first 2, MFU {100 * summary['mfu']:.1f}%, " \
           f"peak RSS {summary['peak_memory_mb']:,.0f} MB" in closing
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    (row,) = [d for d in plan["decisions"] if d["setting"] == "logging_steps"]
    assert row["value"] == 1 and "on a CPU, reading the loss costs nothing" in row["reason"]
