"""Every precision path on whatever CPU runs the suite. The precision is forced, never left to the machine:
a CPU without native bf16 (or fp16) runs it emulated, which costs little on the tiny model, so the bf16 and
fp16 paths (16-bit autocast, fp32 adapters over a 16-bit base, fp16's GradScaler) run on every machine, not
only on the ones that would pick them. Each trained run is made once per precision and shared by the checks
that read it: answers at the end of training, eval, generate, chat, serve, merge and export."""

import json

import pytest
import torch

from conftest import ROWS, pairs_file, tiny_run_config
from tunebench.interfaces.web import models as served
from tunebench.jobs import evaluate, export, finetune, generate, merge, pretrain
from tunebench.jobs.parts import finetune_model
from tunebench.model import inference
from tunebench.settings.finetune import DataConfig

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ASKED = 3  # held-out rows answered at the end of each run


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(scope="module")
def base(data, tmp_path_factory):
    """A tiny Llama-style model pretrained for two steps on a byte-level BPE tokenizer (GGUF needs merges,
    which the `tiny` preset's byte tokenizer lacks): the base every run of the matrix fine-tunes."""
    from tunebench.data import tokenizer_training as tokenizer
    from tunebench.settings.pretrain import DataConfig as PDataConfig
    from tunebench.settings.pretrain import ModelConfig, PretrainConfig, TrainingConfig

    root = tmp_path_factory.mktemp("base")
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(f"{r['instruction']} {r['response']}" for r in ROWS) * 20)
    tokenizer.train([str(corpus)], 300, "bpe", root / "tok", quiet=True)
    pretrain.run(PretrainConfig(
        ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=64, dropout=0.0,
                    attention_dropout=0.0, activation="swiglu", use_learned_pos_emb=False, use_bias=False),
        TrainingConfig(batch_size=4, gradient_accumulation_steps=1, max_steps=2, checkpoint_dir=str(root / "model"),
                       progress=False, eval_steps=100, save_steps=None, precision="fp32"),
        PDataConfig(train_file=str(corpus), tokenizer=str(root / "tok"), max_length=64, max_eval_blocks=2)))
    return root / "model"


@pytest.fixture(scope="module", params=PRECISIONS)
def lora_run(request, data, base, tmp_path_factory):
    """(precision, run directory, summary) of a LoRA run forced to that precision, answering its held-out rows."""
    out = tmp_path_factory.mktemp(f"lora-{request.param}") / "run"
    summary = finetune.run(tiny_run_config(data, out, **{
        "model.name": str(base), "data.max_length": 64, "train.precision": request.param,
        "train.eval_generate": ASKED, "train.eval_max_new_tokens": 6, "data.eval_fraction": 0.25}))
    return request.param, out, summary


def _answers(path):
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


def test_training_answers_its_held_out_rows_in_its_own_precision(lora_run):
    """The cause of the bf16 CPU failures: generation after 16-bit training met a 16-bit base and fp32 adapters
    outside autocast. The run's own answers come out, in the precision it was asked for."""
    precision, out, summary = lora_run
    assert summary["precision"] == precision
    rows = {d["setting"]: d for d in json.loads((out / "plan.json").read_text())["decisions"]}
    assert rows["precision"]["value"] == precision and rows["precision"]["reason"].startswith("asked for")
    assert rows["pad_to_multiple_of"]["value"] == (16 if precision == "bf16" else 1)  # a CPU's bf16: fewer lengths
    answers = _answers(out / "eval_answers.jsonl")
    assert len(answers) == ASKED and all(a["tokens"] >= 1 for a in answers)
    assert {a["reference"] for a in answers} <= {r["response"] for r in ROWS}
    assert isinstance(summary["rougeL"], float) and summary["gen_tokens_per_s"] > 0


