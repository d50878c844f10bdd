import csv
import json

import numpy as np
import pytest
import torch

from conftest import ROWS
from tunebench.core.errors import TunebenchError
from tunebench.data import batching, formats, readers, sample_gen
from tunebench.data.tokenize import DEFAULT_PROMPT, load_tokenized, split, tokenize_messages
from tunebench.model.models import byte_tokenizer
from tunebench.settings.finetune import DataConfig


def _write(tmp_path, kind):
    if kind == "csv":
        p = tmp_path / "d.csv"
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["instruction", "response"])
            w.writeheader()
            w.writerows(ROWS)
    elif kind == "json":
        p = tmp_path / "d.json"
        p.write_text(json.dumps(ROWS))
    elif kind == "jsonl":
        p = tmp_path / "d.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), p)
    else:
        import datasets

        p = tmp_path / "hfdir"
        datasets.Dataset.from_list(ROWS).save_to_disk(str(p))
    return p


@pytest.mark.parametrize("kind", ["csv", "json", "jsonl", "parquet", "hfdir"])
def test_readers_give_the_same_records(tmp_path, kind):
    assert readers.read_records(str(_write(tmp_path, kind))) == ROWS


def test_format_detection():
    cfg = DataConfig()
    assert formats.detect({"instruction", "response", "intent"}, cfg) == "instruction"
    assert formats.detect({"instruction", "input", "output"}, cfg) == "alpaca"
    assert formats.detect({"messages"}, cfg) == "chat"
    assert formats.detect({"text"}, cfg) == "text"
    assert formats.detect({"question", "answer"}, cfg) == "question"  # GSM8K's columns
    with pytest.raises(TunebenchError, match="cannot tell the dataset format"):
        formats.detect({"prompt_text", "reply"}, cfg)


def test_alpaca_input_joins_the_prompt():
    msgs = formats.to_messages({"instruction": "Sum", "input": "2 and 3", "output": "5"}, "alpaca", DataConfig())
    assert msgs == [{"role": "user", "content": "Sum\n\n2 and 3"}, {"role": "assistant", "content": "5"}]


def test_response_only_masking_is_exact():
    tok = byte_tokenizer()
    tok.chat_template = None  # plain prompt template: byte tokens make positions easy to check
    cfg = DataConfig(max_length=512)
    data = tokenize_messages([[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]],
                             tok, cfg, "instruction")
    ids, mask = data.example(0)
    prompt = DEFAULT_PROMPT.format(instruction="hi")
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert mask[:n_prompt].sum() == 0  # no loss on the prompt
    assert mask[n_prompt:].all()  # loss on every response token, EOS included
    assert ids[-1] == tok.eos_token_id  # the model learns to stop
    assert tok.decode(ids[n_prompt:-1]) == "yo"


def test_train_on_all_and_chat_template_turns():
    tok = byte_tokenizer()
    cfg = DataConfig(max_length=512, train_on="all")
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    data = tokenize_messages([chat], tok, cfg, "chat")
    assert data.example(0)[1].all()
    data = tokenize_messages([chat], tok, DataConfig(max_length=512), "chat")
    ids, mask = data.example(0)
    trained = tok.decode(ids[mask.astype(bool)])
    assert trained == "b<|im_end|>\nd<|im_end|>\n"  # both assistant turns, nothing else


def test_truncation_and_drop():
    tok = byte_tokenizer()
    tok.chat_template = None
    long_prompt = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "y"}]
    ok = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer"}]
    data = tokenize_messages([long_prompt, ok], tok, DataConfig(max_length=40), "instruction")
    assert len(data) == 1 and data.dropped == 1
    assert data.lengths().max() <= 40


def test_empty_after_truncation_is_an_error(tmp_path, dataset):
    tok = byte_tokenizer()
    with pytest.raises(TunebenchError, match="empty after tokenization.*--max-length"):
        load_tokenized(DataConfig(path=str(dataset), max_length=4), tok, None)


