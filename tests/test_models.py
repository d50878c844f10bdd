import os

import pytest
import torch

from conftest import add_lora, needs_module
from tunebench.core.errors import TunebenchError
from tunebench.machine import metrics
from tunebench.model import inference, kernels, methods, models
from tunebench.training.autotune import compiler


def _ids(vocab=200, shape=(2, 12)):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))


def test_lora_at_init_is_the_base_model(tiny):
    x = _ids()
    with torch.no_grad():
        base = tiny.model(input_ids=x).logits.clone()
    peft = add_lora(tiny.model, 8, 16, 0.1, ["q_proj", "v_proj"]).eval()
    with torch.no_grad():
        assert torch.equal(peft(input_ids=x).logits, base)  # B = 0 at init


def test_merged_equals_unmerged(tiny):
    x = _ids()
    with torch.no_grad():
        base = tiny.model(input_ids=x).logits.clone()
    peft = add_lora(tiny.model, 8, 16, 0.0, ["q_proj", "v_proj"]).eval()
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
        unmerged = peft(input_ids=x).logits.clone()
        merged = peft.merge_and_unload()(input_ids=x).logits
    assert not torch.allclose(unmerged, base, atol=1e-3)  # the adapter does something
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)


def test_trainable_count_is_exact(tiny):
    c = tiny.model.config
    head = c.hidden_size // c.num_attention_heads
    q_in, q_out = c.hidden_size, c.num_attention_heads * head
    v_in, v_out = c.hidden_size, c.num_key_value_heads * head
    r = 8
    expected = c.num_hidden_layers * r * ((q_in + q_out) + (v_in + v_out))
    peft = add_lora(tiny.model, r, 16, 0.1, ["q_proj", "v_proj"])
    trainable, total = metrics.count_parameters(peft)
    assert trainable == expected == 3584
    assert total == sum(p.numel() for p in tiny.model.parameters())
    assert all("lora_" in n for n, p in peft.named_parameters() if p.requires_grad)


def test_auto_targets_per_architecture(tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    assert methods.target_modules(tiny.model, "auto")[0] == ["q_proj", "v_proj"]
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64))
    modules, _ = methods.target_modules(gpt2, "auto")
    assert modules == ["c_attn"]
    peft = add_lora(gpt2, 8, 16, 0.1, modules)
    assert metrics.count_parameters(peft)[0] == 2 * 8 * (64 + 3 * 64)  # Conv1D c_attn: 64 -> 192


def test_missing_target_module_is_named(tiny):
    with pytest.raises(TunebenchError, match="no linear module named 'qkv'.*q_proj"):
        methods.target_modules(tiny.model, "q_proj,qkv")
    assert "lm_head" not in methods.linear_module_names(tiny.model)


def test_unknown_model_offline_names_the_id():
    with pytest.raises(TunebenchError, match="model 'nobody/nothing-1b'.*offline.*--allow-download"):
        models.resolve("nobody/nothing-1b")
    with pytest.raises(TunebenchError, match="not a HF directory"):
        models.resolve("./no/such/dir")


def test_bf16_frozen_base_matches_fp32_lora(tiny):
    from tunebench.training.objective import loss_sum, prepare

    torch.manual_seed(1)
    peft = add_lora(tiny.model, 8, 16, 0.0, ["q_proj", "v_proj"])
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    x = _ids()
    batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}
    b, n, _ = prepare(batch, torch.device("cpu"))
    fp32 = loss_sum(peft, b, None) / n
    peft.get_base_model().to(torch.bfloat16)
    for name, p in peft.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # adapters stay fp32, as build_model keeps them
    bf16 = loss_sum(peft, b, None) / n
    assert abs(bf16.item() - fp32.item()) / fp32.item() < 1e-2
    methods.compute_adapters_in(peft)  # the training path: bf16 adapter matmuls under autocast, fp32 weights
    autocast = loss_sum(peft, b, torch.bfloat16) / n
    assert abs(autocast.item() - fp32.item()) / fp32.item() < 1e-2
    autocast.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for name, p in peft.named_parameters()
               if "lora_" in name)


