"""Task-level evaluation: metrics as the libraries compute them, the EOS rate, held-out rows, base vs tuned,
the columns compare writes and the quality-vs-speed chart."""

import json

import pytest
import torch

from conftest import needs_module
from tunebench.interfaces import cli
from tunebench.jobs import finetune, report
from tunebench.model import inference, quality
from tunebench.settings.finetune import load_config

PAIRS = [("The refund was sent to your card.", "Your refund has been sent to your card."),
         ("Please reset your password from the login page.", "You can reset the password on the login page."),
         ("", "An empty answer scores zero."), ("Exactly the same.", "Exactly the same.")]


def _answers(pairs, stopped=None):
    return [quality.Answer("p", ref, hyp, 5, True if stopped is None else stopped[i])
            for i, (hyp, ref) in enumerate(pairs)]


def test_rouge_l_and_chrf_are_the_libraries_own_values():
    import sacrebleu
    from rouge_score import rouge_scorer

    scores = quality.score(_answers(PAIRS), 1.0)
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge = sum(scorer.score(ref, hyp)["rougeL"].fmeasure for hyp, ref in PAIRS) / len(PAIRS)
    assert scores["rougeL"] == round(100 * rouge, 2)
    assert scores["chrf"] == round(sacrebleu.corpus_chrf([h for h, _ in PAIRS], [[r for _, r in PAIRS]]).score, 2)
    assert 0 < scores["rougeL"] < 100 and scores["exact_match"] is None  # not GSM8K-style references
    assert quality.score(_answers([("Exactly the same.", "Exactly the same.")]), 1.0)["rougeL"] == 100.0


@pytest.mark.parametrize("text,expected", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"), ("#### 1,250", "1250"), ("The answer is $18.", "18"),
    ("So she has 3.50 dollars left", "3.5"), ("5 apples and then 7.0", "7"), ("no number here", None),
])
def test_the_final_answer_is_read_as_gsm8k_and_lm_eval_read_it(text, expected):
    assert quality.final_answer(text) == expected


def test_exact_match_on_gsm8k_style_references():
    pairs = [("She pays 5 + 3 = 8 dollars. #### 8", "5+3=8\n#### 8"), ("The total is 1,250.", "#### 1250"),
             ("It is 7", "#### 6")]
    assert quality.score(_answers(pairs), 1.0)["exact_match"] == round(100 * 2 / 3, 2)


