"""The fine-tuning recipes' rows: the inputs checked before anything loads, max_length settled from the rows
(auto), the rows split into training and held-out ones, the batches and their layout (padded or packed), and the
refusal when too few rows are left. jobs/finetune.py and jobs/grpo.py share it."""



import dataclasses

import numpy as np

from tunebench.core.decision import Decision
from tunebench.core.errors import TunebenchError
from tunebench.data import batching, judged, mixture, pairs, toolcalls
from tunebench.data.tokenize import split, tokenize_messages, use_template
from tunebench.jobs.parts import runner
from tunebench.model import inference, methods, models
from tunebench.settings.finetune import RunConfig
from tunebench.training import feed
from tunebench.training.autotune import layout

DROPPED = {True: "the prompt alone fills --max-length", False: "no response left after truncation"}
JUDGEMENTS = {"pairs": pairs, "judged": judged}  # by Objective.data: each reader's load, tokenize and collate


def template_rows(tok) -> list[Decision]:
    """The chat template's row where the run put tunebench's tool template on the tokenizer (data.toolcalls)."""
    if getattr(tok, "chat_template", None) != toolcalls.TEMPLATE:
        return []
    return [Decision("chat_template", toolcalls.NAME, "the data carries tool calls or reasoning and the model's own "
                     "template does not render them: Hermes <tool_call> JSON (Qwen2.5's form), saved with the run")]


def check_inputs(cfg: RunConfig):
    """(preference pairs or None, the datasets) read and checked before anything expensive: enough rows for a
    step, a model that can be found, a max length it takes, a scored eval that has rows to answer."""
    if cfg.objective.preference:
        examples, parts = JUDGEMENTS[cfg.objective.data].load(cfg.data), []
        print(f"data: {examples.describe()}")
        check_rows(len(examples), cfg, 0, "")
    else:
        examples, parts = None, mixture.parts(cfg.data)  # one dataset, or each of data.sources with its weight
        for part in parts:
            if part.examples.empty_rows:
                print(f"data{'' if len(parts) == 1 else ' ' + part.name}: {part.examples.describe_dropped()}")
        check_rows(sum(len(p.examples.messages) for p in parts), cfg,
                   sum(len(p.examples.empty_rows) for p in parts), "empty")
        toolcalls.check_schemas([m for p in parts for m in p.examples.messages])
    models.check_spec(cfg.model.name, cfg.model.allow_download)
    if cfg.data.max_length is not None:  # auto is settled within the model's positions (settle_length)
        inference.check_length(cfg.model.name, cfg.data.max_length, cfg.model.allow_download)
    return examples, parts


LENGTH_QUANTILE = 99  # auto keeps this percent of the rows whole


LENGTH_STEP = 64  # and rounds up to a multiple of this (the loss rows are padded to 64 too)


LENGTH_SAMPLE = 4096  # rows auto tokenizes to find it: a seeded sample of a bigger dataset


