#!/usr/bin/env bash
# What a lent GPU machine (the device tool) runs, from the repository root, most valuable first (a lend can end
# mid-call): `compare --matrix study` on the machine's CPU and its GPU in one report (the study's central table),
# then a GPU that is full (benchmarks/gpu_fill.py: SmolLM2-1.7B's shape at 2,048 tokens, LoRA and full, against
# HF Trainer + PEFT), then the decoding loop against HF generate, then the rest: the `gpu` tests, the HF Trainer +
# PEFT comparison at the study's and GPU-sized settings (gpt2-124m, a 360M Llama from a config) with torch.profiler
# traces of one step of each side. Every step writes to $OUT (logs, JSON, CSV, report); with PACK=FILE.tar.gz the
# whole of $OUT is packed into FILE after each step, so what finished comes back even if the call is cut.
#   bash benchmarks/gpu_session.sh [--dry-run] STEP...
#   STEP: compare fill generation tests memory-tests study gpu-sized llama, or all (that order)
# --dry-run runs on any machine without a GPU: every step's Python imports and arguments are checked (the
# tests are collected, each benchmark parses its arguments, tunebench parses its command line) and nothing
# trains; tests/test_benchmarks.py runs it, so the script is ready the day a GPU is lent.
# Sizes come from the environment: REPEATS (2), SAMPLES (4514), EPOCHS (3; the Llama run takes 1), TEST_WORKERS (4),
# STEPS (compare's optimizer steps per experiment, 20), COMPARE_DEVICE (compare on this device alone: cuda, say,
# where the CPU rows would spend a short lend); LIMIT_<STEP> caps a step's seconds (e.g. LIMIT_COMPARE=240).
# Needs .gpu/ carried beside the checkout: .gpu/site (bitsandbytes, its cuda13x libraries only, and jsonschema
# with its dependencies, unpacked from their wheels: the machine has neither, nor a registry), .gpu/data (GPT-2's
# tokenizer, the Bitext sample, tinyshakespeare and the LLaMA-Factory demo's wiki and C4 texts from
# ../shared/data) and .gpu/smollm2-tokenizer (SmolLM2's tokenizer files).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [[ ${1:-} == --dry-run ]]; then dry=1; shift; fi
export PYTHONPATH="$PWD/src:$PWD/.gpu/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TUNEBENCH_SHARED_DATA=${TUNEBENCH_SHARED_DATA:-$PWD/.gpu/data}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
tok=$TUNEBENCH_SHARED_DATA/gpt2-tokenizer
bitext=$TUNEBENCH_SHARED_DATA/bitext-early-official-4514rows/Bitext_Sample_Customer_Support_Training_Dataset.csv
llama=.gpu/llama-360m
repeats=${REPEATS:-2} samples=${SAMPLES:-4514} epochs=${EPOCHS:-3}

bench() {  # bench SCRIPT LOG ARGS...: a benchmark script, its output kept in $OUT/LOG
  local script=$1 log=$2
  shift 2
  if ((dry)); then python3 "$script" "$@" --check-args || exit 1; return; fi
  python3 "$script" "$@" 2>&1 | tee "$OUT/$log"
}

tunebench() {  # tunebench LOG ARGS...: the command line, parsed only in a dry run
  local log=$1
  shift
  if ((dry)); then
    python3 -c 'import sys; from tunebench.interfaces import cli_parser; cli_parser.build_parser().parse_args(sys.argv[1:])' \
      "$@" || exit 1
    return
  fi
  python3 -m tunebench "$@" 2>&1 | tee "$OUT/$log"
}

step_tests() {
  local pytest=(python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts=-ra --timeout 300)
  if ((dry)); then "${pytest[@]}" --collect-only -q >/dev/null || exit 1; return; fi
  # Tests that fill the GPU's memory run alone, after the others (which share the GPU across workers).
  TUNEBENCH_GPU_ARTIFACTS="$OUT/runs" "${pytest[@]}" -n "${TEST_WORKERS:-4}" -k "not ($memory_tests)" \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
  step_memory_tests
}

memory_tests="backs_off_from_a_real_cuda_oom or falls_back_to_gradient_checkpointing"
step_memory_tests() {  # the two tests that fill the GPU's memory, alone (also part of `tests`)
  local pytest=(python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts=-ra --timeout 300)
  if ((dry)); then "${pytest[@]}" -k "$memory_tests" --collect-only -q >/dev/null || exit 1; return; fi
  TUNEBENCH_GPU_ARTIFACTS="$OUT/runs" "${pytest[@]}" -k "$memory_tests" \
    --junitxml="$OUT/gpu_tests_alone.xml" 2>&1 | tee "$OUT/gpu_tests_alone.log"
}

