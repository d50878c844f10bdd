"""Did it learn the task: answers generated for held-out rows (greedy, the run's own prompt format) and
scored with the libraries the field uses: ROUGE-L (rouge-score), chrF (sacrebleu), and exact match of
the final answer on GSM8K-style references (`#### 42`). Also whether each answer stopped with EOS
before the token cap, how long answers are, and how fast they were generated."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.data import formats, toolcalls
from tunebench.data.tokenize import render_prompt
from tunebench.model import llama_cpp_tools

if TYPE_CHECKING:  # torch, the model and the data load only when answers are generated: the names below are
    from tunebench.data import formats
    from tunebench.model import inference  # read by the command line's parser and the torch-free report

# The one list of task metrics: every quality figure travels under these names (summary.json, compare's CSV
# and report, eval's table, train's per-dataset columns, tune's objectives).
SCORES = ("rougeL", "chrf", "exact_match", "eos_rate")  # the answers judged (higher is better)
METRICS = SCORES + ("answer_tokens", "gen_tokens_per_s")  # and what describes them
OBJECTIVES = ("rougeL", "chrf", "exact_match")  # what a search can maximize (a high EOS rate is no goal in itself)
LABELS = {"rougeL": "ROUGE-L", "chrf": "chrF", "exact_match": "exact match (%)", "eos_rate": "EOS rate (%)",
          "tool_name": "right tool (%)", "tool_args": "exact arguments (%)", "tool_schema": "valid arguments (%)",
          "tool_decision": "called when due (%)",
          "answer_tokens": "answer tokens", "gen_tokens_per_s": "generated tokens/s"}
DIGITS = {"rougeL": 1, "chrf": 1, "exact_match": 1, "eos_rate": 0, "answer_tokens": 1, "gen_tokens_per_s": 1,
          "tool_name": 1, "tool_args": 1, "tool_schema": 1, "tool_decision": 1}
GSM8K_ANSWER = re.compile(r"####\s*(.+)")
NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


# Where held-out replies are tool calls: the share (%) of rows whose answer calls the reference's function, with
# the same arguments (equal as JSON), with arguments the tool's JSON schema accepts, and that call a tool exactly
# where the reference does (and answer in words where it does not).
TOOL_SCORES = ("tool_name", "tool_args", "tool_schema", "tool_decision")
TASK_SCORES = SCORES + TOOL_SCORES  # every score of the answers: a results row's, a report's columns
TASK_OBJECTIVES = OBJECTIVES + TOOL_SCORES  # a search maximizes any of them; the tool scores, where rows offer tools


@dataclass
class Answer:
    prompt: str
    reference: str
    answer: str
    tokens: int  # generated, EOS included when it came
    stopped: bool  # ended with EOS before the --max-new-tokens cap
    calls: list | None = None  # the reference reply's tool calls [{"name", "arguments"}], where the row offers tools
    tools: list | None = None  # the row's tools (their schemas check an answer's arguments)


def prompt_and_reference(messages: formats.Messages) -> tuple[formats.Messages, str] | None:
    """The turns before the last reply (with the row's tools), and the reply a model's answer is scored against
    (a tool call written as the tool template writes it); None for plain text."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None or last == 0:
        return None
    reply = messages[last]
    calls = "\n".join(toolcalls.written(c["function"]["name"], c["function"]["arguments"])
                      for c in reply.get("tool_calls") or [])
    return formats.Conversation(messages[:last], formats.tools_of(messages)), "\n".join(
        t for t in (reply["content"], calls) if t)


def answerable(rows: list[formats.Messages]) -> list[tuple[formats.Messages, formats.Messages, str]]:
    """(row, the turns before its last reply, that reply) for each row with a reply to score; refused where none
    has one (plain text)."""
    found = [(row, *pair) for row in rows if (pair := prompt_and_reference(row)) is not None]
    if not found:
        raise TunebenchError("the data has no prompt/response rows to generate answers for (plain text); "
                             "task metrics need instruction, alpaca or chat data")
    return found


def reference_calls(messages: formats.Messages) -> list | None:
    """The last reply's tool calls as {"name", "arguments"}, where the row offers tools or makes calls; else None."""
    last = [m for m in messages if m["role"] == "assistant"][-1]
    if not (formats.tools_of(messages) or last.get("tool_calls")):
        return None
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in last.get("tool_calls") or []]


def generate_answers(placed: inference.Placed, rows: list[formats.Messages], template: str, max_new_tokens: int,
                     batch_size: int = 8, seed: int = 0) -> tuple[list[Answer], float]:
    """Greedy answers for `rows` (batched, left-padded), and the seconds generation took."""
    import torch

    from tunebench.model import inference

    pairs = answerable(rows)
    tok = placed.tokenizer
    limit = inference.position_limit(placed.model)
    side, tok.padding_side = tok.padding_side, "left"
    torch.manual_seed(seed)
    answers, seconds = [], 0.0
    try:
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start:start + batch_size]
            prompts = [render_prompt(turns, tok, template) for _, turns, _ in chunk]
            enc = placed.encode(prompts, padding=True)
            width = enc["input_ids"].shape[1]
            cap = max_new_tokens if limit is None else max(0, min(max_new_tokens, limit - width))
            began = time.perf_counter()
            out = placed.decode(enc["input_ids"], enc["attention_mask"], cap)
            seconds += time.perf_counter() - began
            for (row, turns, reference), prompt, new in zip(chunk, prompts, out.tolist()):
                stop = new.index(tok.eos_token_id) if tok.eos_token_id in new else None
                kept = new if stop is None else new[:stop]
                answers.append(Answer(prompt, reference, tok.decode(kept, skip_special_tokens=True).strip(),
                                      len(kept) + (stop is not None), stop is not None, reference_calls(row),
                                      formats.tools_of(turns)))
    finally:
        tok.padding_side = side
    return answers, seconds


