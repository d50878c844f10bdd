#!/usr/bin/env bash
# the compiled memory factor in bf16 (issue 95), as benchmarks/memory-compiled-avx2-2026-12-03/peak.py measures it
cd /work/main
for args in "lora bf16 q_proj,v_proj eager 4 733" "lora bf16 q_proj,v_proj compile 4 733" \
            "lora bf16 q_proj,v_proj,k_proj,o_proj,gate_proj,up_proj,down_proj eager 4 512" \
            "lora bf16 q_proj,v_proj,k_proj,o_proj,gate_proj,up_proj,down_proj compile 4 512"; do
  .venv/bin/python benchmarks/memory-compiled-avx2-2026-12-03/peak.py $args 2>&1 | grep " step "
done
