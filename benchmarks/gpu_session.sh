#!/usr/bin/env bash
# What a lent GPU machine (the device tool) runs, from the repository root: the `gpu` tests, then
# the HF Trainer + PEFT comparison on the gpt2-124m preset and on a Llama-family model built from a
# config. Logs, the tests' JUnit XML, each test run's records (plan.json, summary.json, monitor.jsonl,
# metrics.jsonl) and the benchmarks' raw JSON go to $OUT; copy them to benchmarks/gpu-<GPU>-<date>/.
#   bash benchmarks/gpu_session.sh tests|study|gpu-sized|llama
# Needs .gpu/ carried beside the checkout: .gpu/site (bitsandbytes, unpacked from its wheel: the
# machine has no registry) and .gpu/data (GPT-2's tokenizer and the Bitext sample from ../shared/data).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD/.gpu/site" PYTHONUNBUFFERED=1 TUNEBENCH_SHARED_DATA="$PWD/.gpu/data" \
       HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
tok=.gpu/data/gpt2-tokenizer
case ${1:-tests} in
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, transformers, peft, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__, '| bitsandbytes', bitsandbytes.__version__)"
    python3 -m tunebench hw 2>&1 | tee "$OUT/hw.txt"
    TUNEBENCH_GPU_ARTIFACTS="$OUT/runs" python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider \
      -o addopts="-ra" --timeout 300 --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
  study)  # the study's settings: max_length 128, LoRA r=8, effective batch 8
    python3 benchmarks/vs_hf_trainer.py --model gpt2-124m --tokenizer $tok --repeats 2 \
      --save "$OUT/vs_hf_gpt2_study.json" 2>&1 | tee "$OUT/vs_hf_gpt2_study.log"
    ;;
  gpu-sized)  # max_length 512, the micro batch chosen by tunebench's probe, the peer at the same one
    python3 benchmarks/vs_hf_trainer.py --model gpt2-124m --tokenizer $tok --max-length 512 --effective-batch 64 \
      --peer-micro same --peer-padding longest --samples 4514 --epochs 3 --repeats 2 \
      --save "$OUT/vs_hf_gpt2_512.json" 2>&1 | tee "$OUT/vs_hf_gpt2_512.log"
    ;;
  llama)  # a Llama-family model of 360M parameters from a config (random weights: Liger and flash-attn
          # apply), GPT-2's tokenizer, max_length 1024, the probe's micro batch on both sides
    python3 - "$tok" .gpu/llama-350m <<'PY'
import sys
from transformers import LlamaConfig, LlamaForCausalLM
from tunebench.models import load_tokenizer  # GPT-2's vocab.json + merges.txt, as tunebench reads them
tok = load_tokenizer(sys.argv[1])
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[2])
tok.save_pretrained(sys.argv[2])
PY
    python3 benchmarks/vs_hf_trainer.py --model .gpu/llama-350m --max-length 1024 --effective-batch 64 \
      --peer-micro same --peer-padding longest --samples 4514 --epochs 1 --repeats 2 \
      --save "$OUT/vs_hf_llama350m_1024.json" 2>&1 | tee "$OUT/vs_hf_llama350m_1024.log"
    ;;
esac
