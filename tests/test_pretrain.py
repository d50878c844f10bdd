import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_losses, sigterm_after_step
from tunebench.core.errors import TunebenchError
from tunebench.data import blocks
from tunebench.data import tokenizer_training as tokenizer
from tunebench.jobs import pretrain
from tunebench.jobs.parts import runner
from tunebench.model import arch
from tunebench.settings import pretrain as pretrain_config
from tunebench.settings.pretrain import DataConfig, ModelConfig, PretrainConfig, TrainingConfig

TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times.\n" for i in range(400))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture
def char_tok(tmp_path, corpus):
    tokenizer.train([str(corpus)], 100, "char", tmp_path / "char-tok", quiet=True)
    from tunebench.model.models import load_tokenizer

    return load_tokenizer(str(tmp_path / "char-tok"))


@pytest.mark.parametrize("kind,vocab,exact", [("bpe", 300, True), ("char", 100, True), ("unigram", 120, True),
                                              ("wordpiece", 120, False)])
def test_tokenizer_round_trip_and_reload(tmp_path, corpus, kind, vocab, exact):
    from transformers import AutoTokenizer

    result = tokenizer.train([str(corpus)], vocab, kind, tmp_path / kind, quiet=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / kind)
    assert len(tok) == result["vocab_size"] <= vocab
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    sample = "Line 5: the quick brown fox jumps over the lazy dog, 9 times.\n"
    ids = tok(sample, add_special_tokens=False)["input_ids"]
    decoded = tok.decode(ids)
    if exact:
        assert decoded == sample
    else:  # WordPiece splits on whitespace and does not keep it
        assert decoded.split() != sample.split() and "".join(decoded.split()) == "".join(sample.split())
    assert tok.unk_token_id not in ids
    if kind == "char":
        assert len(ids) == len(sample) and result["bytes_per_token"] == 1.0
        assert result["vocab_size"] == len(set(TEXT)) + 4  # every character once, plus the specials
    else:
        assert result["bytes_per_token"] > 1.2  # merged pieces compress the held-out text


def test_tokenizer_refuses_a_vocabulary_below_its_alphabet(tmp_path, corpus):
    with pytest.raises(TunebenchError, match="below byte-level BPE's 256 bytes"):
        tokenizer.train([str(corpus)], 100, "bpe", tmp_path / "t", quiet=True)


def test_tokenizer_train_never_silently_replaces_a_directory(tmp_path, corpus):
    """It used to save over whatever --output-dir held; a model trained with the old tokenizer then read text
    with another one."""
    out = tmp_path / "tok"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(TunebenchError, match="already holds files.*--overwrite"):
        tokenizer.train([str(corpus)], 300, "bpe", out, quiet=True)
    assert (out / "notes.txt").read_text() == "mine"
    tokenizer.train([str(corpus)], 300, "bpe", out, quiet=True, overwrite=True)
    assert (out / "tokenizer.json").is_file() and not (out / "notes.txt").exists()


@pytest.mark.parametrize("settings", [
    {},  # GPT-2-style, tied
    {"tie_embeddings": False, "activation": "relu"},
    {"use_learned_pos_emb": False, "activation": "swiglu", "dropout": 0.0, "use_bias": False},
    {"use_learned_pos_emb": False, "activation": "swiglu", "dropout": 0.0, "use_bias": True, "tie_embeddings": False},
])
def test_parameter_count_matches_the_formula(char_tok, settings):
    m = ModelConfig(vocab_size=100, d_model=32, n_heads=4, n_layers=3, d_ff=80, max_seq_len=48, **settings)
    model = arch.build(m, char_tok, seed=0)
    assert sum(p.numel() for p in model.parameters()) == m.parameter_count()
    expected_type = "GPT2LMHeadModel" if m.use_learned_pos_emb else "LlamaForCausalLM"
    assert type(model).__name__ == expected_type and model.training


