"""model/decoding.py: the batched decoding loop GRPO samples with, against transformers' generate (greedy, the
same tokens) and against the distribution it samples from."""

import pytest
import torch

from tunebench.model import decoding


def _left_padded(tok, texts):
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_row_of_a_left_padded_batch_decodes_as_generate_decodes_it_alone(family):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tunebench.model.models import resolve

    loaded = resolve("tiny")
    tok = loaded.tokenizer
    if family == "gpt2":  # learned positions: a left-padded row's must start at 0
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=2,
                                           initializer_range=0.5)).eval()  # logits far from flat: argmax tells
    else:
        model = loaded.model.eval()
    kernel = model.config._attn_implementation
    texts = ["Hello there, how are", "Hi", "The order number is 12"]
    ids, mask = _left_padded(tok, texts)
    ours = decoding.decode(model, ids, mask, 12, tok.eos_token_id, tok.pad_token_id)
    assert model.config._attn_implementation == kernel  # eager only while decoding
    for row, text in zip(ours.tolist(), texts):  # each row as generate makes it alone, with no padding
        alone = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        theirs = model.generate(input_ids=alone, attention_mask=torch.ones_like(alone), do_sample=False,
                                max_new_tokens=12, pad_token_id=tok.pad_token_id,
                                eos_token_id=tok.eos_token_id)[0, alone.shape[1]:].tolist()
        assert row[:len(theirs)] == theirs and all(t == tok.pad_token_id for t in row[len(theirs):])


def test_grouped_attention_gives_eager_attentions_logits_over_a_growing_caches_views():
    """Decoding on a CPU runs grouped_attention for a model whose key/value heads serve several query heads (the
    tiny model: 4 query heads, 2 key/value heads): left-padded prefill and one-token steps over GrowingLayer's
    strided views give transformers' eager attention's logits over the whole context (fp32)."""
    from tunebench.model.models import resolve

    loaded = resolve("tiny")
    tok, model = loaded.tokenizer, loaded.model.eval()
    assert model.model.layers[0].self_attn.num_key_value_groups == 2
    ids, mask = _left_padded(tok, ["Hello there, how are you", "Hi", "The order number is"])
    nxt = torch.tensor([[7], [9], [11]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    whole_ids, whole_mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        theirs = model(input_ids=whole_ids, attention_mask=whole_mask,
                       position_ids=(whole_mask.cumsum(-1) - 1).clamp(min=0)).logits
        with decoding.eager_attention(model, ids.device):
            assert model.config._attn_implementation == decoding.GROUPED
            kw = decoding.cache_keyword(model)
            first = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                          **{kw: decoding.growing_cache()}, use_cache=True)
            step = model(input_ids=nxt, attention_mask=whole_mask, position_ids=positions[:, -1:] + 1,
                         **{kw: getattr(first, kw)}, use_cache=True)
    real = mask.bool()
    torch.testing.assert_close(first.logits[real], theirs[:, :-1][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.logits[:, -1], theirs[:, -1], rtol=1e-5, atol=1e-5)


def test_a_frozen_head_gets_whole_rows_while_decoding_and_the_tokens_are_the_same():
    """A prefill's last-position slice reaches the output head strided; with the head frozen (LoRA's base) torch's
    matmul would copy the head's weight once per row (whole_rows_to_head). Decoding, the head is given contiguous
    rows, in `decode` (either cache) and in Turns, and greedy tokens are those of the same decode without the hook."""
    from tunebench.model.models import resolve

    loaded = resolve("tiny")
    tok, model = loaded.tokenizer, loaded.model.eval()
    model.requires_grad_(False)
    ids, mask = _left_padded(tok, ["Hello there, how are you", "Hi", "The order number is"])
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].is_contiguous()))
    got = decoding.decode(model, ids, mask, 6, None, tok.pad_token_id)
    static = decoding.decode(model, ids, mask, 6, None, tok.pad_token_id, cache="static")
    turns = decoding.Turns().decode(model, [0, 1, 2], [r[m.bool()].tolist() for r, m in zip(ids, mask)], 6, None,
                                    tok.pad_token_id)
    assert seen and all(seen), seen
    seen.clear()
    with decoding.eager_attention(model, ids.device):  # what decode runs, less the hook: the head sees the slice
        bare = decoding._run(decoding._dynamic_steps(model, ids, mask), 3, 6, None, tok.pad_token_id, None, 1.0, 0,
                             None, True)
    assert not seen[0]
    assert torch.equal(got, bare) and torch.equal(static, bare) and torch.equal(turns, bare)


