"""PEFT methods beyond LoRA (`--method dora|ia3|loha|lokr|prefix|prompt`): each trains the tiny model, saves
in PEFT's format, and plain PEFT reloads it to the same logits; the weight methods merge."""

import json
import math

import pytest
import torch

from conftest import tiny_run_config
from tunebench.core.errors import TunebenchError
from tunebench.jobs import finetune
from tunebench.jobs.parts import finetune_model
from tunebench.model import inference, models
from tunebench.settings.finetune import load_config

METHODS = ["dora", "ia3", "loha", "lokr", "prefix", "prompt"]
IDS = torch.tensor([[5, 17, 42, 7, 99, 3, 64, 12]])


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return logits[:, -IDS.shape[1]:].float()  # prompt tuning's virtual tokens come first


@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains_saves_and_reloads_in_plain_peft_to_the_same_logits(tmp_path, dataset, monkeypatch, method):
    from peft import PeftModel

    trained = {}
    save = finetune_model.save_final

    def keep_logits(model, *args, **kwargs):  # the in-memory model at the end of training, before it is saved
        trained["logits"] = _logits(model)
        trained["trainable"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return save(model, *args, **kwargs)

    monkeypatch.setattr(finetune_model, "save_final", keep_logits)
    out = tmp_path / method
    summary = finetune.run(tiny_run_config(dataset, out, **{
        "adapter.method": method, "adapter.num_virtual_tokens": 4, "train.precision": "fp32", "train.max_steps": 3}))
    assert summary["method"] == method and summary["steps"] == 3
    assert summary["eval_loss"] != summary["eval_loss_before"]  # the adapter learned something
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == {"dora": "LORA", "prefix": "PREFIX_TUNING", "prompt": "PROMPT_TUNING"}.get(
        method, method.upper())
    assert config.get("use_dora", False) is (method == "dora")

    reloaded = PeftModel.from_pretrained(models.resolve("tiny").model, str(out))
    assert torch.allclose(_logits(reloaded), trained["logits"], rtol=1e-4, atol=1e-5)
    base = _logits(models.resolve("tiny").model)
    assert not torch.allclose(base, trained["logits"], atol=1e-4)  # the adapter changes the output
    assert 0 < summary["trainable_parameters"] < sum(p.numel() for p in models.resolve("tiny").model.parameters())


@pytest.mark.parametrize("method", ["dora", "ia3", "loha", "lokr"])
def test_weight_methods_merge_into_the_base(tmp_path, dataset, method):
    from tunebench.jobs.merge import merge

    out = tmp_path / method
    finetune.run(tiny_run_config(dataset, out, **{"adapter.method": method, "train.precision": "fp32",
                                                   "train.max_steps": 2}))
    adapted = _logits(inference.load_for_inference(None, str(out)).model)
    merged = merge(str(out), str(tmp_path / "merged"))
    from transformers import AutoModelForCausalLM

    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(merged)), adapted, rtol=1e-4, atol=1e-4)


def test_prompt_methods_refuse_to_merge_and_to_pack(tmp_path, dataset):
    from tunebench.jobs.merge import merge

    out = tmp_path / "prefix"
    finetune.run(tiny_run_config(dataset, out, **{"adapter.method": "prefix", "train.max_steps": 1}))
    with pytest.raises(TunebenchError, match="virtual tokens, no weights to fold"):
        merge(str(out), str(tmp_path / "merged"))
    assert not (tmp_path / "merged").exists()
    with pytest.raises(TunebenchError, match="cannot train on packed rows"):
        load_config(options={"adapter.method": "prompt", "data.packing": "on"})
    plan = json.loads((out / "plan.json").read_text())
    layout = next(d for d in plan["decisions"] if d["setting"] == "batch layout")
    assert layout["value"] != "packed" and "not packed" in layout["reason"]


def test_prompt_tuning_starts_from_the_init_texts_embeddings(tmp_path, dataset, tiny):
    from peft import PeftModel

    text = "help the customer"
    out = tmp_path / "prompt"
    finetune.run(tiny_run_config(dataset, out, **{"adapter.method": "prompt", "adapter.num_virtual_tokens": 5,
                                                   "adapter.prompt_init_text": text, "train.lr": 1e-9,
                                                   "train.max_steps": 1, "train.precision": "fp32"}))
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * 5)[:5]
    expected = tiny.model.get_input_embeddings().weight[ids]
    reloaded = PeftModel.from_pretrained(models.resolve("tiny").model, str(out))
    start = reloaded.prompt_encoder["default"].embedding.weight
    assert torch.allclose(start, expected, atol=1e-6)