def test_bad_files(tmp_path):
    with pytest.raises(TunebenchError, match="not found"):
        readers.read_records(str(tmp_path / "missing.csv"))
    bad = tmp_path / "latin1.csv"
    bad.write_bytes("instruction,response\ncaf\xe9,ok\n".encode("latin-1"))
    with pytest.raises(TunebenchError, match="not UTF-8"):
        readers.read_records(str(bad))
    cols = tmp_path / "cols.csv"
    cols.write_text("prompt_text,reply\nq,a\n")
    with pytest.raises(TunebenchError, match="cannot tell the dataset format"):
        formats.records_to_messages(readers.read_records(str(cols)), DataConfig(), str(cols))
    with pytest.raises(TunebenchError, match="lacks column"):
        formats.records_to_messages(readers.read_records(str(cols)), DataConfig(format="instruction"), str(cols))
    empty = tmp_path / "empty.csv"
    empty.write_text("instruction,response\n")
    with pytest.raises(TunebenchError, match="has no rows"):
        formats.records_to_messages(readers.read_records(str(empty)), DataConfig(), str(empty))
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(TunebenchError, match="line 2 is not valid JSON"):
        readers.read_records(str(broken))


def test_custom_columns(tmp_path):
    p = tmp_path / "qa.csv"
    p.write_text("question,answer\nwhat,that\n")
    cfg = DataConfig(path=str(p), instruction_column="question", response_column="answer", max_length=512)
    data = load_tokenized(cfg, byte_tokenizer(), None)
    assert len(data) == 1 and data.fmt == "instruction"


def test_tokenized_cache_is_reused_and_invalidated(tmp_path, dataset):
    tok = byte_tokenizer()
    cfg = DataConfig(path=str(dataset), max_length=256)
    first = load_tokenized(cfg, tok, tmp_path)
    files = list((tmp_path / "tokenized").glob("*.npz"))
    assert len(files) == 1
    again = load_tokenized(cfg, tok, tmp_path)
    assert np.array_equal(first.ids, again.ids) and again.fmt == "instruction"
    load_tokenized(DataConfig(path=str(dataset), max_length=64), tok, tmp_path)
    assert len(list((tmp_path / "tokenized").glob("*.npz"))) == 2  # max_length is part of the key


def test_split_is_seeded_and_disjoint():
    a_train, a_eval = split(100, 0.05, 1, None)
    b_train, b_eval = split(100, 0.05, 1, None)
    assert np.array_equal(a_eval, b_eval) and len(a_eval) == 5
    assert not set(a_train) & set(a_eval) and len(a_train) + len(a_eval) == 100
    train, ev = split(100, 0.1, 1, 20)
    assert len(train) + len(ev) == 20 and len(ev) == 2
    assert not np.array_equal(split(100, 0.05, 2, None)[1], a_eval)