def test_sampling_draws_from_the_tempered_distribution_and_top_p_keeps_only_the_nucleus():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    want = torch.softmax(logits[0] / 0.7, -1)
    got = torch.bincount(decoding.sample_from(logits, 0.7, 1.0)[:, 0], minlength=4).float() / 20000
    assert got.tolist() == pytest.approx(want.tolist(), abs=0.012)
    # top_p 0.8: the two likeliest tokens hold 0.92 of the mass, and the first alone 0.73 < 0.8
    nucleus = torch.bincount(decoding.sample_from(logits, 0.7, 0.8)[:, 0], minlength=4).float() / 20000
    kept = want[:2] / want[:2].sum()
    assert nucleus[2:].tolist() == [0.0, 0.0] and nucleus[:2].tolist() == pytest.approx(kept.tolist(), abs=0.012)
    assert decoding.sample_from(logits[:2], None, 1.0).tolist() == [[0], [0]]
    # top_k 2: only the two likeliest tokens are ever drawn, in their tempered proportion
    top2 = torch.bincount(decoding.sample_from(logits, 0.7, 1.0, top_k=2)[:, 0], minlength=4).float() / 20000
    assert top2[2:].tolist() == [0.0, 0.0] and top2[:2].tolist() == pytest.approx(kept.tolist(), abs=0.012)


def test_each_sees_every_step_and_stops_the_decoding_when_it_says_so():
    from tunebench.model.models import resolve

    loaded = resolve("tiny")
    tok, model = loaded.tokenizer, loaded.model.eval()
    ids, mask = _left_padded(tok, ["Hello there", "Hi"])
    seen = []
    out = decoding.decode(model, ids, mask, 10, None, tok.pad_token_id, each=lambda t: seen.append(t.tolist()) or
                          len(seen) == 3)
    assert out.shape == (2, 3) and out.T.tolist() == seen
    assert decoding.decode(model, ids, mask, 0, None, tok.pad_token_id).shape == (2, 0)


