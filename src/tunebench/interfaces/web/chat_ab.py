"""The Chat and A/B tabs' work without Gradio, as studio.py is for the Train and Runs tabs: a chat turn streamed,
a thumbs up or down stored (KTO's data), a blind pair answered and voted on (DPO's data), a prompt set read, the
results and the command that trains on them. Problems are TunebenchError in one line; app.py shows them to the
visitor as Gradio's errors, and anything else stays in the server's console."""

from __future__ import annotations

import random
import shlex
import threading
import time
import uuid
from pathlib import Path

from tunebench.core.errors import TunebenchError
from tunebench.data import pairs, votes
from tunebench.interfaces.web.models import Registry, load_prompts, stream
from tunebench.settings.finetune import DEFAULT_MODEL

VOTE_LABELS = {"a": "A is better", "b": "B is better", "tie": "Tie", "both_bad": "Both are bad"}
PROMPT_SET_BYTES = 2 ** 20


def _settings(temperature: float, top_p: float, max_new_tokens: int) -> dict:
    return {"temperature": float(temperature), "top_p": float(top_p), "max_new_tokens": int(max_new_tokens)}


class Blinded:
    """The models of A/B pairs shown and not yet voted on, by any visitor: the Chat tab does not show their
    speed (an adapter is slower than its base, so a speed seen there would name a side of the pair). A pair
    left without a vote stops hiding anything after `hours`."""

    def __init__(self, hours: float = 1.0):
        self.seconds = hours * 3600
        self._pairs: dict[str, tuple[tuple[str, str], float]] = {}
        self._lock = threading.Lock()

    def open(self, pair_id: str, labels: tuple[str, str]) -> None:
        with self._lock:
            self._pairs[pair_id] = (labels, time.monotonic())

    def close(self, pair_id: str | None) -> None:
        with self._lock:
            self._pairs.pop(pair_id, None)

    def hides(self, label: str) -> bool:
        now = time.monotonic()
        with self._lock:
            for pair_id, (_, opened) in list(self._pairs.items()):
                if now - opened > self.seconds:
                    del self._pairs[pair_id]
            return any(label in labels for labels, _ in self._pairs.values())


def chat_turn(registry: Registry, label: str, message: str, history: list[dict], temperature: float, top_p: float,
              max_new_tokens: int, blinded: Blinded | None = None):
    """Yields (history, status) as the reply grows. The speed is left out while `label` is in an open A/B pair."""
    if not message.strip():
        raise TunebenchError("Type a message first.")
    history = list(history or []) + [{"role": "user", "content": message.strip()}]
    for reply in stream(registry, label, history, int(max_new_tokens), float(temperature), float(top_p)):
        shown = history + [{"role": "assistant", "content": reply.text}]
        if not reply.done:
            status = "generating ..."
        elif blinded is not None and blinded.hides(label):
            status = f"{reply.new_tokens} tokens (speed hidden while a blind A/B comparison of this model is open)"
        else:
            status = (f"{reply.new_tokens} tokens in {reply.seconds:.1f} s: {reply.tokens_per_s:.1f} tokens/s "
                      f"({reply.runtime})")
        yield shown, status


def chat_feedback(db: Path, label: str, history: list[dict], index: int, liked: bool, temperature: float,
                  top_p: float, max_new_tokens: int) -> str:
    """A thumbs up or down on the Chat answer at `index` of `history`, stored with the conversation before it:
    KTO's data (`tunebench train --method kto --data` the store)."""
    history = list(history or [])
    if not 0 <= index < len(history) or history[index].get("role") != "assistant" or index == 0:
        raise TunebenchError("That message is not an answer of the model; rate one of its answers.")
    messages = [{"role": m["role"], "content": m["content"]} for m in history[:index]]
    votes.record_feedback(db, messages, label, history[index]["content"], liked,
                          _settings(temperature, top_p, max_new_tokens))
    return (f"Stored: answer {'liked' if liked else 'disliked'} ({'desirable' if liked else 'undesirable'} for "
            "`tunebench train --method kto`).")


AB_MIN_TEMPERATURE = 0.3  # greedy answers could be matched with the Chat tab's, which names its model