def settle_length(cfg: RunConfig, lengths_of) -> tuple[RunConfig, Decision]:
    """`cfg` with data.max_length a number, and its settings row: as asked, or for auto (None) the length that
    keeps the rows whole: the 99th percentile of their tokens as training renders them (`lengths_of(tokenizer,
    sample)`, the tokenizer alone, no weights), rounded up to 64, capped at the positions the model learned.
    Rows longer than it are cut, and counted where they are today."""
    d = cfg.data
    if d.max_length is not None:
        return cfg, Decision("max_length", d.max_length, "asked for")
    limit, kind = inference.positions(cfg.model.name, cfg.model.allow_download)
    tok = models.load_tokenizer(cfg.model.tokenizer) if cfg.model.tokenizer else \
        models.tokenizer_for(cfg.model.name, cfg.model.allow_download)  # the run's own, as finetune_model.load gives it
    rng = np.random.default_rng(cfg.schedule.seed)
    lengths = np.asarray(lengths_of(tok, lambda n: np.sort(rng.permutation(n)[:LENGTH_SAMPLE])))
    if not len(lengths):
        raise TunebenchError(f"--max-length auto: no row of '{d.path}' could be measured; pass --max-length N")
    top = int(np.ceil(np.percentile(lengths, LENGTH_QUANTILE)))
    length = -(-top // LENGTH_STEP) * LENGTH_STEP
    capped = limit is not None and length > limit
    length = min(length, limit) if capped else length
    over = int((lengths > length).sum())
    sample = f" of a sample of {len(lengths):,}" if len(lengths) == LENGTH_SAMPLE else ""
    why = (f"auto: {LENGTH_QUANTILE}% of the rows{sample} have {top:,} tokens or fewer (the longest {int(lengths.max()):,}), "
           f"rounded up to a multiple of {LENGTH_STEP}" + (f", capped at the {limit:,} positions this model learned "
                                                          f"({kind})" if capped else "")
           + f"; {over} of {len(lengths):,} rows are longer and are cut; --max-length N sets it")
    return dataclasses.replace(cfg, data=dataclasses.replace(d, max_length=length)), Decision("max_length", length, why)


def row_lengths(cfg: RunConfig, examples, parts):
    """`settle_length`'s measure for the fine-tuning recipes: tokens per row (a pair's longer row, a judged
    completion with its prompt) as training renders them, uncut."""

    def lengths(tok, sample) -> list[int]:
        if cfg.objective.preference:
            return JUDGEMENTS[cfg.objective.data].tokenize(examples, tok, dataclasses.replace(
                cfg.data, max_length=10**9)).lengths().tolist()
        out: list[int] = []
        for part in parts:
            messages = part.examples.messages
            rows = [messages[i] for i in sample(len(messages))]
            whole = dataclasses.replace(part.config, max_length=10**9)
            use_template(rows, tok, whole)
            out += tokenize_messages(rows, tok, whole, part.examples.fmt).lengths().tolist()
        return out

    return lengths


def split_rows(cfg: RunConfig, data, spans, parts):
    """(the training rows in the mixture's proportions, each dataset's training and held-out rows), checked:
    enough rows left after tokenizing, and held-out rows with replies when the run scores its answers."""
    check_rows(len(data), cfg, data.dropped, "whose prompt alone fills --max-length" if cfg.objective.data != "rows"
               else "left without a response by truncation at --max-length")
    seed = cfg.schedule.seed
    train_parts, eval_parts = mixture.splits(spans, cfg.data, seed)
    train_idx = train_parts[0] if len(parts) <= 1 else mixture.mixture(train_parts, [p.weight for p in parts], seed)
    if len(parts) > 1:
        print("data: " + ", ".join(f"{p.name} {p.weight:.0%} of the training rows ({len(tr)} rows, {len(ev)} held out)"
                                   for p, tr, ev in zip(parts, train_parts, eval_parts)))
    if cfg.evaluation.eval_generate and (sum(map(len, eval_parts)) == 0 or data.fmt == "text"):
        raise TunebenchError("--eval-generate answers held-out prompt/response rows, and this run holds none out "
                             f"({'plain text' if data.fmt == 'text' else 'eval_fraction 0'}); set --eval-fraction "
                             "above 0 on instruction, alpaca or chat data, or drop --eval-generate")
    return train_idx, train_parts, eval_parts


def batcher(cfg: RunConfig, opened: runner.Opened, data, train_idx, collate_unit, pad_id: int):
    """micro batch -> feed.Batches (each epoch's steps, the collate of a micro batch, the batch layout's row):
    the layout decided for the micro batch the runner measured."""
    lengths = data.lengths()

    def batches(micro: int):
        layout, row = decide_layout(cfg, lengths, train_idx, micro * opened.world.size, opened.effective)
        steps = lambda epoch: batching.epoch_steps(  # noqa: E731
            train_idx, opened.effective, cfg.schedule.seed, epoch, lengths=lengths if layout == "length-grouped" else None)
        if layout == "packed":
            return feed.Batches(steps, lambda rows, _: batching.collate_packed(data, rows, pad_id, cfg.data.max_length),
                                  [row])
        if getattr(collate_unit, "func", collate_unit) is judged.collate:  # its KL rows: from the global micro-step
            return feed.Batches(steps, lambda rows, step_rows: collate_unit(data, rows, pad_id, step_rows), [row])
        return feed.Batches(steps, lambda rows, _: collate_unit(data, rows, pad_id), [row])
    return batches


def decide_layout(cfg: RunConfig, lengths, train_idx, rows_per_step: int,
                  effective: int) -> tuple[str, Decision]:
    """How rows are laid out in a micro batch (packed, length-grouped or as they come), and its row."""
    prompt_method = cfg.adapter.method in methods.PROMPT_METHODS
    packing = "off" if prompt_method or cfg.objective.preference else cfg.data.packing  # a pair's two rows stay side by side
    batch_layout, reason = layout.decide(packing, lengths, train_idx, rows_per_step, cfg.schedule.seed,
                                         cfg.data.max_length, effective)
    if prompt_method and cfg.data.packing == "auto":
        reason += f"; not packed: {cfg.adapter.method} tuning drops the position ids that separate packed rows"
    return batch_layout, Decision("batch layout", batch_layout, reason)


def check_rows(usable: int, cfg: RunConfig, dropped: int, why: str) -> None:
    """Refuse data too small for one optimizer step: fewer training rows than the effective batch would
    repeat rows inside a step (one row trained 8 times as one 'batch' of 8)."""
    d = cfg.data
    train_idx, eval_idx = split(usable, d.eval_fraction, cfg.schedule.seed, d.max_samples, d.eval_samples)
    if len(train_idx) < cfg.effective_batch_size:
        held = f", {len(eval_idx)} held out for eval" if len(eval_idx) else ""
        lost = f", {dropped} {why}" if dropped else ""
        raise TunebenchError(
            f"dataset '{d.path}' leaves {len(train_idx)} training row(s) ({usable} usable{lost}{held}), fewer than one "
            f"effective batch of {cfg.effective_batch_size}; add rows or lower --effective-batch-size")