def test_quantization_belongs_to_qlora_only():
    with pytest.raises(TunebenchError, match="QLoRA's: use --method qlora"):
        load_config(options={"adapter.method": "dora", "adapter.quantization": "4bit"})
    with pytest.raises(TunebenchError, match="not one of"):
        load_config(options={"adapter.method": "adalora"})


@pytest.mark.usefixtures("children_in_process")
def test_the_shipped_methods_matrix_runs_and_reports(tmp_path, dataset):
    """Every method of `tunebench compare --matrix methods` trains (the tiny model stands in for SmolLM2),
    on the same rows and steps, and the report shows each method's trainable parameters."""
    import csv

    from tunebench.jobs import compare, report

    out = tmp_path / "methods.csv"
    compare.run("methods", str(out), str(tmp_path / "runs"), 1, {
        "model.name": "tiny", "data.path": str(dataset), "data.max_length": 256, "data.max_samples": None,
        "train.max_steps": 2, "train.effective_batch_size": 4, "train.micro_batch_size": 2})
    with open(out, newline="") as f:
        rows = {r["experiment"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"lora", "dora", "loha", "lokr", "ia3", "prefix", "prompt"}
    assert all(r["status"] == "ok" for r in rows.values()), {k: r["message"] for k, r in rows.items()}
    assert {r["method"] for r in rows.values()} == set(rows)
    assert len({r["samples"] for r in rows.values()}) == 1 and {r["steps"] for r in rows.values()} == {"2"}
    params = {k: int(r["trainable_params"]) for k, r in rows.items()}
    assert params["ia3"] < params["lora"] < params["dora"]  # IA3 scales vectors; DoRA adds magnitudes to LoRA
    assert params["prompt"] == 20 * models.resolve("tiny").model.config.hidden_size  # 20 virtual token embeddings
    report.write([str(out)], str(tmp_path / "report"))
    assert f"{params['dora']:,}" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize("method", ["prefix", "prompt", "ia3"])
def test_generate_and_eval_load_each_methods_adapter(tmp_path, dataset, method):
    from tunebench.jobs import evaluate, generate

    out = tmp_path / method
    finetune.run(tiny_run_config(dataset, out, **{"adapter.method": method, "adapter.num_virtual_tokens": 4,
                                                   "train.precision": "fp32", "train.max_steps": 1}))
    # A broken prefix/prompt path raises inside generate (virtual tokens, past key values); what a random
    # tiny model says (possibly only special tokens, decoded to '') is not the point.
    text = generate.generate(None, str(out), "hi", 4, 0.0, raw=True, precision="fp32")
    # the same greedy tokens as PEFT's own loading of the adapter onto the base gives
    from peft import PeftModel
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    reference = PeftModel.from_pretrained(models.resolve("tiny").model, str(out)).eval()
    enc = tok("hi", return_tensors="pt")
    ids = reference.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    assert text == tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    # and token for token (the text alone can be '' on both sides: special tokens decode to nothing)
    placed = inference.load(None, str(out), precision="fp32")
    ours = placed.decode(enc["input_ids"], enc["attention_mask"], 4, None)
    assert ours[0].tolist() == ids[0, enc["input_ids"].shape[1]:].tolist() and len(ours[0]) > 0
    data = load_config(options={"data.path": str(dataset), "data.max_length": 256}).data
    scored = evaluate.run(None, str(out), data, 4, where=evaluate.Placement(precision="fp32"))
    base = evaluate.run("tiny", None, data, 4, where=evaluate.Placement(precision="fp32"))
    # a random tiny model after one step guesses near uniformly over its vocabulary: the loss is about ln(V)
    vocab = models.resolve("tiny").model.config.vocab_size
    assert scored["eval_loss"] == pytest.approx(math.log(vocab), abs=0.5)
    assert scored["eval_loss"] != pytest.approx(base["eval_loss"], abs=1e-6)  # the adapter is applied
