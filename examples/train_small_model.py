"""The CPU training guide's examples/train_small_model.py, on tunebench: a complete pipeline on the
machine you have. tokenizer -> pretrain a small model from scratch -> fine-tune it with LoRA -> generate.

    python examples/train_small_model.py --corpus my_text.txt --output-dir ./output/small
    python examples/train_small_model.py --steps 20        # a quick look, on the built-in text

The configs are the guide's (ModelConfig, TrainingConfig, DataConfig, device="auto"); every setting the
run picks is printed with its reason.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import tunebench
from tunebench import DataConfig, ModelConfig, TrainingConfig

BUILTIN = Path(tunebench.__file__).parent / "data" / "sample" / "customer_support.jsonl"


def corpus_from_builtin(path: Path) -> Path:
    """Plain text from tunebench's built-in customer-support rows, for a run without a corpus of its own."""
    rows = [json.loads(line) for line in BUILTIN.read_text().splitlines() if line.strip()]
    path.write_text("\n\n".join(f"{r['instruction']}\n{r['response']}" for r in rows) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=None, help="plain-text training data (default: the built-in rows as text)")
    parser.add_argument("--output-dir", "--output_dir", default="output/small_model")
    parser.add_argument("--steps", type=int, default=200, help="pretraining steps (fine-tuning runs a quarter)")
    parser.add_argument("--device", default="auto", help="auto (a GPU when present) | cpu | cuda | mps")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus) if args.corpus else corpus_from_builtin(out / "corpus.txt")

    # 1. A byte-level BPE tokenizer trained on the corpus.
    tok = tunebench.train_tokenizer([str(corpus)], vocab_size=1000, output_dir=out / "tokenizer")
    print(f"tokenizer: {tok}")

    # 2. Pretraining from scratch, in the guide's configuration style.
    model_config = ModelConfig(vocab_size=1000, d_model=128, n_heads=4, n_layers=2, d_ff=512, max_seq_len=128,
                               dropout=0.0, attention_dropout=0.0, gradient_checkpointing=False)
    training_config = TrainingConfig(device=args.device, batch_size=8, learning_rate=1e-3, max_steps=args.steps,
                                     warmup_steps=max(1, args.steps // 20), eval_steps=0.5, save_steps=None,
                                     logging_steps=10, checkpoint_dir=str(out / "pretrained"), overwrite=True)
    print(f"device: {training_config.get_effective_device()}")
    data_config = DataConfig(train_file=str(corpus), tokenizer=str(out / "tokenizer"), max_length=128)
    summary = tunebench.pretrain(model_config, training_config, data_config)
    print(f"pretrained: eval loss {summary['eval_loss']:.3f}, {summary['tokens_per_s']:,.0f} tokens/s")

    # 3. LoRA fine-tuning of that model on instruction rows (the built-in customer-support set).
    tuned = tunebench.finetune(model__name=str(out / "pretrained"), data__path=str(BUILTIN), data__max_length=128,
                               train__max_steps=max(1, args.steps // 4), train__output_dir=str(out / "lora"),
                               train__overwrite=True, train__device=args.device)
    print(f"fine-tuned: eval loss {tuned['eval_loss']:.3f}")

    # 4. Generation from both.
    print("pretrained says:", tunebench.generate(str(out / "pretrained"), "I want to cancel my order", 24))
    print("fine-tuned says:", tunebench.generate(str(out / "pretrained"), "I want to cancel my order", 24,
                                                 adapter=str(out / "lora")))


if __name__ == "__main__":
    main()
