"""`tunebench export RUN_DIR`: a training run's model, its adapter merged in, as a GGUF file (llama.cpp),
an Ollama model (GGUF + Modelfile) or a merged Hugging Face directory (transformers, vLLM).

refuse bad input (nothing loaded, nothing written) -> load and merge -> write beside the target ->
read the file back with an independent reader and compare logits -> move it into place -> report.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tunebench.core.durable import atomic_dir, atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.data import toolcalls
from tunebench.data.tokenize import DEFAULT_PROMPT
from tunebench.jobs import quant_auto
from tunebench.jobs.generate import trained_template
from tunebench.model import gguf_export, inference, llama_cpp_tools, models
from tunebench.settings.rundir import RunDir
from tunebench.settings.schema import EXPORT_FORMATS

HF_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# Held-out prompts for the logit check: none is in the built-in data, and they cover digits, code, and
# text outside ASCII, where tokenizers and quantization go wrong first.
CHECK_PROMPTS = ("How do I cancel order 84213 and get a refund?", "Write a Python function that reverses a list.",
                 "Résumé: 3 ans d'expérience, à Zürich.", "The capital of France is")
# Top-1 agreement the read-back must reach, per tensor type; the quantized ones follow llama.cpp's own
# perplexity tables: 8-bit is near lossless, 4- and 5-bit change some near-tied choices.
MIN_AGREEMENT = {"f32": 1.0, "f16": 0.97, "bf16": 0.9, "q8_0": 0.9, "q5_1": 0.75, "q5_0": 0.75, "q4_1": 0.6,
                 "q4_0": 0.6, "q6_k": 0.9, "q5_k_m": 0.75, "q5_k_s": 0.75, "q4_k_m": 0.6, "q4_k_s": 0.6,
                 "q3_k_m": 0.5, "q2_k": 0.3}
F32_MAX_DIFF = 1e-3  # f32 stores the weights as they are: only summation order differs


@dataclass(frozen=True)
class Source:
    run_dir: Path
    adapter: bool  # a PEFT adapter over a base model; else a full model directory
    base: str  # the spec the weights load from (the base model for an adapter)


def export(run_dir: str, fmt: str = "gguf", quant: str | None = None, output: str | None = None,
           allow_download: bool = False, auto: quant_auto.Settings = quant_auto.Settings()) -> Path:
    """`auto`: how `--quant auto` scores the types (rows, tolerance, metric, answer length)."""
    # 1. Everything a user can get wrong, before any weight is read or any file written.
    if fmt not in EXPORT_FORMATS:
        raise TunebenchError(f"--format '{fmt}' is not one of {', '.join(EXPORT_FORMATS)}")
    quant = check_quant(fmt, quant)
    if quant == "auto":
        auto.check()
    source = find_source(run_dir)
    config = base_config(source, allow_download)
    writer, why = gguf_export.route(config) if fmt != "hf" else ("hf", "")
    if writer == "llama.cpp" or quant in llama_cpp_tools.K_QUANTS or quant == "auto":
        llama_cpp_tools.check_available(converter_needed=writer == "llama.cpp")
    kind = getattr(config, "model_type", "")
    if writer == "llama.cpp" and kind in gguf_export.SENTENCEPIECE_ONLY and sentencepiece_model(source) is None:
        raise TunebenchError(
            f"llama.cpp's converter for {gguf_export.CONVERTED[kind]} reads the family's SentencePiece tokenizer.model, "
            f"and neither this run nor its base ({source.base}) has one (its tokenizer is a BPE one); export with "
            "--format hf (a merged model directory), or fine-tune a base that ships the family's own tokenizer.model")
    target = output_path(source.run_dir, fmt, quant, output)
    if fmt == "ollama":
        check_modelfile_text(_trained_template(source.run_dir) or "")
    name = model_name(source.run_dir)
    if writer == "tunebench" and (source.run_dir / "tokenizer_config.json").is_file():
        gguf_export.pre_tokenizer(models.load_tokenizer(str(source.run_dir)))  # before minutes of loading
    held = quant_auto.held_out(source.run_dir, auto) if quant == "auto" else None

    # 2. The model as it will run: the adapter folded into its (dequantised, fp32) base.
    loaded = inference.load_for_inference(None if source.adapter else str(source.run_dir),
                                          str(source.run_dir) if source.adapter else None,
                                          allow_download=allow_download)
    model = loaded.model.merge_and_unload() if source.adapter else loaded.model
    model = model.float().eval()
    tokenizer = loaded.tokenizer
    raw = trained_on_text(source.run_dir)
    template = None if raw else chat_template(tokenizer, _trained_template(source.run_dir))
    if writer == "tunebench":
        gguf_export.pre_tokenizer(tokenizer)  # a base model's tokenizer (the run saved none): before writing
    sentencepiece = sentencepiece_model(source)

    # 3. Written beside the target and moved into place only once the read-back agrees with the model;
    # SIGTERM ends it like Ctrl-C, so no half-written file (or new empty directory) is left either way.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with _new_parents(target):
            if fmt == "hf":
                return _export_hf(model, tokenizer, target, quant, template)
            if quant == "auto":
                return _export_auto(model, tokenizer, template, name, writer, sentencepiece, fmt, target, held, auto)
            if fmt == "ollama":
                with atomic_dir(target) as tmp:
                    gguf_file = tmp / f"{name}-{quant}.gguf"
                    written, agreement = _write_gguf(model, tokenizer, gguf_file, quant, template, name, writer,
                                                     sentencepiece)
                    modelfile = write_modelfile(tmp, gguf_file, tokenizer, template, inference.context_limit(model))
                gguf_file, modelfile = target / gguf_file.name, target / modelfile.name
            else:
                with atomic_file(target, suffix=".gguf") as tmp:
                    written, agreement = _write_gguf(model, tokenizer, tmp, quant, template, name, writer,
                                                     sentencepiece)
                gguf_file = target
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"wrote {gguf_file} ({_mb(written.bytes)}) with {why}: {config.model_type} in {quant}, tokenizer "
          f"({len(tokenizer)} tokens, EOS {tokenizer.eos_token!r}) and "
          f"{'no prompt format (trained on plain text)' if raw else 'the prompt format the run trained with'}")
    if written.fallbacks and writer == "tunebench" and quant in gguf_export.QUANTS:
        print(f"  {len(written.fallbacks)} tensor(s) written f16: rows not a whole number of {quant} blocks "
              f"({', '.join(written.fallbacks[:3])}{', ...' if len(written.fallbacks) > 3 else ''})")
    elif written.fallbacks:
        print(f"  llama.cpp: {written.fallbacks[0]} (rows not a whole number of {quant}'s 256-value blocks)")
    print(agreement.line(quant))
    if fmt == "ollama":
        print(f"wrote {modelfile}; load it with:\n  ollama create {name} -f {modelfile}\n  ollama run {name}")
        return target
    print(f"run it with:\n  llama-cli -m {gguf_file}")
    return gguf_file


def sentencepiece_model(source: Source) -> Path | None:
    """The SentencePiece model (tokenizer.model) of the run or the model it started from, which llama.cpp's
    converter reads for the families that tokenize with one (Gemma, Phi-3, Mistral's older releases):
    transformers 5 saves a fast tokenizer without it, so a run's own directory has none."""
    places = [source.run_dir, Path(source.base)]
    with contextlib.suppress(TunebenchError):  # a full fine-tune's run: the model it started from
        places.append(Path(RunDir(source.run_dir).base_model()))
    for d in places:
        if (d / "tokenizer.model").is_file():
            return d / "tokenizer.model"
    return None


def _write_gguf(model, tokenizer, path: Path, quant: str, template: str | None, name: str, writer: str,
                sentencepiece: Path | None = None, f32: Path | None = None, memo: dict | None = None):
    """The GGUF at `path`, then its check. tunebench's writer writes its own tensor types directly; llama.cpp's
    converter writes an f32 file from the merged model (saved as an HF directory beside `path`) where it cannot
    write `quant` itself, and llama.cpp's quantizer makes the K-quants (and, after the converter, the legacy
    quants) from an f32 file, so every quantization starts from the exact weights. `f32`: where that f32 file
    is kept (and reused) when several types are written from one model: then every type, f16 and q8_0 included,
    is made from it by the quantizer, so the model is saved and converted once (each conversion of Gemma 3 270M
    took ~13 s; the quantizer's f16 and q8_0 from f32 round as the converter's do); `memo`: what one export has
    learned of the model (its f16 check, for the cause of a refusal)."""
    direct = gguf_export.QUANTS if writer == "tunebench" else llama_cpp_tools.OUTTYPES
    if quant in direct and writer == "tunebench":
        written = gguf_export.write(model, tokenizer, path, quant, template, name)
    else:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as tmp:
            from_f32 = quant not in direct or (f32 is not None and quant != "f32")
            first = f32 if f32 is not None else Path(tmp) / ("f32.gguf" if from_f32 else "model.gguf")
            if first.is_file():  # the f32 file an earlier type was quantized from
                pass
            elif writer == "tunebench":
                gguf_export.write(model, tokenizer, first, "f32", template, name)
            else:
                _write_hf(model, tokenizer, Path(tmp) / "hf", "f32", template)
                if sentencepiece is not None:
                    shutil.copyfile(sentencepiece, Path(tmp) / "hf" / "tokenizer.model")
                llama_cpp_tools.convert(Path(tmp) / "hf", first, "f32" if from_f32 else quant)
            if from_f32:
                warnings = llama_cpp_tools.quantize(first, path, quant)
            elif first == f32:  # f32 asked for beside other types: the kept file stays for them
                warnings = []
                shutil.copyfile(first, path)
            else:
                warnings = []
                first.replace(path)
        fallback = next((w for w in warnings if "fallback" in w), None)
        written = gguf_export.Written(path, path.stat().st_size, [fallback] if fallback else [])
    try:
        return written, _check(model, path, tokenizer, template, quant, writer)
    except Refused as e:
        if quant in EXACT_TYPES:
            raise
        why = _cause(model, tokenizer, template, quant, name, writer, sentencepiece, path, {} if memo is None else memo)
        raise TunebenchError(f"{e}; {why}", exit_code=1) from None


def _check(model, path: Path, tokenizer, template: str | None, quant: str, writer: str) -> Agreement:
    """The written file's agreement with the model, read back by what wrote it (Refused when too low)."""
    if writer == "tunebench":
        return compare(model, gguf_export.read_back(path, model.config), tokenizer, template, quant)
    reader = llama_cpp_tools.Reader(path)
    try:
        return compare(model, reader, tokenizer, template, quant, "llama.cpp")
    finally:
        reader.close()


def _cause(model, tokenizer, template: str | None, quant: str, name: str, writer: str, sentencepiece: Path | None,
           beside: Path, memo: dict) -> str:
    """Why a quantized type fell short, from f16 written from the same weights and read back the same way: f16
    reproducing the model puts the loss on the type's rounding of this model, not on the file's layout."""
    if "f16" not in memo:
        with tempfile.TemporaryDirectory(dir=beside.parent, prefix=".export-f16-") as tmp:
            f16 = Path(tmp) / "f16.gguf"
            try:
                _write_gguf(model, tokenizer, f16, "f16", template, name, writer, sentencepiece)
                memo["f16"] = _f16_reproduces(_check(model, f16, tokenizer, template, "f16", writer))
            except TunebenchError as e:
                memo["f16"] = f"f16 written from the same weights fails too ({e}): the file itself is wrong"
    by = "llama.cpp's quantizer" if writer == "llama.cpp" or quant in llama_cpp_tools.K_QUANTS else "tunebench's writer"
    return f"{memo['f16']} ({quant} by {by}); export at f16 or a type the check keeps"


def _f16_reproduces(agreement: Agreement) -> str:
    return (f"f16 written from the same weights and read back the same way reproduces the model "
            f"({agreement.top1:.1%} of {agreement.positions} positions, max logit difference "
            f"{agreement.max_diff:.3g}), so the file is laid out right and the loss is the type's own rounding of this "
            "model")


def _export_auto(model, tokenizer, template: str | None, name: str, writer: str, sentencepiece: Path | None,
                 fmt: str, target: Path, held, settings: quant_auto.Settings) -> Path:
    """--quant auto: every type written and checked in a work directory, the pick moved into the new directory
    `target` beside its table and answers (and, for ollama, its Modelfile)."""
    checks, memo = {}, {}

    def write(quant: str, path: Path) -> None:
        _, checks[quant] = _write_gguf(model, tokenizer, path, quant, template, name, writer, sentencepiece,
                                       f32=path.parent / "f32.gguf", memo=memo)
        if quant == "f16":  # the reference, checked: a refused type's cause needs no second f16 (~20 s on Gemma 3 270M)
            memo.setdefault("f16", _f16_reproduces(checks[quant]))

    with atomic_dir(target) as tmp:
        work = tmp / ".types"
        work.mkdir()
        chosen, picked, tried = quant_auto.pick(write, held, settings, work)
        gguf_file = tmp / f"{name}-{chosen}.gguf"
        picked.replace(gguf_file)
        quant_auto.record(tmp, chosen, tried, settings, held, work)
        shutil.rmtree(work)
        if fmt == "ollama":
            modelfile = write_modelfile(tmp, gguf_file, tokenizer, template, inference.context_limit(model))
    print(quant_auto.table(tried, settings))
    print(f"picked {chosen}: {quant_auto.reason(chosen, tried, settings)}")
    print(checks[chosen].line(chosen))
    print(f"wrote {target / gguf_file.name} ({_mb((target / gguf_file.name).stat().st_size)}), the table in "
          f"{target / 'quant-auto.json'} and each type's answers (answers-TYPE.jsonl)")
    if fmt == "ollama":
        print(f"load it with:\n  ollama create {name} -f {target / modelfile.name}\n  ollama run {name}")
        return target
    print(f"run it with:\n  llama-cli -m {target / gguf_file.name}")
    return target / gguf_file.name


def _export_hf(model, tokenizer, target: Path, quant: str, template: str | None) -> Path:
    with atomic_dir(target) as tmp:
        _write_hf(model, tokenizer, tmp, quant, template)
        agreement = compare(model, _load_hf(tmp, model.config._attn_implementation), tokenizer, template, quant,
                            reader="transformers' from_pretrained of the safetensors written")
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    print(f"wrote {target} ({_mb(size)}): the merged model in {quant} with its tokenizer and prompt format; "
          "AutoModelForCausalLM.from_pretrained and vLLM load it")
    print(agreement.line(quant))
    return target


@contextlib.contextmanager
def _new_parents(target: Path):
    """Directories made on the way to `target` are removed again if the export fails."""
    missing = [p for p in reversed(target.parents) if not p.exists()]
    try:
        yield
    except BaseException:
        for p in reversed(missing):
            with contextlib.suppress(OSError):
                p.rmdir()  # only while empty
        raise


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def check_quant(fmt: str, quant: str | None) -> str:
    allowed = tuple(HF_DTYPES) if fmt == "hf" else (*gguf_export.QUANTS, *llama_cpp_tools.K_QUANTS, "auto")
    quant = quant or ("f32" if fmt == "hf" else "f16")
    if fmt == "hf" and quant.lower() == "auto":
        raise TunebenchError("--quant auto picks a GGUF type by its task score in llama.cpp; --format hf keeps "
                             "f32, f16 or bf16 weights: use --format gguf or ollama with --quant auto")
    if quant.lower() not in allowed:
        raise TunebenchError(f"--quant '{quant}' is not one of {', '.join(allowed)} for --format {fmt}")
    return quant.lower()


def find_source(run_dir: str) -> Source:
    d = Path(run_dir)
    if not d.is_dir():
        raise TunebenchError(f"'{run_dir}' is not a directory; pass a training run's --output-dir")
    run = RunDir(d)
    if run.kind() == "adapter":
        peft_type = run.peft_type() or ""
        if peft_type in ("PREFIX_TUNING", "PROMPT_TUNING", "P_TUNING"):
            raise TunebenchError(f"'{run_dir}' is {peft_type.lower().replace('_', ' ')}: virtual tokens, no weights "
                                 "to fold into the base, so no runtime can load it as one model; use it with "
                                 "tunebench generate/chat/serve --adapter, or train LoRA to export")
        if not any(d.glob("adapter_model.*")):
            raise TunebenchError(f"'{run_dir}' has an adapter config but no adapter weights; the run did not "
                                 "finish: resume it with `tunebench train --resume auto` first")
        return Source(d, True, run.base_model())
    if (d / "config.json").is_file() and any(d.glob("*.safetensors")):
        return Source(d, False, str(d))
    raise TunebenchError(f"'{run_dir}' holds no model (no adapter_config.json, no config.json with weights); "
                         "pass a finished training run's --output-dir")


def base_config(source: Source, allow_download: bool):
    """The architecture's config, read without loading weights."""
    from transformers import AutoConfig, GPT2Config

    base = source.base
    if base == "tiny":
        return models.tiny()[0].config
    if base == "gpt2-124m":
        return GPT2Config()
    if base == models.SMOLLM2:
        base = str(models.smollm2_dir())
    elif base.endswith(".gguf"):  # its conversion (made once, cached), not its weights loaded (~8 s for Gemma 3 270M)
        base = str(models.gguf_dir(base))
    try:
        return AutoConfig.from_pretrained(base, local_files_only=not allow_download)
    except (OSError, ValueError) as e:
        raise TunebenchError(f"cannot read the model config of '{base}' ({type(e).__name__}); the run's base "
                             "model has moved: pass it with --allow-download or restore it") from e


def output_path(run_dir: Path, fmt: str, quant: str, output: str | None) -> Path:
    """Where the export goes (refused if something is already there, or a parent is a file)."""
    name = model_name(run_dir)
    default = {"gguf": f"{name}-{quant}.gguf", "ollama": f"ollama-{quant}", "hf": f"hf-{quant}"}[fmt]
    if quant == "auto":  # a directory: the picked file (its type in its name) beside the table of every type
        default = f"{fmt}-auto"
    target = Path(output) if output else run_dir / "export" / default
    if quant == "auto" and target.suffix == ".gguf":
        raise TunebenchError(f"-o '{target}': with --quant auto the export is a new directory (the picked file, "
                             "its table and answers); pass a directory path")
    if fmt == "gguf" and quant != "auto" and target.suffix != ".gguf":
        raise TunebenchError(f"-o '{target}' should end in .gguf (llama.cpp and Ollama look for it)")
    if target.exists():
        raise TunebenchError(f"'{target}' exists; exports never overwrite: pass -o with a new path")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise TunebenchError(f"-o '{target}' is under '{parent}', which is a file; pick a path in a directory")
            break
    return target


def model_name(run_dir: Path) -> str:
    """The run directory's name as Ollama accepts a model name (lower case, letters, digits, . _ -)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", run_dir.resolve().name.lower()).strip("-._")
    return name or "tunebench-model"


def trained_on_text(run_dir: Path) -> bool:
    """A `tunebench pretrain` run: plain text, no prompt format around it."""
    return RunDir(run_dir).kind() == "pretrain"


def _trained_template(run_dir: Path) -> str:

    return trained_template(str(run_dir))


def chat_template(tokenizer, template: str) -> str:
    """The Jinja chat template that makes a runtime prompt the model as `tunebench generate` does
    (tokenize.render_prompt): the tokenizer's own when the run used it, else the run's --template (or the
    default instruction format) turned into one."""
    if template in ("auto", "chat") and getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    return gguf_export.instruction_template(DEFAULT_PROMPT if template in ("auto", "chat") else template)


def render(tokenizer, template: str | None, user: str) -> str:
    """One user message as the exported model is prompted with it."""
    if template is None:
        return user
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], chat_template=template,
                                         tokenize=False, add_generation_prompt=True)


# A position where the merged model's top token leads its runner-up by less than this many logits (odds under
# 1.65:1) is a near-tie that a quantized type's rounding may flip without the file being wrong: Gemma 3 270M's
# q8_0, written by llama.cpp's converter or its quantizer and run by llama.cpp, flipped 8 of 78 positions, every
# one a near-tie (margins 0.002-0.98) while llama.cpp's own f32 file agreed at all 78 (max difference 0.08); its
# weights alone rounded to q8_0 in PyTorch flipped 4 of them. A quantized type's agreement is counted where the
# model decides (lead >= 0.5 logit); f32, f16 and bf16 are counted everywhere, as before.
NEAR_TIE = 0.5
EXACT_TYPES = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Agreement:
    max_diff: float  # largest |logit difference| over every position of the check prompts
    top1: float  # share of the counted positions whose most likely next token is the same
    positions: int  # the counted positions: all for f32/f16/bf16, the decided ones for a quantized type
    reader: str = "transformers' GGUF reader"
    everywhere: float | None = None  # a quantized type's agreement at every position, near-ties included
    all_positions: int | None = None

    def line(self, quant: str) -> str:
        where = (f"{self.positions} positions of {len(CHECK_PROMPTS)} held-out prompts" if self.all_positions is None
                 else f"the {self.positions} of {self.all_positions} positions of {len(CHECK_PROMPTS)} held-out "
                      f"prompts where the model's top token leads by {NEAR_TIE} logit or more")
        text = (f"checked: read back by {self.reader}, {where} give the merged model's next token {self.top1:.1%} of "
                f"the time (needed {MIN_AGREEMENT[quant]:.0%} at {quant})")
        if self.everywhere is not None:
            text += f"; {self.everywhere:.1%} at all {self.all_positions}, near-ties included"
            if quant == "f32" and self.by_llama_cpp:
                text += f" (needed {MIN_AGREEMENT['f16']:.0%}, as f16)"
        text += f", max logit difference {self.max_diff:.3g}"
        if quant == "f32" and not self.by_llama_cpp:
            text += f" (needed {F32_MAX_DIFF:g} or less)"
        return text

    @property
    def by_llama_cpp(self) -> bool:
        """Read back by llama.cpp, whose arithmetic differs from PyTorch's on the same f32 weights (_f32_short)."""
        return self.reader == "llama.cpp"


@torch.no_grad()
def compare(model, back, tokenizer, template: str | None, quant: str,
            reader: str = "transformers' GGUF reader") -> Agreement:
    """Logits of the merged model and of what was written, on the check prompts; refused when the written
    file disagrees more than its tensor type explains (so it never reaches its final name). A quantized type is
    judged where the model decides (NEAR_TIE), and the refusal names how far its picks fell from the model's."""
    diffs, same, total, decided_same, decided = [], 0, 0, 0, 0
    vocab = model.get_input_embeddings().weight.shape[0]
    for prompt in CHECK_PROMPTS:
        ids = tokenizer(render(tokenizer, template, prompt), return_tensors="pt", add_special_tokens=False).input_ids
        ids = ids[:, -min(ids.shape[1], inference.context_limit(model) or ids.shape[1]):]
        a, b = model(ids).logits[0, :, :vocab], back(ids).logits[0, :, :vocab]  # (T, V)
        diffs.append((a - b).abs().max().item())
        agrees = a.argmax(-1) == b.argmax(-1)
        top2 = a.float().topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) >= NEAR_TIE
        same += agrees.sum().item()
        total += ids.shape[1]
        decided_same += (agrees & clear).sum().item()
        decided += clear.sum().item()
    # f32 and the quantized types are judged where the model decides (its top token leads by NEAR_TIE): at a
    # near-tie another summation order alone (the same f32 weights under another kernel) can flip the pick, and
    # once refused an f32 export it wrote exactly (max logit difference 0 in five later tries); f32 is still held to
    # F32_MAX_DIFF, which a wrong tensor passes nowhere. f16 and bf16 have no such bound: they stay judged at every
    # position (a wrong rotary row order agrees where the model decides, and only that catches it).
    if quant in ("f16", "bf16") or not decided:
        agreement = Agreement(max(diffs), same / total, total, reader)
    else:
        agreement = Agreement(max(diffs), decided_same / decided, decided, reader, same / total, total)
    if agreement.top1 < MIN_AGREEMENT[quant] or (quant == "f32" and _f32_short(agreement)):
        raise Refused(f"the written file does not reproduce the model: {agreement.line(quant)}; nothing was kept"
                      + (". Export at a wider --quant (q8_0, f16), and report it if f16 fails" if quant in EXACT_TYPES
                         else ""), exit_code=1)
    return agreement