def test_collate_pads_and_masks():
    tok = byte_tokenizer()
    tok.chat_template = None
    data = tokenize_messages([[{"role": "user", "content": "a"}, {"role": "assistant", "content": "bb"}],
                              [{"role": "user", "content": "aaaa"}, {"role": "assistant", "content": "b"}]],
                             tok, DataConfig(max_length=512), "instruction")
    b = batching.collate(data, [0, 1], tok.pad_token_id)
    lengths = data.lengths()
    assert b["input_ids"].shape == (2, lengths.max())
    assert b["attention_mask"].sum().item() == lengths.sum()
    short = int(np.argmin(lengths))
    assert (b["labels"][short, lengths[short]:] == batching.IGNORE).all()
    # a CPU's bf16: the width rounded up to a multiple (never past the cap, never below the longest), the rows'
    # tokens and loss as before
    rounded = batching.collate(data, [0, 1], tok.pad_token_id, multiple=16, cap=512)
    assert rounded["input_ids"].shape == (2, -(-lengths.max() // 16) * 16) and rounded["input_ids"].shape[1] % 16 == 0
    assert rounded["attention_mask"].sum().item() == lengths.sum()
    assert torch.equal(rounded["labels"][:, : lengths.max()], b["labels"]) and (
        rounded["labels"][:, lengths.max():] == batching.IGNORE).all()
    assert batching.padded_width(17, 16, 20) == 20 and batching.padded_width(17, 16, 10) == 17
    assert batching.padded_width(17) == 17 == batching.padded_width(17, 1, 512)
    assert batching.pad_multiple("cpu", "bf16").value == 16
    assert batching.pad_multiple("cpu", "fp32").value == batching.pad_multiple("cuda", "bf16").value == 1


def test_epoch_order_is_reproducible():
    idx = np.arange(10)
    assert batching.epoch_order(idx, 3, 0, 1) == batching.epoch_order(idx, 3, 0, 1)
    assert batching.epoch_order(idx, 3, 0, 1) != batching.epoch_order(idx, 3, 0, 2)
    assert sorted(sum(batching.epoch_order(idx, 3, 0, 1), [])) == list(range(10))


def test_builtin_sample_is_what_the_generator_writes():
    assert sample_gen.OUT.read_text(encoding="utf-8") == sample_gen.render()
    rows = readers.read_records("builtin:customer-support")
    assert len(rows) >= 2000 and len({r["intent"] for r in rows}) >= 20
    assert set(rows[0]) == {"instruction", "response", "intent", "category"}


def test_bitext_csv_reads_as_instruction_data(bitext):
    rows = readers.read_records(str(bitext))
    assert len(rows) == 4514
    fmt, msgs = formats.records_to_messages(rows[:5], DataConfig(), str(bitext))
    assert fmt == "instruction" and msgs[0][1]["role"] == "assistant"


def test_pack_rows_first_fit_decreasing():
    rows = batching.pack_rows([5, 3, 8, 2], capacity=10)
    assert sorted(map(sorted, rows)) == [[0, 1], [2, 3]]  # 8 + 2 fill one row, 5 + 3 the other
    assert all(sum([5, 3, 8, 2][k] for k in row) <= 10 for row in rows)
    assert sorted(k for row in rows for k in row) == [0, 1, 2, 3]


def test_padding_fraction_counts_what_collate_computes():
    lengths = np.array([10, 2, 6, 6])
    assert batching.padding_fraction(lengths, [[0, 1], [2, 3]]) == pytest.approx(1 - 24 / 32)
    assert batching.padding_fraction(lengths, [[0, 1], [2, 3]], packed_capacity=12) == pytest.approx(0.0)


def test_packed_batch_layout():
    tok = byte_tokenizer()
    tok.chat_template = None
    cfg = DataConfig(max_length=512, train_on="all", format="text")
    data = tokenize_messages([[{"role": "text", "content": "abc"}], [{"role": "text", "content": "de"}]],
                             tok, cfg, "text")
    b = batching.collate_packed(data, [0, 1], tok.pad_token_id, capacity=64)
    assert b["input_ids"].shape == (1, 7)  # "abc<eos>" + "de<eos>" in one row
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert b["labels"][0, 4].item() == batching.IGNORE  # the second example's first token is nobody's target
    assert b["attention_mask"].sum().item() == 7


def test_length_grouped_order_has_little_padding_and_is_reproducible():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 200, size=640)
    idx = np.arange(640)
    # micro-batches of 2 out of steps of 16: sorting a step by length pairs neighbours in length
    plain = batching.epoch_order(idx, 2, 0, 0, effective_batch_size=16)
    grouped = batching.epoch_order(idx, 2, 0, 0, lengths=lengths, effective_batch_size=16)
    assert grouped == batching.epoch_order(idx, 2, 0, 0, lengths=lengths, effective_batch_size=16)
    assert sorted(sum(grouped, [])) == list(range(640))  # every row once
    assert batching.padding_fraction(lengths, grouped) < 0.5 * batching.padding_fraction(lengths, plain)
    assert grouped != batching.epoch_order(idx, 2, 0, 1, lengths=lengths, effective_batch_size=16)  # per epoch


@pytest.mark.parametrize("rows, message", [
    ([{"instruction": "a", "response": "b"}, {"instruction": "c"}], "row 2 lacks column 'response'"),
    ([{"messages": [{"role": "user", "content": "hi"}, "not a turn"]}], "row 1: .*holds str 'not a turn'"),
])
def test_a_bad_row_later_in_the_file_names_its_row(tmp_path, rows, message):
    """A row missing a column after the first (or a chat turn that is not an object) was a bare KeyError or
    AttributeError: now one line naming the row."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TunebenchError, match=message):
        formats.records_to_messages(readers.read_records(str(path)), DataConfig(), str(path))


def _tool_rows(n: int) -> list[dict]:
    """The issue's file: OpenAI's fine-tuning format, a tool call with JSON arguments, its result, the answer."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    return [{"messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": f"Weather in city {i}?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": f"city {i}"})}}]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny"},
        {"role": "assistant", "content": f"It is sunny in city {i}."}], "tools": tools} for i in range(n)]