def test_tool_calls_are_scored_by_name_arguments_schema_and_when_to_call():
    """Four rows offering one tool: the right call, a call with another argument value, a call where words were
    due, and words where a call was due; a row without tools is not judged; arguments that break the schema
    count for name and arguments but not schema."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = lambda args: f'<tool_call>\n{json.dumps({"name": "get_weather", "arguments": args})}\n</tool_call>'  # noqa: E731
    oslo = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    rows = [(call({"city": "Oslo"}), oslo), (call({"city": "Rome"}), oslo), (call({"city": "Oslo"}), []),
            ("It rains.", oslo), (call({"city": 7}), [{"name": "get_weather", "arguments": {"city": 7}}])]
    answers = [quality.Answer("p", "r", said, 5, True, calls, tools) for said, calls in rows]
    answers.append(quality.Answer("p", "r", call({"city": "Oslo"}), 5, True))  # no tools offered: not judged
    scores = quality.tool_scores(answers)
    # 4 rows with a call due: names right in 3 (row 4 answered in words), arguments in 2, schema in 2 (not city 7)
    assert scores == {"tool_decision": 60.0, "tool_name": 75.0, "tool_args": 50.0, "tool_schema": 50.0}
    assert quality.tool_scores(answers[-1:]) == {}
    assert set(quality.score(answers, 1.0)) >= set(quality.TOOL_SCORES)


def test_a_tool_schema_is_judged_without_fetching_its_references_and_its_patterns_end(tmp_path, monkeypatch):
    """A dataset's schema is untrusted: a `$ref` outside it is refused in one line, never fetched (here a file://
    one that, fetched, would judge the call differently); one inside it resolves; a `pattern` whose nested
    repetition would run for hours under `re` on this answer ends (as not matched), and a plain one still
    matches."""
    import threading

    from tunebench.data import toolcalls

    def tools(params):
        return [{"type": "function", "function": {"name": "f", "parameters": params}}]

    (tmp_path / "remote.json").write_text('{"type": "string"}')
    outside = {"type": "object", "properties": {"a": {"$ref": (tmp_path / "remote.json").as_uri()}}}
    from tunebench.core.errors import TunebenchError

    with pytest.raises(TunebenchError, match="refer to 'file://.*outside the schema.*never fetches"):
        toolcalls.valid({"name": "f", "arguments": {"a": 1}}, tools(outside))
    inside = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "integer"}}}
    assert toolcalls.valid({"name": "f", "arguments": {"a": 1}}, tools(inside))
    assert not toolcalls.valid({"name": "f", "arguments": {"a": "1"}}, tools(inside))
    # a nested repetition the regex module cannot cut short (its optimiser decides ^(x+x+)+y$ at once, so that
    # pattern never reached the time limit it stood for)
    nested = tools({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a|aa)+$"}}})
    assert toolcalls.valid({"name": "f", "arguments": {"a": "aaa"}}, nested)
    got = []
    judge = threading.Thread(target=lambda: got.append(toolcalls.valid({"name": "f", "arguments": {"a": "a" * 40 + "b"}},
                                                                        nested)), daemon=True)
    judge.start()
    judge.join(30)  # generous on a slow machine: the limit is PATTERN_TIMEOUT_S
    assert got == [False]
    # many keys, each a slow match: the call's patterns share one limit (PATTERNS_TIMEOUT_S), not one each
    import regex

    limits, search = [], regex.search
    monkeypatch.setattr(regex, "search", lambda *a, timeout: limits.append(timeout) or search(*a, timeout=timeout))
    keys = tools({"type": "object", "patternProperties": {"^(a|aa)+$": {"type": "integer"}}})
    assert toolcalls.valid({"name": "f", "arguments": {"a" * (40 + i) + "b": 1 for i in range(30)}}, keys)
    assert len(limits) < 30 and sum(limits) <= toolcalls.PATTERNS_TIMEOUT_S + 1e-6  # was 30 x 0.2 s
    # additionalProperties matches patternProperties' keys too (jsonschema's own with `re`: 36.7 s on 31 characters,
    # N4): under the same limit now; unevaluatedProperties beside them is refused
    import types

    from jsonschema import _utils

    def unbounded(*args):
        raise AssertionError("a schema's pattern ran through re, with no time limit")

    monkeypatch.setattr(_utils, "re", types.SimpleNamespace(search=unbounded))
    limits.clear()
    closed = tools({"type": "object", "patternProperties": {"^(a|aa)+$": {"type": "integer"}},
                    "additionalProperties": False})
    assert not toolcalls.valid({"name": "f", "arguments": {"a" * 31 + "b": 1}}, closed)
    assert limits and sum(limits) <= toolcalls.PATTERNS_TIMEOUT_S + 1e-6  # every key's match went through the limit
    assert toolcalls.valid({"name": "f", "arguments": {"aa": 1}}, closed)
    assert not toolcalls.valid({"name": "f", "arguments": {"b": 1}}, closed)
    with pytest.raises(TunebenchError, match="pair patternProperties with unevaluatedProperties"):
        toolcalls.valid({"name": "f", "arguments": {"aa": 1}}, tools(
            {"type": "object", "patternProperties": {"^a+$": {}}, "unevaluatedProperties": False}))


def test_a_capped_answer_counts_as_not_stopped(tiny, monkeypatch):
    """Row 1 ends with EOS inside the cap; row 2 fills the cap without it."""
    tok, eos = tiny.tokenizer, tiny.tokenizer.eos_token_id
    a, b = tok.convert_tokens_to_ids(["a", "b"])

    def fake_decode(model, ids, mask, max_new_tokens, eos_, pad, temperature, *args, **kwargs):
        assert max_new_tokens == 3 and temperature is None and eos_ == eos
        return torch.tensor([[a, eos, tok.pad_token_id], [a, b, a]])

    monkeypatch.setattr("tunebench.model.decoding.decode", fake_decode)
    rows = [[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"}],
            [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "aba"}]]
    answers, _ = quality.generate_answers(inference.place(tiny, "cpu", "fp32"), rows, "auto", max_new_tokens=3)
    assert [(x.answer, x.tokens, x.stopped) for x in answers] == [("a", 2, True), ("aba", 3, False)]
    scores = quality.score(answers, 0.5)
    assert scores["eos_rate"] == 50.0 and scores["answer_tokens"] == 2.5 and scores["gen_tokens_per_s"] == 10.0
    assert tok.padding_side == "right"  # put back after left-padded generation


def test_plain_text_rows_have_nothing_to_score(tiny):
    with pytest.raises(Exception, match="no prompt/response rows"):
        quality.generate_answers(inference.place(tiny, "cpu", "fp32"), [[{"role": "text", "content": "hello"}]],
                                 "auto", 4)


@pytest.fixture
def tuned(tmp_path, dataset):
    out = tmp_path / "run"
    summary = finetune.run(load_config(options={
        "model.name": "tiny", "data.path": str(dataset), "data.max_length": 256, "train.max_steps": 2,
        "train.micro_batch_size": 4, "train.output_dir": str(out), "train.progress": False,
        "data.eval_fraction": 0.25, "train.eval_generate": 3, "train.eval_max_new_tokens": 6}))
    return out, summary


def test_training_scores_its_held_out_rows_at_the_end(tuned, dataset):
    out, summary = tuned
    for key in ("rougeL", "chrf", "eos_rate", "answer_tokens", "gen_tokens_per_s"):
        assert summary[key] is not None and json.loads((out / "summary.json").read_text())[key] == summary[key]
    lines = [json.loads(line) for line in (out / "eval_answers.jsonl").read_text().splitlines()]
    assert lines[0]["scores"]["rougeL"] == summary["rougeL"] and len(lines) == 4
    train_prompts = {r["instruction"] for r in map(json.loads, dataset.read_text().splitlines())}
    assert all(any(q in line["prompt"] for q in train_prompts) for line in lines[1:])
    assert all(line["tokens"] <= 6 for line in lines[1:])


def test_eval_base_vs_tuned_is_one_table_on_the_same_held_out_rows(tuned, dataset, tmp_path, capsys):
    out, _ = tuned
    code = cli.main(["eval", "--adapter", str(out), "--base", "--data", str(dataset), "--max-length", "256",
                     "--generate", "3", "--max-new-tokens", "6", "--output-dir", str(tmp_path / "ev")])
    assert code == 0
    said = capsys.readouterr().out
    header, base_row, tuned_row = said.splitlines()[:3]
    assert header.split()[:4] == ["model", "rows", "eval_loss", "perplexity"] and "rougeL" in header
    assert base_row.startswith("base ") and tuned_row.startswith("run ")
    assert f"generated for the held-out rows of {out}" in said
    answers = {name: [json.loads(x) for x in (tmp_path / "ev" / f"answers-{name}.jsonl").read_text().splitlines()[1:]]
               for name in ("base", "run")}
    assert [a["prompt"] for a in answers["base"]] == [a["prompt"] for a in answers["run"]]
    held = [json.loads(x)["prompt"] for x in (out / "eval_answers.jsonl").read_text().splitlines()[1:]]
    assert [a["prompt"] for a in answers["run"]] == held  # the rows training held out, in its format
    scores = json.loads((tmp_path / "ev" / "scores.json").read_text())
    assert set(scores) == {"base", "run"} and scores["run"]["generated"] == 3


def test_eval_generate_refuses_bad_counts(dataset, capsys):
    assert cli.main(["eval", "--model", "tiny", "--data", str(dataset), "--generate", "-1"]) == 2
    assert "--generate must be 0 or more" in capsys.readouterr().err
    assert cli.main(["eval", "--model", "tiny", "--base"]) == 2
    assert "--base compares a base model with its adapters" in capsys.readouterr().err


def test_train_eval_generate_without_held_out_rows_is_refused_before_loading(dataset, tmp_path):
    from tunebench.core.errors import TunebenchError

    with pytest.raises(TunebenchError, match="holds none out"):
        finetune.run(load_config(options={
            "model.name": "tiny", "data.path": str(dataset), "train.output_dir": str(tmp_path / "o"),
            "data.eval_fraction": 0.0, "train.eval_generate": 2, "train.max_steps": 1}))


def test_pareto_front_and_the_quality_chart():
    pts = [("a", 100.0, 30.0), ("b", 200.0, 20.0), ("c", 150.0, 10.0), ("d", 200.0, 25.0), ("e", 50.0, 30.0)]
    assert [p[0] for p in report.pareto_front(pts, higher=True)] == ["d", "a"]
    # eval loss: lower is better
    assert [p[0] for p in report.pareto_front(pts, higher=False)] == ["b", "c"]

    class Cell:
        def __init__(self, tps, rouge):
            self.values = {"tokens_per_s": tps, "rougeL": rouge}

        def median(self, key):
            return self.values.get(key)

    cells = {"cpu": {"bs1": Cell(100.0, 30.0), "bs4": Cell(200.0, 20.0)}, "cuda": {"bs4": Cell(900.0, 29.0)}}
    key, label, higher, points = report.quality_points(cells)
    assert key == "rougeL" and higher and len(points) == 3
    png = report.quality_chart(cells)
    assert png.startswith(b"\x89PNG")


def test_rows_keep_the_example_they_came_from_past_truncation(tmp_path, tiny):
    """Tokenized.rows maps each kept example to its row, so held-out rows are found after drops."""
    from tunebench.data.tokenize import tokenize_messages

    cfg = load_config(options={"data.max_length": 8, "data.template": "{instruction}"}).data
    rows = [[{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "long prompt"}],
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]]
    data = tokenize_messages(rows, tiny.tokenizer, cfg, "instruction")
    assert data.dropped == 1 and data.rows.tolist() == [1]


@pytest.fixture
def gsm8k_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": f"Tom has {i} apples and buys 2 more. How many?",
                                        "answer": f"{i}+2={i + 2}\n#### {i + 2:,}"}) + "\n" for i in range(998, 1004)))
    return path


def test_lm_eval_runs_its_gsm8k_task_offline_over_a_local_file(gsm8k_file, tmp_path, capsys):
    needs_module("lm_eval", "lm-eval is in the test extra; pip install 'tunebench[lm-eval]'")
    assert cli.main(["eval", "--model", "tiny", "--lm-eval", "gsm8k_local", "--data", str(gsm8k_file),
                     "--lm-eval-limit", "2", "--output-dir", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "tiny" / "lm_eval.json").read_text())
    scores = saved["results"]["gsm8k_local"]
    samples = [json.loads(x) for x in (tmp_path / "out" / "tiny" / "lm_eval_samples.jsonl").read_text().splitlines()]
    assert sorted({s["target"] for s in samples}) == ["998+2=1000\n#### 1,000", "999+2=1001\n#### 1,001"]
    # the random tiny model's answers, as each of lm-eval's filters took them ([invalid], or a stray digit), match
    # no target's number: exactly 0, as the score must say
    assert all(s["filtered"][0] != s["target"].split("#### ")[1].replace(",", "") for s in samples)
    assert scores["sample_len"] == 2 and scores["exact_match,flexible-extract"] == 0.0
    assert '"label": "tiny"' in capsys.readouterr().out


@pytest.mark.parametrize("says,expected", [("so 1000 + 0 = 1,000.\n#### 1,000", 1.0), ("#### 999", 0.0)])
def test_the_local_gsm8k_task_scores_a_right_answer_as_lm_eval_does(gsm8k_file, tmp_path, monkeypatch, says, expected):
    needs_module("lm_eval", "lm-eval is in the test extra; pip install 'tunebench[lm-eval]'")
    from lm_eval.models.huggingface import HFLM

    from tunebench.jobs import evaluate

    monkeypatch.setattr(HFLM, "generate_until", lambda self, requests, disable_tqdm=False: [says for _ in requests])
    result = evaluate.lm_eval("tiny", None, evaluate.LmEvalAsk("gsm8k_local", str(gsm8k_file), limit=1))
    assert result["lm_eval"]["gsm8k_local"]["exact_match,strict-match"] == expected


def test_lm_eval_refusals(gsm8k_file, capsys):
    needs_module("lm_eval", "lm-eval is in the test extra")
    assert cli.main(["eval", "--model", "tiny", "--lm-eval", "gsm8k_local"]) == 2
    assert "pass it with --data FILE" in capsys.readouterr().err
    assert cli.main(["eval", "--model", "tiny", "--lm-eval", "no_such_task", "--data", str(gsm8k_file)]) == 2
    assert "lm-eval knows no task no_such_task" in capsys.readouterr().err


def test_a_dataset_whose_tool_schema_refers_outside_itself_is_refused_before_the_model_loads(tmp_path, capsys,
                                                                                               monkeypatch):
    """Such rows trained every epoch and were refused only when --eval-generate scored the first call (exit 2 after
    the whole run): the schemas are checked when the data loads, in one line, before any weight; a `$ref` inside
    its schema is fine."""
    import json

    from tunebench.interfaces.cli import main
    from tunebench.jobs.parts import finetune_model

    def rows(ref):
        tools = [{"type": "function", "function": {"name": "f", "description": "F.", "parameters": {
            "type": "object", "properties": {"a": {"$ref": ref}}, "$defs": {"n": {"type": "integer"}}}}}]
        turns = [{"role": "user", "content": "Call f."}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]
        return "".join(json.dumps({"messages": turns, "tools": tools}) + "\n" for _ in range(12))

    (tmp_path / "outside.jsonl").write_text(rows("https://example.com/n.json"))
    monkeypatch.setattr(finetune_model, "load", lambda *a: pytest.fail("the model loaded"))
    args = ["train", "--model", "tiny", "--effective-batch-size", "4", "--max-steps", "1", "--precision", "fp32"]
    assert main([*args, "--data", str(tmp_path / "outside.jsonl"), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the data's tool f: its parameters refer to 'https://example.com/n.json'" in err[0], err
    assert not (tmp_path / "out").exists()
    from tunebench.data import formats, toolcalls  # a $ref inside the schema passes the same check
    inside = [formats.Conversation([], json.loads(rows("#/$defs/n").splitlines()[0])["tools"])]
    toolcalls.check_schemas(inside)