def ab_answers(registry: Registry, first: str, second: str, prompt: str, temperature: float, top_p: float,
               max_new_tokens: int, rng: random.Random | None = None, blinded: Blinded | None = None):
    """Both models answer `prompt`, shown as A and B in random order. Yields (answer A, answer B, status,
    state); the state holds who is who until the vote. Both answers appear together once both are done:
    streamed one after the other, each side's speed (an adapter is slower than its base) named its model."""
    if float(temperature) < AB_MIN_TEMPERATURE:
        raise TunebenchError(f"A/B samples at a temperature of {AB_MIN_TEMPERATURE} or more: greedy answers could be "
                       "matched with the Chat tab's, which names the model. Raise the temperature.")
    if not prompt.strip():
        raise TunebenchError("Type a prompt (or take the next one from the prompt set) first.")
    if first == second:
        raise TunebenchError("Pick two different models to compare.")
    a, b = (first, second) if (rng or random).random() < 0.5 else (second, first)
    messages = [{"role": "user", "content": prompt.strip()}]
    settings = _settings(temperature, top_p, max_new_tokens)
    seed = (rng or random).randrange(2**31)  # one seed for both sides: the models, not the dice, differ
    answers = {"a": "", "b": ""}
    speeds = {}
    for side, label in (("a", a), ("b", b)):
        for reply in stream(registry, label, messages, settings["max_new_tokens"], settings["temperature"],
                            settings["top_p"], seed):
            answers[side] = reply.text
            if reply.done:
                speeds[side] = reply.tokens_per_s
        yield "", "", "answering ..." if side == "a" else "almost done ...", None
    # Speeds stay hidden until the vote: an adapter is slower than its base, so a speed names the model.
    state = {"prompt": prompt.strip(), "model_a": a, "model_b": b, "answer_a": answers["a"],
             "answer_b": answers["b"], "settings": settings, "speeds": speeds, "pair_id": uuid.uuid4().hex,
             "voted": False}
    if blinded is not None:
        blinded.open(state["pair_id"], (a, b))
    yield answers["a"], answers["b"], "Which answer is better?", state


def ab_vote(db: Path, vote: str, state: dict | None, blinded: Blinded | None = None) -> tuple[str, dict | None]:
    """Store the vote with both answers, the prompt, the models and the settings; reveal who was who."""
    if not state:
        raise TunebenchError("Generate two answers first.")
    if state.get("voted"):
        raise TunebenchError("This pair is already voted on; generate new answers.")
    try:  # two fast clicks run two handlers on the same state: the store takes one vote per pair
        vote_id = votes.record(db, state["prompt"], state["model_a"], state["model_b"], state["answer_a"],
                               state["answer_b"], vote, state["settings"], state.get("pair_id"))
    except votes.AlreadyVoted:
        raise TunebenchError("This pair is already voted on; generate new answers.") from None
    if blinded is not None:
        blinded.close(state.get("pair_id"))
    speeds = state.get("speeds", {})
    shown = "".join(f", {side.upper()} {speeds[side]:.1f} tokens/s" for side in ("a", "b") if side in speeds)
    return (f"Vote #{vote_id} stored: {VOTE_LABELS[vote]}. A was {state['model_a']}, B was {state['model_b']}"
            + (f" ({shown[2:]})" if shown else "") + ".", dict(state, voted=True))


def read_upload(file) -> list[str]:
    """The prompts of an uploaded prompt set (its size is bounded by launch's max_file_size); the upload is
    deleted once read, so uploads never pile up in the server's temp dir."""
    path = Path(file if isinstance(file, str) else file.name)
    try:
        if path.stat().st_size > PROMPT_SET_BYTES:  # the page takes bigger uploads (training data) when it trains
            raise TunebenchError(f"the prompt set is {path.stat().st_size:,} bytes; the limit is {PROMPT_SET_BYTES:,}")
        return load_prompts(path)
    finally:
        path.unlink(missing_ok=True)


def results_rows(db: Path) -> list[list[str]]:
    return votes.table(db)[1] if db.is_file() else []


def train_on_votes(db: Path, base: str | None = None) -> str:
    """The results view's next step: the command that trains on the votes, as text to copy (training
    never runs inside the web server). `base`, the model to start from where it is not the default."""
    if not db.is_file():
        return "No votes yet: vote A or B on the blind A/B tab, and the votes become DPO training pairs."
    found = pairs.from_store(str(db))
    if not len(found):
        return (f"No A or B votes yet ({found.describe()}): ties and \"both bad\" say nothing about which answer "
                "to prefer.")
    model = f" --model {shlex.quote(base)}" if base and base != DEFAULT_MODEL else ""
    return (f"**Train on these votes**: {found.describe()}. Run this where the model should train, then serve "
            f"the run beside the others and vote again:\n\n```\ntunebench train --method dpo --data "
            f"{shlex.quote(str(db))}{model} --output-dir runs/dpo-votes\n```")