def _pieces(row, tok, **data):
    from tunebench.data import tokenize

    cfg = DataConfig(**data)
    tokenize.use_template([row], tok, cfg)
    seg = tokenize.segments(row, tok, cfg)
    return "".join(t for t, loss in seg if loss), "".join(t for t, loss in seg if not loss)


def test_the_issues_tool_call_file_trains_its_calls_and_never_the_results_or_definitions(tmp_path, capsys):
    """48 rows in OpenAI's fine-tuning format (tools, a call with JSON-string arguments, its result, the answer)
    were trained as empty replies: now the tool template renders every part (the model's own has no tools), the
    loss falls on the call and the answer only, prepare shows the row so, and the run records and saves the
    template that exports carry."""
    from tunebench.data import toolcalls
    from tunebench.interfaces import cli
    from tunebench.model import models

    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _tool_rows(48)))
    fmt, rows = formats.records_to_messages(readers.read_records(str(path)), DataConfig(), str(path))
    tok = models.resolve("tiny").tokenizer
    learned, unlearned = _pieces(rows[0], tok)
    assert tok.chat_template == toolcalls.TEMPLATE
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "city 0"}}\n</tool_call>' in learned
    assert "It is sunny in city 0." in learned
    assert "<tool_response>\nsunny\n</tool_response>" in unlearned and '"name": "get_weather", "parameters"' in unlearned
    assert "sunny\n</tool_response>" not in learned and "<tools>" not in learned
    learned, unlearned = _pieces(rows[0], tok, train_on="final")  # the loss on the final answer alone
    assert "It is sunny in city 0." in learned and "<tool_call>" in unlearned and "<tool_call>" not in learned

    assert cli.main(["prepare", "--data", str(path), "-o", str(tmp_path / "prepared"), "--model", "tiny"]) == 0
    said = capsys.readouterr().out
    assert "chat template: hermes-tools" in said and '[[<tool_call>\n{"name": "get_weather"' in said
    out = tmp_path / "run"
    assert cli.main(["train", "--model", "tiny", "--data", str(path), "--output-dir", str(out), "--max-steps", "1",
                     "--no-progress", "--precision", "fp32", "--max-length", "512"]) == 0
    plan = {d["setting"]: d for d in json.loads((out / "plan.json").read_text())["decisions"]}
    assert plan["chat_template"]["value"] == "hermes-tools" and "saved with the run" in plan["chat_template"]["reason"]
    assert models.load_tokenizer(str(out)).chat_template == toolcalls.TEMPLATE  # what exports and serving render