def _f32_short(agreement: Agreement) -> bool:
    """Whether an f32 file that agrees where the model decides is still wrong. Read back by PyTorch (tunebench's
    writer, transformers), only summation order differs: held to F32_MAX_DIFF. llama.cpp computes differently even
    from the same f32 weights (GELU through an f16 table, its own exp and matmul order): Gemma 3 270M's f32 file
    is 0.054 logit off (max |logit| 50; the tiny SiLU families 1e-5, the tiny Gemmas 2e-3, 3e-4 once the model's
    GELU is rounded as the table does), so there it is held to f16's rule at every position, near-ties included,
    which is what catches a file wrong in a way the decided positions hide."""
    if not agreement.by_llama_cpp:
        return agreement.max_diff > F32_MAX_DIFF
    return agreement.everywhere is not None and agreement.everywhere < MIN_AGREEMENT["f16"]


class Refused(TunebenchError):
    """A written file's read-back fell short of its type's agreement (export adds why, for a quantized type)."""


def check_modelfile_text(text: str) -> None:
    """A Modelfile's triple-quoted TEMPLATE has no escapes: three double quotes inside would end it and let
    the rest of the prompt format be read as Modelfile directives. Refused, never written."""
    if '"""' in text:
        raise TunebenchError('the prompt format holds """, which ends an Ollama Modelfile\'s TEMPLATE (it has no '
                             "escape) and would turn the rest into directives; export --format gguf, or train "
                             "with a template without it")