@pytest.mark.parametrize("family,kernel", [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "sdpa")])
def test_the_static_cache_path_a_gpu_replays_as_a_graph_makes_the_same_tokens_as_the_dynamic_one(family, kernel):
    """On a CPU the static path runs its step eagerly: its inputs (token, position, the 4D mask over the
    cache's slots) are what a GPU's graph replays, so a wrong slot or position shows here as other tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tunebench.model.models import resolve

    loaded = resolve("tiny")
    tok = loaded.tokenizer
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=2,
                                           initializer_range=0.5)).eval()
    else:
        model = loaded.model.eval()
    model.config._attn_implementation = kernel
    assert decoding.static_ready(model)
    ids, mask = _left_padded(tok, ["Hello there, how are", "Hi", "The order number is 12"])
    dynamic = decoding.decode(model, ids, mask, 20, None, tok.pad_token_id, cache="dynamic")
    static = decoding.decode(model, ids, mask, 20, None, tok.pad_token_id, cache="static")
    assert static.tolist() == dynamic.tolist()
    # EOS: a row that ends is padded after, in both (the second row's 3rd token made the EOS here)
    eos = int(dynamic[1, 2])
    with_eos = [decoding.decode(model, ids, mask, 20, eos, tok.pad_token_id, cache=c) for c in ("dynamic", "static")]
    assert with_eos[0].tolist() == with_eos[1].tolist() and with_eos[0][1, 3:].eq(tok.pad_token_id).all()


def test_a_finished_row_leaves_the_batch_and_the_others_sample_what_they_would_have(monkeypatch):
    """Sampled in fp32: the dynamic cache drops each row at its EOS (transformers' batch_select_indices), the static
    path feeds it padding to the end; the same seed gives the same tokens both ways, because each step draws for
    every row (dropping a row's draw would shift the others'). The batches shrink as rows end."""
    from transformers import DynamicCache

    from tunebench.model.models import resolve

    loaded = resolve("tiny")
    tok, model = loaded.tokenizer, loaded.model.eval()
    ids, mask = _left_padded(tok, ["Hello there, how are", "Hi", "The order number is 12", "Where is"])
    torch.manual_seed(3)
    free = decoding.decode(model, ids, mask, 16, None, tok.pad_token_id, temperature=1.0)
    eos = int(free[1, 2])  # row 1's third token ends it; the others run on, some past it
    sizes = []
    select = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices",
                        lambda self, index: sizes.append(len(index)) or select(self, index))
    runs = {}
    for cache in ("dynamic", "static"):
        torch.manual_seed(3)
        runs[cache] = decoding.decode(model, ids, mask, 16, eos, tok.pad_token_id, temperature=1.0, cache=cache)
    assert runs["dynamic"].tolist() == runs["static"].tolist()
    ended = [row.index(eos) for row in runs["dynamic"].tolist() if eos in row]
    assert ended and sizes and sizes[0] < 4 and sizes == sorted(sizes, reverse=True)  # rows left, one by one
    assert any(eos not in row[:max(ended)] for row in runs["dynamic"].tolist())  # others went on past an end


def test_a_group_prefills_its_prompt_once_and_samples_what_every_row_prefilled_would(monkeypatch):
    """GRPO's n completions of a prompt: the prompt is prefilled once and its cache repeated for its rows
    (transformers' batch_repeat_interleave); sampled in fp32 with EOS, the tokens are those of the same rows each
    prefilled on their own, and of the static path (which repeats the prompt rows)."""
    from transformers import DynamicCache

    from tunebench.model.models import resolve

    loaded = resolve("tiny")
    tok, model = loaded.tokenizer, loaded.model.eval()
    ids, mask = _left_padded(tok, ["Hello there, how are", "Hi", "Where is"])
    repeated = []
    interleave = DynamicCache.batch_repeat_interleave
    monkeypatch.setattr(DynamicCache, "batch_repeat_interleave",
                        lambda self, n: repeated.append(n) or interleave(self, n))
    torch.manual_seed(5)
    eos = int(decoding.decode(model, ids, mask, 6, None, tok.pad_token_id, temperature=1.0, repeat=3)[4, 3])
    runs = []
    for rows, masks, repeat, cache in ((ids, mask, 3, "dynamic"), (ids.repeat_interleave(3, 0),
                                       mask.repeat_interleave(3, 0), 1, "dynamic"), (ids, mask, 3, "static")):
        torch.manual_seed(5)
        runs.append(decoding.decode(model, rows, masks, 12, eos, tok.pad_token_id, temperature=1.0, repeat=repeat,
                                    cache=cache).tolist())
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 9
    assert repeated == [3, 3]  # the first decode and the first run prefilled 3 prompts for 9 rows; the rest 9
    assert any(eos in row for row in runs[0]) and len({tuple(r) for r in runs[0][:3]}) > 1  # a group's rows differ


def test_turns_keep_each_rows_cache_and_make_the_tokens_of_decoding_whole_contexts():
    """GRPO's episodes over three turns, sampled in fp32: two rows share an opening (prefilled once), one is shorter
    (left padding), a row ends early at an EOS and leaves, one stops playing after the second turn, and each turn
    appends a tool turn of its own length. decoding.Turns feeds each row only what its cache lacks, and makes the
    tokens that decoding each turn's whole contexts afresh makes, with the same seed; it feeds far fewer tokens."""
    from tunebench.model.models import resolve

    loaded = resolve("tiny")
    tok, model = loaded.tokenizer, loaded.model.eval()
    opening, other = (tok(t, add_special_tokens=False)["input_ids"] for t in ("Hello there, how are", "Hi"))
    contexts = {0: list(opening), 1: list(opening), 2: list(other)}
    torch.manual_seed(0)  # the first turn's seed
    ids, mask = decoding.left_padded(list(contexts.values()), tok.pad_token_id, "cpu")
    free = decoding.decode(model, ids, mask, 8, None, tok.pad_token_id, temperature=1.0)
    eos = int(free[1, 2])  # row 1's third token ends it in the first turn
    turns, whole_tokens = decoding.Turns(), 0
    for turn in range(3):
        rows = [r for r in contexts if not (turn == 2 and r == 2)]  # row 2 stopped after turn two
        torch.manual_seed(turn)
        ids, mask = decoding.left_padded([contexts[r] for r in rows], tok.pad_token_id, "cpu")
        whole = decoding.decode(model, ids, mask, 8, eos, tok.pad_token_id, temperature=1.0, cache="dynamic")
        whole_tokens += int(mask.sum())
        torch.manual_seed(turn)
        kept = turns.decode(model, rows, [contexts[r] for r in rows], 8, eos, tok.pad_token_id, temperature=1.0)
        assert kept.tolist() == whole.tolist(), turn
        if turn == 0:
            assert eos in kept[1].tolist() and any(eos not in row for row in kept.tolist())  # one ended early
        for r, reply in zip(rows, kept.tolist()):
            reply = reply[:reply.index(eos) + 1] if eos in reply else reply
            contexts[r] += reply + tok(" result" * (r + 1), add_special_tokens=False)["input_ids"]  # a tool turn
    assert sorted(turns.kept) == [0, 1]  # row 2's cache dropped when it stopped playing
    assert turns.prefilled < whole_tokens / 3, (turns.prefilled, whole_tokens)
