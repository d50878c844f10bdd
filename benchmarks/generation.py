"""Generation alone, the part of GRPO (and eval --generate, serve) that costs most: tokens generated per second
by the built-in SmolLM2-135M-Instruct at batch 1, 8 and 32, 128 new tokens each (sampled at temperature 1 from
the whole vocabulary, EOS ignored so every row runs the full length), through

- `hf`: transformers' `generate` on the model as transformers loads it (fp32), the peer;
- `hf-static`: the same with `cache_implementation="static"` (on a GPU transformers then compiles the decoding
  step itself: its fast path); on a GPU only (--hf-static on a CPU);
- `hf-placed`: transformers' `generate` under inference.Placed (the precision and autocast a training run picks on
  this machine): what eval --generate, generate, chat and serve ran before they moved to the loop below;
- `tunebench`: inference.Placed.decode, model/decoding.py's loop under the same Placed: what GRPO's sampling,
  eval --generate, generate, chat, serve and its OpenAI API run (on a GPU its step is a CUDA graph);
- `tb-eager`: the same loop on transformers' DynamicCache, eager steps (on a GPU only: elsewhere it is
  `tunebench`);
- `llama.cpp`: the f16 GGUF of the same model (tunebench's own GGUF writer) through llama.cpp's C API
  (llama-cpp-python's bindings: every row a sequence of one batch, llama.cpp's own sampler), the physical
  reference: a C++ runtime built for this CPU, which GRPO cannot train through;

interleaved over --repeats rounds, each ratio against the peer in the same round; each path runs once untimed
before its first timed run at each batch size (first-call allocations and compiles out of the figures). First,
the greedy tokens of batch 8 (the same prompt, EOS ignored): `tunebench` and `tb-eager` against `hf-placed` (the
same weights under the same autocast), counted as equal rows.

    .venv/bin/python benchmarks/generation.py
    .venv/bin/python benchmarks/generation.py --batches 1 8 32 --new-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out (llama-cpp-python missing)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a preset or model directory")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (gpt2-124m where no tokenizer ships)")
    ap.add_argument("--hf-static", action="store_true", help="also time hf-static on a CPU")
    ap.add_argument("--check-args", action="store_true", help=argparse.SUPPRESS)  # gpu_session.sh --dry-run
    args = ap.parse_args()
    if args.check_args:
        from harness import check_imports  # benchmarks/harness.py: run as a script, this directory is on the path
        check_imports(__file__)
        return 0

    import torch

    from tunebench.model import decoding, inference, models

    loaded = models.resolve(args.model, args.tokenizer)
    tok = loaded.tokenizer
    device, precision, why = inference.placement()
    placed = inference.load(args.model, None, args.tokenizer)
    peer = loaded.model.eval().to(device)  # transformers' own load (fp32), on the device the others use
    question = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did she sell?")
    prompt = (tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                      add_generation_prompt=True) if tok.chat_template else question)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)

    def run(model, generate, batch: int) -> float:
        x = ids.repeat(batch, 1)
        kwargs = dict(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=0,
                      top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                      pad_token_id=tok.pad_token_id, use_cache=True)
        torch.manual_seed(0)
        began = time.perf_counter()
        out = generate(**kwargs)
        if x.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        return (out.shape[1] - x.shape[1]) * batch / seconds

    def hf(**kwargs):
        with torch.no_grad():
            return peer.generate(**kwargs)

    def hf_static(**kwargs):
        with torch.no_grad():
            return peer.generate(**kwargs, cache_implementation="static")

    def hf_placed(**kwargs):
        with placed.running() as model:
            return model.generate(**kwargs)

    def eager(input_ids, attention_mask, temperature, top_p, max_new_tokens, **_):
        with placed.running() as model:
            return torch.cat([input_ids, decoding.decode(model, input_ids, attention_mask, max_new_tokens, None,
                                                         tok.pad_token_id, temperature, top_p, cache="dynamic")], 1)

    def ours(input_ids, attention_mask, temperature, top_p, max_new_tokens, **_):
        # EOS ignored (eos None), as min_new_tokens makes generate do
        return torch.cat([input_ids, placed.decode(input_ids, attention_mask, max_new_tokens, temperature, top_p,
                                                   eos=None)], 1)

    # hf-static last: its first call at each batch size compiles, and a cut run keeps the figures before it
    paths = {"hf": hf, "tunebench": ours, "hf-placed": hf_placed, **({"tb-eager": eager} if device == "cuda" else {}),
             **({"hf-static": hf_static} if device == "cuda" or args.hf_static else {})}
    if not args.no_llama_cpp:
        paths["llama.cpp"] = LlamaCpp(loaded, max(args.batches), ids.shape[1] + args.new_tokens)
    greedy = {}
    x = ids.repeat(8, 1)
    for name in ("hf-placed", "tunebench", "tb-eager"):
        if name in paths:
            kwargs = dict(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id, use_cache=True)
            if name == "hf-placed":
                greedy[name] = hf_placed(**kwargs)[:, x.shape[1]:]
            else:
                with placed.running() as model:
                    greedy[name] = decoding.decode(model, x, kwargs["attention_mask"], args.new_tokens, None,
                                                   tok.pad_token_id, cache="dynamic" if name == "tb-eager" else "auto")
    for name in ("tunebench", "tb-eager"):
        if name in greedy:
            same = greedy[name].eq(greedy["hf-placed"])
            first = int(same.all(0).logical_not().nonzero()[0]) if not bool(same.all()) else None
            print(f"greedy, batch 8, {args.new_tokens} tokens: {name} against hf-placed: "
                  f"{int(same.all(1).sum())}/8 rows equal" + ("" if first is None else f", first difference at token {first}"))
    figures = {(p, b): [] for p in paths for b in args.batches}
    for r in range(args.repeats):
        for b in args.batches:
            for name, fn in paths.items():
                if r == 0:
                    began = time.perf_counter()
                    run(None, fn, b)  # warm-up: first-call allocations and compiles out of the figures
                    print(f"warm-up: {name:<10} batch {b:>3}: {time.perf_counter() - began:6.1f} s", flush=True)
                figures[(name, b)].append(run(None, fn, b))
                print(f"round {r + 1}: {name:<10} batch {b:>3}: {figures[(name, b)][-1]:8.1f} tokens/s", flush=True)
    where = (torch.cuda.get_device_name(0) if device == "cuda"
             else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"\n{args.model} on {where}, torch {torch.__version__}; "
          f"hf-placed and tunebench: {device}, {precision} ({why}); {args.new_tokens} new tokens, medians of "
          f"{args.repeats}; ratios: against hf in the same round")
    others = [p for p in paths if p != "hf"]
    print(f"{'batch':>5} {'hf tokens/s':>12}" + "".join(f" {p:>10} {'ratio':>6}" for p in others))
    for b in args.batches:
        line = f"{b:>5} {statistics.median(figures[('hf', b)]):>12.1f}"
        for p in others:
            ratio = statistics.median(o / h for o, h in zip(figures[(p, b)], figures[("hf", b)]))
            line += f" {statistics.median(figures[(p, b)]):>10.1f} {ratio:>6.2f}"
        print(line)
    return 0


class LlamaCpp:
    """`generate`'s call answered by llama.cpp on the f16 GGUF of `loaded` (written once to a temporary file):
    the rows are sequences of one llama_batch, the prompts prefilled together, then one token per row a step,
    each drawn by llama.cpp's sampler chain (temperature 1, the whole vocabulary, as the others sample)."""

    def __init__(self, loaded, batch: int, length: int):
        import tempfile
        from pathlib import Path

        import llama_cpp as L

        from tunebench.model import gguf_export

        self.L, self.batch = L, batch
        self.dir = tempfile.TemporaryDirectory()
        path = Path(self.dir.name) / "smollm2-f16.gguf"
        gguf_export.write(loaded.model, loaded.tokenizer, path, "f16", None, "smollm2")
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        params = L.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = batch * (length + 8)
        params.n_seq_max, params.kv_unified = batch, True
        params.n_threads = params.n_threads_batch = os.cpu_count() or 1
        self.ctx = L.llama_init_from_model(self.model, params)
        self.llama_batch = L.llama_batch_init(params.n_batch, 0, batch)

    def __call__(self, input_ids, max_new_tokens, **_):
        import torch

        L, _b, rows = self.L, self.llama_batch, input_ids.shape[0]
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(1.0))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(0))
        prompt = input_ids[0].tolist()
        out = [[] for _ in range(rows)]
        try:
            self._fill([(s, t, p, p == len(prompt) - 1) for s in range(rows) for p, t in enumerate(prompt)])
            last = [s * len(prompt) + len(prompt) - 1 for s in range(rows)]  # each row's logits in the batch
            for step in range(max_new_tokens):
                tokens = [L.llama_sampler_sample(chain, self.ctx, i) for i in last]
                for s, t in enumerate(tokens):
                    out[s].append(t)
                if step == max_new_tokens - 1:
                    break
                self._fill([(s, t, len(prompt) + step, True) for s, t in enumerate(tokens)])
                last = list(range(rows))
        finally:
            L.llama_sampler_free(chain)
        return torch.cat([input_ids, torch.tensor(out)], 1)

    def _fill(self, entries) -> None:
        b = self.llama_batch
        for i, (seq, token, pos, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")


if __name__ == "__main__":
    sys.exit(main())