def test_gelu_is_gpt2s_tanh_form_in_one_kernel(char_tok, monkeypatch):
    """model.activation gelu builds GPT-2's GELU (the tanh form) as torch's fused kernel: the same outputs as
    transformers' five-op "gelu_new", and the probe's cache tells the two apart."""
    m = ModelConfig(vocab_size=100, d_model=32, n_heads=4, n_layers=2, d_ff=80, max_seq_len=48)
    fused = arch.build(m, char_tok, seed=0).eval()  # no dropout
    assert fused.config.activation_function == "gelu_pytorch_tanh"
    key = arch.fingerprint(m)
    monkeypatch.setitem(arch.GPT2_ACTIVATION, "gelu", "gelu_new")
    reference = arch.build(m, char_tok, seed=0).eval()
    assert arch.fingerprint(m) != key
    ids = torch.randint(0, 100, (2, 48), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_gelu_exact_is_the_erf_form_and_is_not_exported_as_gpt2s(char_tok):
    """model.activation gelu_exact builds torch's nn.GELU() (erf; nanoGPT's MLP), a model of its own on record;
    llama.cpp's gpt2 graph computes the tanh form, so the GGUF export refuses it with the fix."""
    from tunebench.model import gguf_export
    m = ModelConfig(vocab_size=100, d_model=32, n_heads=4, n_layers=2, d_ff=80, max_seq_len=48,
                    activation="gelu_exact")
    model = arch.build(m, char_tok, seed=0)
    x = torch.randn(3, 80) * 3
    torch.testing.assert_close(model.transformer.h[0].mlp.act(x), torch.nn.GELU()(x), rtol=0, atol=0)
    assert arch.fingerprint(m) != arch.fingerprint(ModelConfig(**{**m.__dict__, "activation": "gelu"}))
    with pytest.raises(TunebenchError, match=r"tanh form only \(model.activation: gelu\)"):
        gguf_export.check_config(model.config)


@pytest.mark.parametrize("keys,message", [
    ({"model.d_model": 100, "model.n_heads": 3}, "not divisible by model.n_heads 3"),
    ({"model.activation": "swiglu"}, "set use_learned_pos_emb: false"),
    ({"model.use_learned_pos_emb": False}, "set activation: swiglu"),
    ({"model.use_bias": False}, "GPT-2-style layers always have biases"),
    ({"model.pre_norm": False}, "set pre_norm: true"),
    ({"data.max_length": 1024}, "exceeds model.max_seq_len 512"),
    ({"training.bf16": True, "training.fp16": True}, "give one of them"),
    ({"data.pack_sequences": False}, "set pack_sequences: true"),
    ({"training.learning_rat": 1e-3}, "did you mean 'optimizer.lr'"),
    ({"training.batch_size": "auto"}, "needs training.effective_batch_size"),
    ({"model.d_model": 2**40, "model.n_heads": 1}, "GiB per process .* lower model.d_model"),  # was the allocator's
])
def test_bad_settings_are_refused_with_the_fix(keys, message):
    with pytest.raises(TunebenchError, match=message):
        pretrain_config.load(options={"data.train_file": "x.txt", **keys})


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(char_tok):
    with pytest.raises(TunebenchError, match="smaller than the tokenizer's .* set model.vocab_size to at least"):
        arch.check_vocab(ModelConfig(vocab_size=10), char_tok)


def test_use_amp_on_a_cpu_without_bf16_is_an_error_not_fp32():
    from tunebench.machine import hardware
    hw = hardware.Hardware("old cpu", 2, 2, frozenset({"avx2"}), 8000, 8000, "Linux")
    with pytest.raises(TunebenchError, match=r"use_amp: true.*set precision fp32 \(use_amp: false\)"):
        runner.precision_for("amp", "cpu", hw)
    bf16 = hardware.Hardware("new cpu", 2, 2, frozenset({"avx512_bf16"}), 8000, 8000, "Linux")
    assert runner.precision_for("amp", "cpu", bf16) == "bf16"
    slow = dataclasses.replace(bf16, bf16_over_fp32=0.6)  # auto would take fp32 here; amp still means 16-bit
    assert hardware.plan("cpu", "auto", slow).precision == "fp32" and runner.precision_for("amp", "cpu", slow) == "bf16"
    assert TrainingConfig(use_amp=False).precision == "fp32" and TrainingConfig(use_amp=True).precision == "amp"
    assert TrainingConfig(bf16=True).precision == "bf16" and TrainingConfig().precision == "auto"
    assert TrainingConfig(fp16=False).precision == "auto"  # false asks for nothing


@pytest.mark.parametrize("name", pretrain_config.shipped())
def test_every_shipped_pretrain_config_loads_and_validates(name):
    cfg = pretrain_config.load(name, {"data.train_file": "corpus.txt"})
    assert cfg.model.d_model % cfg.model.n_heads == 0 and cfg.data.max_length <= cfg.model.max_seq_len
    assert set(pretrain_config.shipped()) == {"cpu_small_model", "cpu_medium_model", "gpu_model"}
    if name == "cpu_small_model":
        m = cfg.model
        assert (m.vocab_size, m.d_model, m.n_heads, m.n_layers, m.d_ff, m.max_seq_len) == (32000, 256, 4, 4, 1024, 512)
    if name == "cpu_medium_model":
        m = cfg.model
        assert (m.vocab_size, m.d_model, m.n_heads, m.n_layers, m.d_ff, m.max_seq_len) == \
            (50000, 768, 12, 12, 3072, 1024)


def test_token_file_puts_eos_between_documents_and_is_cached(tmp_path, char_tok, monkeypatch):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc", "de", "f")))
    tokens = blocks.token_file([str(docs)], char_tok, tmp_path / "cache")
    eos = char_tok.eos_token_id
    assert np.asarray(tokens).tolist() == [*char_tok("abc")["input_ids"], eos, *char_tok("de")["input_ids"], eos,
                                           *char_tok("f")["input_ids"], eos]
    monkeypatch.setattr(blocks, "_tokenize_to", lambda *a, **k: pytest.fail("re-tokenized a cached corpus"))
    again = blocks.token_file([str(docs)], char_tok, tmp_path / "cache")
    assert np.array_equal(tokens, again) and isinstance(again, np.memmap)


def test_blocks_are_contiguous_and_splits_are_disjoint_and_cover(tmp_path, corpus, char_tok):
    tokens = blocks.token_file([str(corpus)], char_tok, tmp_path / "cache")
    every = blocks.cut(tokens, 64)
    assert len(every) == len(tokens) // 64
    batch = every.collate([0, 3])
    assert torch.equal(batch["input_ids"][1], torch.from_numpy(np.asarray(tokens[192:256]).astype(np.int64)))
    assert torch.equal(batch["labels"], batch["input_ids"]) and bool(batch["attention_mask"].all())
    for mode in ("random", "tail"):
        train, val = blocks.split(every, 0.1, seed=1, mode=mode)
        assert len(val) == round(0.1 * len(every)) and len(train) + len(val) == len(every)
        assert set(train.starts.tolist()).isdisjoint(val.starts.tolist())
    train, val = blocks.split(every, 0.1, seed=1, mode="tail")
    assert val.starts.min() > train.starts.max()  # the corpus's last tenth
    a, _ = blocks.split(every, 0.1, seed=1, mode="random")
    b, _ = blocks.split(every, 0.1, seed=1, mode="random")
    c, _ = blocks.split(every, 0.1, seed=2, mode="random")
    assert np.array_equal(a.starts, b.starts) and not np.array_equal(a.starts, c.starts)


def _config(corpus, tok_dir, out, **training):
    return PretrainConfig(
        ModelConfig(vocab_size=100, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=32, dropout=0.1,
                    attention_dropout=0.0),
        TrainingConfig(**{"batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 6, "learning_rate": 3e-3,
                          "warmup_steps": 1, "checkpoint_dir": str(out), "progress": False, "eval_steps": 3,
                          "save_steps": None, "sample_tokens": 8, "logging_steps": 1, "precision": "fp32",
                          **training}),
        DataConfig(train_file=str(corpus), tokenizer=str(tok_dir), max_length=32, max_eval_blocks=8))


_losses = run_losses


def test_pretrain_resume_after_sigterm_reproduces_losses_and_weights(tmp_path, corpus, char_tok):
    from safetensors.torch import load_file

    tok_dir = tmp_path / "char-tok"
    full = pretrain.run(_config(corpus, tok_dir, tmp_path / "full"))
    expected = _losses(tmp_path / "full")
    assert len(expected) == 6 and full["eval_loss"] < full["eval_loss_before"]
    evals = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
             if "eval_loss" in line]
    assert all(isinstance(r["sample"], str) for r in evals)  # a generation at every eval

    with sigterm_after_step(3), pytest.raises(TunebenchError, match="interrupted at step 3"):
        pretrain.run(_config(corpus, tok_dir, tmp_path / "part"))
    pretrain.run(_config(corpus, tok_dir, tmp_path / "part", resume="auto"))
    assert _losses(tmp_path / "part") == expected
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("full", "part"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pretrained_output_loads_generates_and_fine_tunes(tmp_path, corpus, char_tok):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunebench.jobs import finetune
    from tunebench.settings.finetune import load_config

    pretrain.run(_config(corpus, tmp_path / "char-tok", tmp_path / "pre", max_steps=2))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pre")
    tok = AutoTokenizer.from_pretrained(tmp_path / "pre")
    enc = tok("Line", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert out.shape[1] == enc["input_ids"].shape[1] + 5
    # tunebench's own generate reads the run as transformers does: the same greedy text
    from tunebench.jobs import generate
    expected = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert generate.generate(str(tmp_path / "pre"), None, "Line", 5, 0.0, raw=True, precision="fp32") == expected
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(12)))
    summary = finetune.run(load_config(options={
        "model.name": str(tmp_path / "pre"), "data.path": str(data), "data.max_length": 32, "train.max_steps": 1,
        "data.template": "Q: {instruction}\nA: ",
        "train.micro_batch_size": 2, "train.output_dir": str(tmp_path / "ft"), "train.progress": False}))
    assert summary["steps"] == 1 and (tmp_path / "ft" / "adapter_model.safetensors").is_file()