step_study() {  # the study's settings: max_length 128, LoRA r=8, effective batch 8
  bench benchmarks/vs_hf_trainer.py vs_hf_gpt2_study.log --model gpt2-124m --tokenizer "$tok" --data "$bitext" \
    --repeats "$repeats" --save "$OUT/vs_hf_gpt2_study.json"
}

step_gpu_sized() {  # max_length 512, the micro batch chosen by tunebench's probe, the peer at the same one
  bench benchmarks/vs_hf_trainer.py vs_hf_gpt2_512.log --model gpt2-124m --tokenizer "$tok" --data "$bitext" \
    --max-length 512 --effective-batch 64 --peer-micro same --peer-padding longest --samples "$samples" \
    --epochs "$epochs" --repeats "$repeats" --save "$OUT/vs_hf_gpt2_512.json"
  ((dry)) || mkdir -p "$OUT/trace"  # one optimizer-free step of each side at 1,024 tokens x 8 rows, timed and profiled
  bench benchmarks/vs_hf_trainer.py sweep_gpt2_1024.log --sweep --model gpt2-124m --tokenizer "$tok" \
    --sweep-lengths 1024 --sweep-micros 8 --trace "$OUT/trace/step" --save "$OUT/sweep_gpt2_1024.json"
}

step_llama() {  # a Llama-family model of 360M parameters from a config (random weights: Liger and flash-attn
                # apply), GPT-2's tokenizer, max_length 1024, the probe's micro batch on both sides
  if ((dry)); then python3 benchmarks/llama_from_config.py "$tok" "$llama" --check-args || exit 1
  else python3 benchmarks/llama_from_config.py "$tok" "$llama" || return; fi
  bench benchmarks/vs_hf_trainer.py vs_hf_llama360m_1024.log --model "$llama" --data "$bitext" --max-length 1024 \
    --effective-batch 64 --peer-micro same --peer-padding longest --samples "$samples" --epochs 1 \
    --repeats "$repeats" --save "$OUT/vs_hf_llama360m_1024.json"
  ((dry)) || mkdir -p "$OUT/trace"
  bench benchmarks/vs_hf_trainer.py sweep_llama360m_1024.log --sweep --model "$llama" --sweep-lengths 1024 \
    --sweep-micros 8 --trace "$OUT/trace/step" --save "$OUT/sweep_llama360m_1024.json"
}

step_generation() {  # model/decoding.py's loop against transformers' generate, on the GPU
  bench benchmarks/generation.py generation.log --model gpt2-124m --tokenizer "$tok" --no-llama-cpp \
    --repeats "$repeats"
}

step_compare() {  # the study's CPU and GPU configurations in one report, with the CPU-vs-GPU speedups
  if ((!dry)); then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
    python3 -c "import torch, transformers, peft, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__, '| bitsandbytes', bitsandbytes.__version__)" | tee "$OUT/versions.txt"
  fi
  tunebench hw.txt hw
  tunebench compare.log compare --matrix study --model gpt2-124m --tokenizer "$tok" --data "$bitext" \
    --max-samples 400 --max-steps "${STEPS:-20}" --output "$OUT/compare/results.csv" \
    ${COMPARE_DEVICE:+--device "$COMPARE_DEVICE"}
}

step_fill() {  # SmolLM2-1.7B's shape from a config, 2,048 tokens a row, LoRA and full, against HF Trainer + PEFT
  bench benchmarks/gpu_fill.py fill.log --tokenizer .gpu/smollm2-tokenizer --out "$OUT/fill" --models /tmp/fill-models
}

pack() {  # $OUT packed into $PACK (weights left out), replaced whole so that a cut call leaves the last one
  [[ -n ${PACK:-} ]] && ((!dry)) || return 0
  tar czf "$PACK.part" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude='*.pth' --exclude=tokenizer.json \
    --exclude='*.gguf' -C "$OUT" . && mv "$PACK.part" "$PACK"
}

all=(compare fill generation tests study gpu-sized llama)
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(compare)
[[ ${steps[*]} == all ]] && steps=("${all[@]}")
for s in "${steps[@]}"; do
  case $s in
    compare|fill|generation|tests|memory-tests|study|gpu-sized|llama)
      echo "== $s $(date -u +%H:%M:%S)"
      var=LIMIT_$(tr 'a-z-' 'A-Z_' <<<"$s"); limit=${!var:-}
      if [[ -n $limit ]] && ((!dry)); then
        export -f "step_${s//-/_}" bench tunebench step_memory_tests
        export dry tok bitext llama repeats samples epochs memory_tests
        timeout --signal=TERM --kill-after=15 "$limit" bash -c "step_${s//-/_}" || echo "== $s ended with $? (limit ${limit} s)"
      else
        "step_${s//-/_}"
      fi
      pack ;;
    *) echo "gpu_session.sh: unknown step '$s'; the steps are ${all[*]}, memory-tests, or all" >&2
       exit 2 ;;
  esac
done
echo "== end $(date -u +%H:%M:%S)"
pack
