"""The model families people fine-tune (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3), each a
tiny model built from its transformers config with random weights: every method trains on each, LoRA
targets each one's projections, and attention is measured only among the kernels its architecture has."""

import json

import pytest
import torch

from conftest import tiny_run_config
from tunebench.core.errors import TunebenchError
from tunebench.jobs import finetune
from tunebench.model import methods, models

COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512}
FAMILIES = {"llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": 16},
            "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16},
            "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16}, "phi3": {}}
TARGETS = {"phi3": "qkv_proj"}  # Phi-3 fuses q, k and v; every other family here: q_proj,v_proj
NO_SDPA = {"gemma2"}  # soft-capped attention logits: eager (and flex) only in transformers


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """One HF directory per family: its config at a tiny size, seeded random weights, the byte tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    tok = models.byte_tokenizer()
    ids = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id}
    for family, extra in FAMILIES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **COMMON, **extra, **ids))
        model.save_pretrained(root / family)
        tok.save_pretrained(root / family)
    return root


def _plan(out):
    return {d["setting"]: d for d in json.loads((out / "plan.json").read_text())["decisions"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_each_familys_projections_on_an_attention_kernel_it_has(family_dirs, family, dataset, tmp_path):
    from peft import PeftModel

    out = tmp_path / family
    summary = finetune.run(tiny_run_config(dataset, out, **{
        "model.name": str(family_dirs / family), "train.max_steps": 3, "train.precision": "fp32",
        "data.max_length": 64, "hardware.attention": "auto"}))
    plan = _plan(out)
    assert plan["target_modules"]["value"] == TARGETS.get(family, "q_proj,v_proj")
    measured = plan["attention"]["reason"]
    if family in NO_SDPA:
        assert plan["attention"]["value"] == "eager" and "sdpa" not in measured and "tunebench" not in measured
    else:
        assert "(sdpa)" in measured and "(eager)" in measured
    assert summary["steps"] == 3 and summary["eval_loss"] < summary["eval_loss_before"]
    loaded = PeftModel.from_pretrained(models.resolve(str(family_dirs / family)).model, str(out))  # standard PEFT
    assert sum(p.numel() for n, p in loaded.named_parameters() if "lora_" in n) == summary["trainable_parameters"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_trains_every_family(family_dirs, family, dataset, tmp_path):
    """Each method takes one step on each family (eager attention, a fixed micro batch: nothing measured)."""
    for method in ("dora", "ia3", "loha", "lokr", "prefix", "prompt", "full", "qlora"):
        extra = {"adapter.quantization": "4bit"} if method == "qlora" else {}
        summary = finetune.run(tiny_run_config(dataset, tmp_path / method, **{
            "model.name": str(family_dirs / family), "train.max_steps": 1, "train.precision": "fp32",
            "data.max_length": 64, "hardware.attention": "eager", "adapter.method": method,
            "adapter.num_virtual_tokens": 4, "train.eval_steps": None, **extra}))
        assert summary["steps"] == 1 and summary["trainable_parameters"] > 0, method
        assert 0 < summary["final_train_loss"] < 2 * torch.log(torch.tensor(300.0)).item(), method


def test_an_attention_kernel_the_architecture_lacks_is_refused_in_one_line(family_dirs):
    from tunebench.training.autotune import attention

    gemma2 = models.resolve(str(family_dirs / "gemma2")).model
    assert attention.candidates(torch.device("cpu"), "fp32", gemma2) == ("eager",)
    with pytest.raises(TunebenchError, match="--attention sdpa cannot run here: Gemma2ForCausalLM has no sdpa "
                                             "attention in transformers; use --attention auto"):
        attention.pick(gemma2, "sdpa", lambda: 1.0, None, candidates=attention.candidates(torch.device("cpu"),
                                                                                           "fp32", gemma2))
    phi3 = models.resolve(str(family_dirs / "phi3")).model
    assert methods.target_modules(phi3, "auto")[0] == ["qkv_proj"]


def test_ia3_on_a_type_peft_does_not_list_takes_its_attention_and_feed_forward_output(family_dirs):
    phi3 = models.resolve(str(family_dirs / "phi3")).model
    targets, feedforward, why = methods.ia3_modules(phi3, None)
    assert targets == ["qkv_proj", "down_proj"] and feedforward == ["down_proj"] and "PEFT has no IA3" in why
    llama = models.resolve(str(family_dirs / "llama")).model
    assert methods.ia3_modules(llama, None)[:2] == (["k_proj", "v_proj", "down_proj"], ["down_proj"])  # PEFT's