def test_qlora_4bit_gradients_reach_the_first_layer_after_eval(tiny):
    """Also: the quantized base is frozen with its embeddings and head kept in 16 bits and its norms in fp32
    (methods.prepare_for_kbit; PEFT's prepare_model_for_kbit_training casts the embeddings and head to fp32)."""
    needs_module("bitsandbytes", "QLoRA needs bitsandbytes (a core dependency)")
    from tunebench.training.objective import loss_sum, prepare

    q = methods.load_quantized(tiny, "tiny", "4bit", torch.bfloat16, False)
    methods.prepare_for_kbit(q)
    assert q.get_input_embeddings().weight.dtype == q.get_output_embeddings().weight.dtype == torch.bfloat16
    assert {p.dtype for n, p in q.named_parameters() if "norm" in n} == {torch.float32}
    assert not any(p.requires_grad for p in q.parameters())
    peft = add_lora(q, 8, 16, 0.0, ["q_proj", "v_proj"])
    x = _ids()
    batch, n, _ = prepare({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}, torch.device("cpu"))
    peft.eval()
    with torch.no_grad():
        loss_sum(peft, batch, torch.bfloat16)  # an eval pass, as before training
    peft.train()
    with torch.no_grad():  # make B non-zero so A receives gradient
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    (loss_sum(peft, batch, torch.bfloat16) / n).backward()
    first = [p for name, p in peft.named_parameters() if "layers.0." in name and "lora_A" in name]
    assert first and all(p.grad is not None and p.grad.abs().sum() > 0 for p in first)


@pytest.mark.parametrize("compiled", [False, True])
def test_fast_dropout_keeps_the_rate_and_the_expectation(compiled):
    torch.manual_seed(0)
    d = kernels.FastDropout(0.1).train()
    x = torch.ones(400, 1000)
    y = torch.compile(d, dynamic=True)(x) if compiled else d(x)
    kept = (y != 0).float().mean().item()
    assert abs(kept - 0.9) < 0.003  # 400k draws: 5 sigma is about 0.0024
    lanes = (y != 0).float().reshape(-1, 4).mean(0)  # each 16-bit quarter of a 64-bit draw is a fair coin
    assert (lanes - 0.9).abs().max() < 0.005
    assert abs(y.mean().item() - 1.0) < 0.004  # scaled so E[y] = x
    values = torch.unique(y).tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / (1 - round(0.1 * 65536) / 65536))
    assert torch.equal(d.eval()(x), x)  # identity at eval
    x = torch.randn(3, 7, requires_grad=True)  # odd sizes, and gradients flow through the mask
    out = kernels.FastDropout(0.5).train()(x)
    out.sum().backward()
    assert torch.equal(x.grad != 0, out != 0)


def test_lora_dropout_modules_are_replaced(tiny):
    peft = add_lora(tiny.model, 8, 16, 0.1, ["q_proj", "v_proj"])
    drops = [m for m in peft.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(isinstance(m, kernels.FastDropout) and m.p == 0.1 for m in drops)


def test_fast_dropout_swaps_every_plain_dropout_and_keeps_p():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=16,
                                       resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3))
    plain = [m for m in model.modules() if type(m) is torch.nn.Dropout and m.p > 0]
    assert kernels.use_fast_dropout(model) == len(plain) == 1 + 2 * 3  # embeddings; per block attn, resid, mlp
    assert not [m for m in model.modules() if type(m) is torch.nn.Dropout and m.p > 0]
    assert model.transformer.h[0].attn.attn_dropout.p == 0.3 and model.transformer.drop.p == 0.2


def test_tunebench_attention_drops_probabilities_at_the_asked_rate():
    from tunebench.model import kernels
    torch.manual_seed(0)
    probs = torch.full((200, 64, 64), 1 / 64)
    out = kernels.fast_dropout(probs, 0.25)
    assert abs((out == 0).float().mean().item() - 0.25) < 0.005
    assert abs(out.mean().item() - 1 / 64) < 1e-4  # the expectation is kept


def test_compiled_blocks_give_the_eager_loss_and_gradients(tiny):
    """Regional compilation (a real torch.compile of the decoder layers) changes speed, not results."""
    from tunebench.training.objective import loss_sum, prepare

    peft = add_lora(tiny.model, 8, 16, 0.0, ["q_proj", "v_proj"])
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)

    def loss_and_grads(width):
        peft.zero_grad(set_to_none=True)
        x = _ids(shape=(2, width))
        b, n, _ = prepare({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}, torch.device("cpu"))
        loss = loss_sum(peft, b, None) / n
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in peft.named_parameters() if p.requires_grad}

    eager = [loss_and_grads(w) for w in (12, 17)]
    names = sorted(n for n, _ in peft.named_parameters())
    assert compiler.compile_blocks(peft) == 2  # tiny's two decoder layers
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # an earlier test in this process may have compiled the same layer code already
    counters.clear()
    compiled = [loss_and_grads(w) for w in (12, 17)]  # two widths: one dynamic-shape graph serves both
    assert counters["stats"]["unique_graphs"] >= 1  # really compiled
    assert sorted(n for n, _ in peft.named_parameters()) == names  # checkpoints keep their keys
    from tunebench.core import startup

    if not startup.USER_INDUCTOR_CACHE:  # the compiler's cache sits beside ours, not in torch's /tmp default
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(models.cache_dir() / "inductor")
        assert any((models.cache_dir() / "inductor").iterdir())  # (shared by this run's workers: conftest)
    for (l_e, g_e), (l_c, g_c) in zip(eager, compiled):
        torch.testing.assert_close(l_c, l_e, rtol=1e-4, atol=1e-5)
        for k in g_e:
            torch.testing.assert_close(g_c[k], g_e[k], rtol=1e-3, atol=1e-5, msg=k)
    compiler.uncompile_blocks(peft)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in peft.modules())