def test_cli_pretrain_refuses_bad_input_in_one_line(tmp_path, monkeypatch, capsys):
    from tunebench.interfaces.cli import main

    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))
    for args, message in ((["cpu_small_model", "--data", str(tmp_path / "missing.txt")], "data file"),
                          (["no_such_config"], "neither a YAML file nor a shipped config"),
                          (["cpu_small_model", "data.dataset_name=someone/no-such-set"], "pass a local file")):
        assert main(["pretrain", *args, "--output-dir", str(tmp_path / "o")]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1


def test_the_time_to_quality_recipe_is_nanogpts_model_and_batch_and_trains(tmp_path, corpus, char_tok):
    """benchmarks/shakespeare_char.yaml, the recipe vs_nanogpt.py runs: nanoGPT's CPU model (its exact GELU
    included) and batch, with a schedule of its own; it loads and trains (a few steps here)."""
    recipe = Path(__file__).resolve().parents[1] / "benchmarks" / "shakespeare_char.yaml"
    cfg = pretrain_config.load(recipe, {"data.train_file": str(corpus), "data.tokenizer": str(tmp_path / "char-tok"),
                                        "training.max_steps": 3, "training.checkpoint_dir": str(tmp_path / "run"),
                                        "training.progress": False})
    m = cfg.model
    assert (m.n_layers, m.n_heads, m.d_model, m.max_seq_len, m.dropout, m.activation) == (4, 4, 128, 64, 0.0, "gelu_exact")
    assert (cfg.batch.micro_batch_size, cfg.data.max_length, cfg.schedule.schedule, cfg.optimizer.adam_beta2) == \
        (12, 64, "warmup_stable_decay", 0.99)
    summary = pretrain.run(cfg)
    assert summary["steps"] == 3 and summary["eval_loss"] < summary["eval_loss_before"]


def test_the_python_api_page_example_runs(tmp_path, monkeypatch):
    text = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "python-api.md").read_text()
    code = text.split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "corpus.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "python-api.md", "exec"), scope)  # noqa: S102 - the docs' own example
    assert scope["device"] == ("cuda" if torch.cuda.is_available() else "cpu") and scope["summary"]["steps"] == 20
    made = json.loads((tmp_path / "runs" / "api-demo" / "config.json").read_text())  # the model the page asked for
    assert (made["vocab_size"], made["n_layer"], made["n_embd"], made["n_head"], made["n_inner"]) == \
        (300, 2, 64, 4, 256)
    assert isinstance(scope["text"], str) and scope["text"].strip()