def test_train_with_no_max_length_keeps_tool_rows_whole_and_says_why(tmp_path, capsys):
    """Issue 68: --max-length 128 by default refused every tool-call row ("all 48 examples lost their response to
    truncation"). auto is train's default: the length that keeps 99% of the rows whole, rounded up to 64, within the
    model's positions, in the settings table with its reason; a number asked for is used as given."""
    from tunebench.data.tokenize import tokenize_messages, use_template
    from tunebench.interfaces import cli
    from tunebench.model import models

    rows = [{"messages": r["messages"][1:3], "tools": r["tools"]} for r in _tool_rows(24)]  # a question and its call
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, messages = formats.records_to_messages(rows, DataConfig(), "x")
    tok = models.resolve("tiny").tokenizer
    whole = DataConfig(max_length=10**9)
    use_template(messages, tok, whole)
    lengths = tokenize_messages(messages, tok, whole, "chat").lengths()
    assert 128 < lengths.max() <= 448  # longer than the old default, within tiny's 512 positions
    want = -(-int(np.ceil(np.percentile(lengths, 99))) // 64) * 64
    out = tmp_path / "run"
    assert cli.main(["train", "--model", "tiny", "--data", str(path), "--output-dir", str(out), "--max-steps", "1",
                     "--no-progress", "--precision", "fp32"]) == 0
    plan = {d["setting"]: d for d in json.loads((out / "plan.json").read_text())["decisions"]}
    assert plan["max_length"]["value"] == want >= lengths.max()
    assert plan["max_length"]["reason"].startswith("auto: 99% of the rows have") and "0 of 24 rows are longer" \
        in plan["max_length"]["reason"]
    assert json.loads((out / "summary.json").read_text())["max_length"] == want
    capsys.readouterr()
    assert cli.main(["train", "--model", "tiny", "--data", str(path), "--output-dir", str(tmp_path / "short"),
                     "--max-steps", "1", "--no-progress", "--precision", "fp32", "--max-length", "64"]) == 2
    assert "lost their response to truncation at --max-length 64" in capsys.readouterr().err


def test_reasoning_is_rendered_and_trained_unless_masked_and_sharegpt_calls_map_onto_the_same(tmp_path):
    from tunebench.model import models

    tok = models.resolve("tiny").tokenizer
    for field in formats.REASONING_FIELDS:
        rec = {"messages": [{"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "4", field: "Two and two make four."}]}
        _, (row,) = formats.records_to_messages([rec], DataConfig(), "x")
        learned, unlearned = _pieces(row, tok)
        assert "<think>\nTwo and two make four.\n</think>\n\n4" in learned, field
        learned, unlearned = _pieces(row, tok, train_reasoning=False)
        assert "Two and two make four." in unlearned and "</think>" in unlearned and learned.startswith("4")
    share = {"conversations": [{"from": "human", "value": "Weather?"},
                               {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
                               {"from": "observation", "value": "rain"}, {"from": "gpt", "value": "Rain."}],
             "tools": '[{"name": "get_weather", "parameters": {"type": "object"}}]'}  # LLaMA-Factory's string
    _, (row,) = formats.records_to_messages([share], DataConfig(), "x")
    assert row[1]["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Oslo"}}}]
    assert row[2]["role"] == "tool" and row.tools[0]["function"]["name"] == "get_weather"
    learned, unlearned = _pieces(row, tok)
    assert '"arguments": {"city": "Oslo"}' in learned and "rain" in unlearned and "Rain." in learned


def test_a_row_the_template_would_render_half_is_refused_or_dropped_and_bad_calls_are_one_line(tmp_path):
    """A template that renders tool calls but not reasoning passes the first row's check and would lose the
    second row's trace: refused, naming the row and what it lacks, or left out and counted."""
    from tunebench.data import tokenize
    from tunebench.model import models

    tok = models.resolve("tiny").tokenizer
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
                         "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    records = [{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}]},
               {"messages": [{"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}]}]
    _, rows = formats.records_to_messages(records, DataConfig(), "x")
    assert tokenize.use_template(rows, tok, DataConfig()) is None  # its own renders the first row whole
    with pytest.raises(TunebenchError, match="row 2's text lacks message 2's reasoning.*--on-unrenderable drop"):
        tokenize.tokenize_messages(rows, tok, DataConfig(), "chat")
    kept = tokenize.tokenize_messages(rows, tok, DataConfig(on_unrenderable="drop"), "chat")
    assert len(kept) == 1 and kept.unrendered == 1 and kept.rows.tolist() == [0]
    with pytest.raises(TunebenchError, match="prompt format"):
        tokenize.use_template(rows, tok, DataConfig(template="Q: {instruction}\nA: "))
    bad = [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{city: 1}"}}]}]}]
    with pytest.raises(TunebenchError, match="row 1: message 2's arguments to f is not JSON"):
        formats.records_to_messages(bad, DataConfig(), "x")


def test_xlam_rows_read_and_render_as_the_same_rows_in_openai_form(tmp_path):
    """Issue 68: Salesforce's xlam-function-calling-60k form (query, tools and answers, the last two JSON strings,
    parameters as {name: {type, description, default}}) was refused for its columns. Each row is now a user turn
    and one assistant turn of calls, its tools a JSON Schema object: the text, and what the loss falls on, equal
    the same row written in OpenAI's form."""
    from tunebench.model import models

    xlam = {"id": 7, "query": "Where is Kyoto, and what is 2 to the 10th?",
            "answers": json.dumps([{"name": "locate", "arguments": {"city": "Kyoto"}},
                                   {"name": "power", "arguments": {"base": 2, "exponent": 10}}]),
            "tools": json.dumps([
                {"name": "locate", "description": "Find a city.",
                 "parameters": {"city": {"description": "The city.", "type": "str", "default": ""}}},
                {"name": "power", "description": "Raise a number to a power.",
                 "parameters": {"base": {"description": "The base.", "type": "int"},
                                "exponent": {"description": "The power.", "type": "int, optional"}}}])}
    openai = {"messages": [{"role": "user", "content": xlam["query"]}, {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "a", "type": "function", "function": {"name": "locate", "arguments": '{"city": "Kyoto"}'}},
                  {"id": "b", "type": "function", "function": {"name": "power",
                                                               "arguments": '{"base": 2, "exponent": 10}'}}]}],
              "tools": [{"type": "function", "function": {"name": "locate", "description": "Find a city.", "parameters": {
                  "type": "object", "properties": {"city": {"type": "string", "description": "The city.", "default": ""}}}}},
                        {"type": "function", "function": {"name": "power", "description": "Raise a number to a power.",
                                                          "parameters": {"type": "object", "properties": {
                                                              "base": {"type": "integer", "description": "The base."},
                                                              "exponent": {"type": "integer", "description": "The power."}},
                                                              "required": ["base"]}}}]}
    path = tmp_path / "xlam.jsonl"
    path.write_text(json.dumps(xlam) + "\n")
    fmt, (row,) = formats.records_to_messages(readers.read_records(str(path)), DataConfig(), str(path))
    _, (same,) = formats.records_to_messages([openai], DataConfig(), "openai")
    for call in same[1]["tool_calls"]:
        call.pop("id")  # xLAM's calls carry no ids; a template that renders ids would differ by them alone
    assert fmt == "xlam" and row == same and row.tools == same.tools
    tok = models.resolve("tiny").tokenizer
    assert _pieces(row, tok) == _pieces(same, tok)
    learned, unlearned = _pieces(row, tok)
    assert '{"name": "power", "arguments": {"base": 2, "exponent": 10}}' in learned and "Find a city." in unlearned
    with pytest.raises(TunebenchError, match="row 1: the row's answers are dict, not a list of calls"):
        formats.records_to_messages([{**xlam, "answers": "{}"}], DataConfig(), "x")


def test_a_reply_in_the_tool_template_reads_back_as_its_calls():
    from tunebench.data import toolcalls

    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": broken}\n</tool_call>')
    said, calls = toolcalls.parse(text)
    assert calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert said.startswith("Let me check.") and "broken" in said  # a call that does not parse stays text
    # what a policy may write in 512 tokens of "[[[[": nested past Python's recursion limit, no call (was an
    # uncaught RecursionError, ending a GRPO run or an API request)
    deep = '<tool_call>\n{"name": "f", "arguments": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}\n</tool_call>"
    said, calls = toolcalls.parse("Hm. " + deep)
    assert calls == [] and said.startswith("Hm.")
