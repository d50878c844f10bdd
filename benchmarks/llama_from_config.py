"""A Llama-family model of 360M parameters from a config, with random weights and GPT-2's tokenizer, saved to a
directory that `tunebench train --model DIR` and benchmarks/vs_hf_trainer.py read: a GPU-sized model that needs
no download (gpu_session.sh's `llama` step).

    python benchmarks/llama_from_config.py TOKENIZER_DIR OUT_DIR
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokenizer", help="GPT-2's tokenizer directory (vocab.json + merges.txt)")
    p.add_argument("out", help="where the model and tokenizer are saved")
    p.add_argument("--check-args", action="store_true", help=argparse.SUPPRESS)  # gpu_session.sh --dry-run
    args = p.parse_args()
    if args.check_args:
        from harness import check_imports  # benchmarks/harness.py: run as a script, this directory is on the path
        check_imports(__file__)
        return

    from transformers import LlamaConfig, LlamaForCausalLM

    from tunebench.model.models import load_tokenizer  # GPT-2's vocab.json + merges.txt, as tunebench reads them
    tok = load_tokenizer(args.tokenizer)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    print(f"Llama-family model of {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {args.out}")
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)


if __name__ == "__main__":
    main()