def test_cli_tokenizer_train_saves_and_reports(tmp_path, corpus):
    r = subprocess.run([sys.executable, "-m", "tunebench", "tokenizer", "train", "--data", str(corpus), "--vocab-size",
                        "300", "-o", str(tmp_path / "tok")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "bpe tokenizer: vocabulary 300" in r.stdout and "bytes per token" in r.stdout
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    r = subprocess.run([sys.executable, "-m", "tunebench", "tokenizer", "train", "--data", str(tmp_path / "nope.txt"),
                        "--vocab-size", "300", "-o", str(tmp_path / "t2")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name, data, message", [
    ("latin1.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1"), "is not UTF-8 text"),
    ("latin1.csv", "text\ncaf\xe9\n".encode("latin-1"), "is not UTF-8 text"),
    ("open-quote.csv", b'text\n"a quote never closed\nand every row after it\n', "close the quote"),
])
def test_a_pretraining_file_that_cannot_be_read_as_written_is_refused(tmp_path, name, data, message):
    """A non-UTF-8 .jsonl/.csv was a bare UnicodeDecodeError, and a CSV with an unclosed quote silently became
    one giant row."""
    from tunebench.data import text

    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(TunebenchError, match=message):
        list(text.pieces(str(path)))


def test_a_pretraining_run_reports_to_trackio_as_the_guide_spells_it(tmp_path, corpus, char_tok):
    """report_to in the CPU guide's TrainingConfig: Trackio's store holds every step's loss, the run's
    settings with their reasons, the summary, and the model as an artifact."""
    from conftest import needs_module

    needs_module("trackio", "trackio is in the test extra: pip install -e '.[test]'")
    from trackio.sqlite_storage import SQLiteStorage

    out = tmp_path / "pre"
    summary = pretrain.run(_config(corpus, tmp_path / "char-tok", out, max_steps=3, report_to=["trackio"],
                                   run_name="guide-run", project="pretrain-test"))
    logs = SQLiteStorage.get_logs("pretrain-test", "guide-run")
    assert {r["step"]: r["loss"] for r in logs if "loss" in r} == pytest.approx(_losses(out))
    assert [r["summary/tokens_per_s"] for r in logs if "summary/tokens_per_s" in r] == \
        pytest.approx([summary["tokens_per_s"]])
    config = SQLiteStorage.get_run_config("pretrain-test", "guide-run")
    plan = json.loads((out / "plan.json").read_text())
    assert {k: v["reason"] for k, v in config["settings"].items()} == {r["setting"]: r["reason"] for r in plan["decisions"]}
    import trackio

    reader = trackio.init(project="pretrain-test", name="reader", embed=False, auto_log_cpu=False, auto_log_gpu=False)
    model = Path(reader.use_artifact("guide-run-model", type="model").download(str(tmp_path / "fetched")))
    reader.finish()
    assert (model / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