@pytest.mark.parametrize("make,limit", [
    (lambda t: t.GPT2Config(n_positions=64), 64),
    (lambda t: t.OPTConfig(max_position_embeddings=96), 96),
    (lambda t: t.LlamaConfig(max_position_embeddings=128), None),  # rotary: longer sequences still run
    (lambda t: t.GPTJConfig(n_positions=256), None),  # rotary, though its config says n_positions
    (lambda t: t.BloomConfig(), None),  # ALiBi
])
def test_position_limit_only_for_learned_position_tables(make, limit):
    import types

    import transformers

    assert inference.position_limit(types.SimpleNamespace(config=make(transformers))) == limit


def test_a_gpt2_tokenizer_directory_loads_the_whole_vocabulary():
    """vocab.json + merges.txt (GPT-2's files in ../shared/data): transformers 5's constructor, handed the
    file names, built an empty tokenizer that turned every text into no tokens."""
    from conftest import SHARED, unavailable

    path = SHARED / "gpt2-tokenizer"
    if not (path / "vocab.json").is_file():
        unavailable(f"GPT-2's tokenizer is not at {path} (../shared/data absent)")
    tok = models.load_tokenizer(str(path))
    assert len(tok) == 50257
    assert tok("hello world")["input_ids"] == [31373, 995]
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("context", [2048, None])
def test_a_ggufs_context_length_is_read_from_its_header_past_the_arrays_before_it(tmp_path, context):
    """The header read by hand (gguf's reader parses the whole vocabulary first) gives what gguf's reader gives:
    past string, number and nested arrays written before the field, and None where the file has none."""
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_array("test.scores", [0.5] * 300)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.name", "x")
    if context:
        writer.add_context_length(context)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    field = gguf.GGUFReader(str(path)).fields.get("llama.context_length")
    assert models.gguf_context_length(path) == (int(field.contents()) if field else None) == context


def test_a_gguf_replaced_at_the_same_path_is_converted_again(tmp_path):
    """The conversion cache was keyed by the path alone: a new file at the same path got the old weights."""
    import os

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF one")
    first = models.converted_dir(str(gguf))
    assert models.converted_dir(str(gguf)) == first  # the same file: the same conversion, kept between runs
    gguf.write_bytes(b"GGUF two, longer")
    os.utime(gguf, ns=(1, 1))
    assert models.converted_dir(str(gguf)) != first


def test_adapter_given_a_full_fine_tunes_run_loads_it_as_the_model(tmp_path):
    """`generate --adapter RUN` on a full fine-tune's run was PEFT's raw "Can't find 'adapter_config.json'"."""
    loaded = models.resolve("tiny")
    run = tmp_path / "full-run"
    loaded.model.save_pretrained(run)
    loaded.tokenizer.save_pretrained(run)
    again = inference.load_for_inference(None, str(run))
    assert not hasattr(again.model, "peft_config") and str(run) in again.source
    with pytest.raises(TunebenchError, match="holds a whole model .* pass it alone"):
        inference.load_for_inference("tiny", str(run))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TunebenchError, match="holds neither an adapter"):
        inference.load_for_inference(None, str(tmp_path / "empty"))


def test_a_gguf_another_process_is_converting_is_waited_for_not_converted_twice(tmp_path, monkeypatch):
    """Processes that start at once (compare's runs, tests on two workers sharing a cache) converted the same GGUF
    each (~21 s for the default model): the second now waits on the first's lock and takes its conversion."""
    import fcntl
    import threading

    dest = tmp_path / "models" / "m-c1"
    dest.parent.mkdir()
    monkeypatch.setattr(models, "_convert", lambda gguf, d: pytest.fail("converted a second time"))
    fd = os.open(dest.parent / f".{dest.name}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process, converting
    got = {}
    waiting = threading.Thread(target=lambda: got.setdefault("dest", models.convert_gguf(tmp_path / "m.gguf", dest)))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive()  # held at the lock, not converting beside it
    dest.mkdir()
    (dest / "config.json").write_text("{}")  # the other process's conversion, in place
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    waiting.join(10)
    assert got["dest"] == dest