def write_modelfile(directory: Path, gguf_file: Path, tokenizer, template: str | None, context: int | None) -> Path:
    """Ollama's Modelfile: the GGUF, the prompt format as a Go TEMPLATE, EOS as the stop word and the
    defaults `tunebench generate` uses (greedy). A run trained on tool calls gets the tool template's Go form,
    which renders the chat, the tools Ollama is given and the calls in its history; the others render one user
    turn around .Prompt."""
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    if template == toolcalls.TEMPLATE:
        go = toolcalls.OLLAMA_TEMPLATE
        stops += [end for end in ("<|im_end|>",) if end not in stops]  # the turn's end, whatever EOS is
    elif template is None:
        go = "{{ .Prompt }}"
    else:
        go = gguf_export.ollama_template(lambda user: render(tokenizer, template, user), tokenizer.eos_token or "")
    check_modelfile_text(go)
    lines = [f"FROM ./{gguf_file.name}", f'TEMPLATE """{go}"""']
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stops]
    lines.append("PARAMETER temperature 0")
    if context:
        lines.append(f"PARAMETER num_ctx {context}")
    path = directory / "Modelfile"
    with atomic_file(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    return path


def _write_hf(model, tokenizer, out: Path, quant: str, template: str | None) -> None:
    model.to(HF_DTYPES[quant]).save_pretrained(out, safe_serialization=True)
    model.float()
    if template is not None:
        tokenizer.chat_template = template  # so transformers and vLLM prompt it as training did
    tokenizer.save_pretrained(out)


def _load_hf(path: Path, attention: str = "eager"):
    """The written directory as transformers loads it, with the merged model's attention kernel (like with like)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attention).eval()


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