def test_a_saved_run_loads_as_it_trained_and_eval_gives_the_runs_own_answers(lora_run, data, tmp_path):
    """Reloaded through the one inference path (base in the compute dtype, adapters fp32, autocast), a run
    reproduces what it said at its end: the same greedy answers to the same held-out rows, and its eval loss."""
    precision, out, summary = lora_run
    placed = inference.load(None, str(out), precision=precision)
    dtypes = {name: p.dtype for name, p in placed.model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {DTYPE[precision]}
    assert placed.autocast_dtype == (None if precision == "fp32" else DTYPE[precision])

    result = evaluate.run(None, str(out), DataConfig(path=str(data), max_length=64), where=evaluate.Placement(precision=precision),
                          generate=ASKED, max_new_tokens=6, answers=tmp_path / "answers.jsonl")
    assert result["precision"] == precision and result["generated"] == ASKED
    assert [a["answer"] for a in _answers(tmp_path / "answers.jsonl")] == \
        [a["answer"] for a in _answers(out / "eval_answers.jsonl")]
    assert result["rougeL"] == summary["rougeL"]


def test_generate_chat_and_serve_answer_alike_in_each_precision(lora_run, monkeypatch, capsys):
    """One prompt, greedy, through `generate`, `chat` and serve's streamed generation: the same reply."""
    precision, out, _ = lora_run
    said = generate.generate(None, str(out), "hi", 6, 0.0, raw=False, precision=precision)
    lines = iter(["hi", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    generate.chat(None, str(out), 6, 0.0, precision=precision)
    assert f"bot> {said}\n" in capsys.readouterr().out

    registry = served.Registry(served.entries([], [str(out)]), precision=precision)
    assert registry.precision == precision
    *_, done = served.stream(registry, registry.labels[0], [{"role": "user", "content": "hi"}], max_new_tokens=6,
                             temperature=0.0)
    assert done.done and done.text == said and 1 <= done.new_tokens <= 6


def test_merge_and_export_a_run_of_each_precision(lora_run, tmp_path):
    """The merged model generates in the run's precision; GGUF and HF exports pass their read-back check
    (export refuses a file whose logits disagree with the merged model)."""
    precision, out, _ = lora_run
    merged = merge.merge(str(out), str(tmp_path / "merged"))
    placed = inference.load(str(merged), None, precision=precision)
    assert {p.dtype for p in placed.model.parameters()} == {DTYPE[precision]}
    said = generate.complete(placed, [{"role": "user", "content": "hi"}], 4)
    if precision == "fp32":  # merged == unmerged: the adapter's own answer (16-bit rounds W + BA once more)
        assert said == generate.complete(inference.load(None, str(out), precision="fp32"),
                                         [{"role": "user", "content": "hi"}], 4)
    gguf = export.export(str(out), "gguf", "f16", str(tmp_path / "run.gguf"))
    assert gguf.stat().st_size > 0
    hf = export.export(str(out), "hf", None, str(tmp_path / "hf"))
    assert (hf / "model.safetensors").is_file()


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_dpo_and_orpo_answer_their_held_out_pairs(tmp_path, objective, precision):
    """A preference run answers its held-out pairs' prompts at its end, scored against the chosen reply."""
    pairs = pairs_file(tmp_path)
    chosen = {json.loads(line)["chosen"] for line in pairs.read_text().splitlines()}
    out = tmp_path / "run"
    summary = finetune.run(tiny_run_config(pairs, out, **{
        "train.objective": objective, "train.precision": precision, "train.eval_generate": 2,
        "train.eval_max_new_tokens": 4, "train.max_steps": 2, "train.effective_batch_size": 2,
        "train.micro_batch_size": 1, "data.eval_fraction": 0.34}))
    assert summary["precision"] == precision and summary["objective"] == objective
    answers = _answers(out / "eval_answers.jsonl")
    assert len(answers) == 2 and {a["reference"] for a in answers} <= chosen
    assert isinstance(summary["rougeL"], float) and "eval_rewards/accuracies" in summary
    rows = {d["setting"]: d["value"] for d in json.loads((out / "plan.json").read_text())["decisions"]}
    assert rows["pad_to_multiple_of"] == (16 if precision == "bf16" else 1)  # a pair's rows as a row's


@pytest.mark.parametrize("method, precision", [("lora", "bf16"), ("dora", "bf16"), ("full", "bf16"),
                                               ("qlora", "bf16"), ("qlora", "fp16"), ("qlora", "fp32")])
def test_the_probe_the_steps_and_the_answers_run_under_one_autocast(tmp_path, data, monkeypatch, method, precision):
    """One autocast, decided once: every forward pass of a run (the probe that picks the micro batch, each
    training step, the evaluations, the end-of-run answers) runs under the run's precision's autocast. QLoRA's
    probe and answers ran without it while its steps ran with it, so the probe timed, and the answers scored,
    another computation than the one trained."""
    if method == "qlora":
        from conftest import needs_module

        needs_module("bitsandbytes", "QLoRA needs bitsandbytes (a core dependency)")
    seen = []
    built = finetune_model.build_model

    def watched(*args, **kwargs):
        made = built(*args, **kwargs)
        layer = next(m for name, m in made[0].named_modules() if name.endswith("self_attn"))
        layer.register_forward_pre_hook(lambda module, inputs: seen.append(
            torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None))
        return made

    monkeypatch.setattr(finetune_model, "build_model", watched)
    out = tmp_path / "run"
    summary = finetune.run(tiny_run_config(data, out, **{
        "adapter.method": method, "train.precision": precision, "train.eval_generate": 2,
        "train.eval_max_new_tokens": 4, "train.max_steps": 2, "data.eval_fraction": 0.25,
        **({"adapter.quantization": "4bit"} if method == "qlora" else {})}))
    assert summary["precision"] == precision and len(_answers(out / "eval_answers.jsonl")) == 2
    # at least the probe's step, two training steps, two evaluations and a prefill per answer (an answer may end at
    # EOS, and the decoding loop runs no forward after its last token): 10 in a bf16 LoRA run, 2026-11-27
    assert len(seen) >= 7 and set(seen) == {None if precision == "fp32" else DTYPE[precision]}, set(seen)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_pretraining_samples_at_each_eval_in_each_precision(tmp_path, precision):
    from tunebench.data import tokenizer_training as tokenizer
    from tunebench.settings.pretrain import DataConfig as PDataConfig
    from tunebench.settings.pretrain import ModelConfig, PretrainConfig, TrainingConfig

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    tokenizer.train([str(corpus)], 60, "char", tmp_path / "tok", quiet=True)
    cfg = PretrainConfig(
        ModelConfig(vocab_size=60, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=32),
        TrainingConfig(batch_size=2, gradient_accumulation_steps=1, max_steps=2, checkpoint_dir=str(tmp_path / "out"),
                       progress=False, eval_steps=2, save_steps=None, sample_tokens=6, precision=precision),
        PDataConfig(train_file=str(corpus), tokenizer=str(tmp_path / "tok"), max_length=32, max_eval_blocks=4))
    summary = pretrain.run(cfg)
    assert summary["precision"] == precision
    assert isinstance(summary["sample"], str) and summary["sample"]
