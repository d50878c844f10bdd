"""The model both experiments here time: SmolLM2-135M-Instruct (tunebench's converted copy) with LoRA r8 on q/v, fp32,
in train mode, on 2 threads."""
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

PATH = "/root/.cache/tunebench/models/smollm2-135m-instruct-c2"


def load():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    m = get_peft_model(AutoModelForCausalLM.from_pretrained(PATH, torch_dtype=torch.float32),
                       LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    m.train()
    return m