def generate_answers_gguf(path: Path, tok, rows: list[formats.Messages], template: str, max_new_tokens: int,
                          context: int = 2048) -> tuple[list[Answer], float]:
    """Greedy answers from llama.cpp running the exported file at `path` (llama-cpp-python), fed the same prompt
    ids the PyTorch model is (the run's tokenizer and prompt format), until its end-of-generation token or the
    cap: what a deployment of that file answers. The seconds are llama.cpp's, prompt processing included."""
    import torch

    from tunebench.model.gguf_runtime import GgufPlaced

    llama_cpp_tools.check_available(converter_needed=False)
    pairs = answerable(rows)
    placed = GgufPlaced.open(path, tok, context)
    answers, seconds = [], 0.0
    try:
        eos = placed.model.token_eos()
        for row, turns, reference in pairs:
            prompt = render_prompt(turns, tok, template)
            ids = torch.tensor([tok(prompt, add_special_tokens=False).input_ids[-(context - max_new_tokens):]])
            began = time.perf_counter()
            new = placed.decode(ids, torch.ones_like(ids), max_new_tokens)[0].tolist()  # greedy, EOS last
            seconds += time.perf_counter() - began
            stopped = bool(new) and new[-1] == eos
            text = tok.decode(new[:len(new) - stopped], skip_special_tokens=True).strip()
            answers.append(Answer(prompt, reference, text, len(new), stopped, reference_calls(row),
                                  formats.tools_of(turns)))
    finally:
        placed.close()
    return answers, seconds


def final_answer(text: str) -> str | None:
    """GSM8K's final answer: what follows `####`, else the last number in the text (lm-eval's flexible
    extract), without thousands separators, a dollar sign or a trailing period."""
    marked = GSM8K_ANSWER.search(text)
    found = marked.group(1) if marked else (NUMBER.findall(text) or [None])[-1]
    if found is None:
        return None
    found = found.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(found)
        return str(int(value)) if value == int(value) else str(value)
    except ValueError:
        return found


def score(answers: list[Answer], seconds: float) -> dict[str, float | None]:
    """ROUGE-L F1 (mean over rows, x100) and corpus chrF, both against the reference response; exact match
    of the final answer where every reference is GSM8K-style (else None); the EOS rate; mean tokens."""
    import sacrebleu
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    hyps, refs = [a.answer for a in answers], [a.reference for a in answers]
    rouge = sum(scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(hyps, refs)) / len(answers)
    gsm8k = all(GSM8K_ANSWER.search(r) for r in refs)
    exact = sum(final_answer(h) == final_answer(r) for h, r in zip(hyps, refs)) / len(answers) if gsm8k else None
    tokens = sum(a.tokens for a in answers)
    return tool_scores(answers) | {
        "rougeL": round(100 * rouge, 2), "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2),
        "exact_match": None if exact is None else round(100 * exact, 2),
        "eos_rate": round(100 * sum(a.stopped for a in answers) / len(answers), 2),
        "answer_tokens": round(tokens / len(answers), 1),
        "gen_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
    }


def row_scores(answers: list[Answer], metric: str) -> list[float]:
    """Each row's own `metric` (x100): ROUGE-L F1, sentence chrF, or exact match as 0/100; what a paired
    comparison of two models over the same rows resamples (corpus chrF is not a mean of rows, sentence chrF is)."""
    import sacrebleu
    from rouge_score import rouge_scorer

    if metric == "rougeL":
        scorer = rouge_scorer.RougeScorer(["rougeL"])
        return [100 * scorer.score(a.reference, a.answer)["rougeL"].fmeasure for a in answers]
    if metric == "chrf":
        return [sacrebleu.sentence_chrf(a.answer, [a.reference]).score for a in answers]
    return [100.0 * (final_answer(a.answer) == final_answer(a.reference)) for a in answers]


def tool_scores(answers: list[Answer]) -> dict[str, float]:
    """TOOL_SCORES over the rows that offer tools (none where no row does): the first call of each answer
    (read back by data.toolcalls.parse) against the reference's first call."""
    judged = [a for a in answers if a.calls is not None]
    if not judged:
        return {}
    calling = [a for a in judged if a.calls]
    hits = {k: 0 for k in TOOL_SCORES}
    for a in judged:
        said = toolcalls.parse(a.answer)[1]
        hits["tool_decision"] += bool(said) == bool(a.calls)
        if a.calls and said:
            want, got = a.calls[0], said[0]
            hits["tool_name"] += got["name"] == want["name"]
            hits["tool_args"] += got["name"] == want["name"] and got["arguments"] == want["arguments"]
            hits["tool_schema"] += toolcalls.valid(got, a.tools)
    share = lambda n, of: round(100 * n / len(of), 2) if of else None  # noqa: E731
    return {"tool_decision": share(hits["tool_decision"], judged),
            **{k: share(hits[k], calling) for k in ("tool_name", "tool_args", "tool_schema")}}


def write_answers(path: Path, answers: list[Answer], scores: dict) -> None:
    """Each row's prompt, reference and answer (JSONL, for a person to read), the scores on the first line."""
    with atomic_file(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"scores": scores}) + "\n")
            for a in answers:
                f.write(json.dumps(asdict(a), ensure_ascii=False) + "\n")


def evaluate_task(placed: inference.Placed, rows: list[formats.Messages], template: str, max_new_tokens: int, answers_path: Path,
                  seed: int = 0) -> dict[str, float | None]:
    answers, seconds = generate_answers(placed, rows, template, max_new_tokens, seed=seed)
    scores = score(answers, seconds)
    write_answers(answers_path, answers, scores)
    return scores
