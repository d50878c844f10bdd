"""The A/B vote store: one SQLite file, safe for concurrent writers, and the win rates it reports.

Plain sqlite3 (no web dependency): `tunebench ab-report` and the tests read it without Gradio. Each
vote is one short `BEGIN IMMEDIATE` transaction on its own connection, in WAL mode with a busy
timeout, so two people voting at once (threads of one server, or two servers on one file) both land.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tunebench.core.errors import TunebenchError

VOTES = ("a", "b", "tie", "both_bad")
SCHEMA = """
CREATE TABLE IF NOT EXISTS votes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created TEXT NOT NULL,
    prompt TEXT NOT NULL,
    model_a TEXT NOT NULL,  -- the model shown as "A"
    model_b TEXT NOT NULL,  -- the model shown as "B"
    answer_a TEXT NOT NULL,
    answer_b TEXT NOT NULL,
    vote TEXT NOT NULL CHECK (vote IN ('a', 'b', 'tie', 'both_bad')),
    settings TEXT NOT NULL  -- generation settings, JSON
)"""
# A thumbs up or down on one chat answer (the Chat tab): single judgements, KTO's data (data.judged).
FEEDBACK = """
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created TEXT NOT NULL,
    messages TEXT NOT NULL,  -- the conversation before the answer, JSON chat messages
    model TEXT NOT NULL,
    answer TEXT NOT NULL,
    liked INTEGER NOT NULL CHECK (liked IN (0, 1)),
    settings TEXT NOT NULL  -- generation settings, JSON
)"""


def connect(path: str | Path) -> sqlite3.Connection:
    con = sqlite3.connect(str(path), timeout=30, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA busy_timeout=30000")
    return con


def open_store(path: str | Path) -> Path:
    """Create the database (or check an existing one) at start-up; a one-line error when it cannot be used."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        con = connect(p)
        try:
            con.execute(SCHEMA)
            con.execute(FEEDBACK)
            con.execute("SELECT id, prompt, model_a, model_b, answer_a, answer_b, vote, settings FROM votes LIMIT 1")
            if "pair_id" not in {row[1] for row in con.execute("PRAGMA table_info(votes)")}:
                con.execute("ALTER TABLE votes ADD COLUMN pair_id TEXT")  # a store from before one vote per pair
            # One vote per answer pair, enforced where two fast clicks (two handler threads) meet: here.
            con.execute("CREATE UNIQUE INDEX IF NOT EXISTS votes_pair ON votes(pair_id)")
            if "key" not in {row[1] for row in con.execute("PRAGMA table_info(feedback)")}:
                con.execute("ALTER TABLE feedback ADD COLUMN key TEXT")  # a store from before one judgement an answer
            con.execute("CREATE UNIQUE INDEX IF NOT EXISTS feedback_key ON feedback(key)")
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise TunebenchError(f"--ab-db '{p}' is not a usable A/B database ({e}); pass another path") from e
    except OSError as e:
        raise TunebenchError(f"--ab-db '{p}' cannot be created ({e.strerror}); pass a writable path") from e
    return p


class AlreadyVoted(ValueError):
    """This answer pair has its vote already."""


def record(path: str | Path, prompt: str, model_a: str, model_b: str, answer_a: str, answer_b: str, vote: str,
           settings: dict, pair_id: str | None = None) -> int:
    """Store one vote; returns its id. A second vote for the same `pair_id` raises AlreadyVoted."""
    if vote not in VOTES:
        raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
    con = connect(path)
    try:
        con.execute("BEGIN IMMEDIATE")
        try:
            cur = con.execute(
                "INSERT INTO votes (created, prompt, model_a, model_b, answer_a, answer_b, vote, settings, pair_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (datetime.now(timezone.utc).isoformat(timespec="seconds"), prompt, model_a, model_b, answer_a,
                 answer_b, vote, json.dumps(settings, sort_keys=True), pair_id))
        except sqlite3.IntegrityError:
            con.execute("ROLLBACK")
            raise AlreadyVoted(f"answer pair {pair_id} already has its vote") from None
        con.execute("COMMIT")
        return int(cur.lastrowid)
    finally:
        con.close()


def record_feedback(path: str | Path, messages: list[dict], model: str, answer: str, liked: bool,
                    settings: dict) -> int:
    """Store one thumbs up (liked) or down on a chat answer; returns its id. An answer (its conversation, model
    and text) holds one judgement: clicked again, the newer one replaces it (KTO would count a repeat twice)."""
    text = json.dumps(messages, ensure_ascii=False)
    key = hashlib.sha256(json.dumps([text, model, answer]).encode()).hexdigest()
    con = connect(path)
    try:
        con.execute(
            "INSERT INTO feedback (created, messages, model, answer, liked, settings, key) VALUES (?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(key) DO UPDATE SET liked = excluded.liked, created = excluded.created, "
            "settings = excluded.settings",
            (datetime.now(timezone.utc).isoformat(timespec="seconds"), text, model, answer, int(bool(liked)),
             json.dumps(settings, sort_keys=True), key))
        return int(con.execute("SELECT id FROM feedback WHERE key = ?", (key,)).fetchone()[0])
    finally:
        con.close()


def feedback(path: str | Path) -> list[tuple[list[dict], str, bool]]:
    """(conversation before the answer, answer, liked) of every thumbs up or down, oldest first; none in a store
    from before the Chat tab had them. Read-only and time-limited, as `votes`."""
    con = read_only(path)
    try:
        if not con.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='feedback'").fetchone():
            return []
        return [(json.loads(m), a, bool(liked)) for m, a, liked in
                con.execute("SELECT messages, answer, liked FROM feedback ORDER BY id")]
    except sqlite3.DatabaseError as e:
        raise _unreadable(path, e) from None
    finally:
        con.close()


READ_LIMIT_S = 30.0  # the longest a read of a store may take (a planted view can make a query run forever)


def read_only(path: str | Path) -> sqlite3.Connection:
    """The store opened read-only, each statement interrupted past READ_LIMIT_S (sqlite3's progress handler)."""
    con = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=30)
    deadline = time.monotonic() + READ_LIMIT_S
    con.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    return con


def _unreadable(path: str | Path, e: sqlite3.DatabaseError) -> TunebenchError:
    if "interrupted" in str(e):
        return TunebenchError(f"reading the A/B database '{path}' took over {READ_LIMIT_S:g} s and was stopped; it is "
                              "not a store tunebench serve wrote (pass the --ab-db serve wrote)")
    return TunebenchError(f"'{path}' is not an A/B database of tunebench serve ({e})")


def wilson(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default): sound at small n and near 0 or 1,
    where the normal approximation leaves [0, 1]."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


@dataclass(frozen=True)
class Pair:
    first: str  # the pair's models in name order
    second: str
    first_wins: int
    second_wins: int
    ties: int
    both_bad: int

    @property
    def votes(self) -> int:
        return self.first_wins + self.second_wins + self.ties + self.both_bad

    @property
    def judged(self) -> int:
        """Votes that compare the two: wins and ties ("both bad" says nothing about which is better)."""
        return self.first_wins + self.second_wins + self.ties

    @property
    def win_rate(self) -> float | None:
        """`first`'s share of the judged votes, a tie counting half."""
        return (self.first_wins + self.ties / 2) / self.judged if self.judged else None

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.first_wins + self.ties / 2, self.judged)


def votes(path: str | Path, columns: str) -> list[tuple]:
    """`columns` of every vote, oldest first; a one-line error when the file is missing or not a store.
    Opened read-only: reading votes (a report, preference pairs to train on) never changes the user's file,
    its journal mode included, and works on a file the reader may not write."""
    if not Path(path).is_file():
        raise TunebenchError(f"A/B database '{path}' not found; pass the --ab-db that tunebench serve wrote")
    con = read_only(path)
    try:
        return con.execute(f"SELECT {columns} FROM votes ORDER BY id").fetchall()
    except sqlite3.DatabaseError as e:
        raise _unreadable(path, e) from e
    finally:
        con.close()


def pairs(path: str | Path) -> list[Pair]:
    """Every pair of models that met, with its votes, whichever side each was shown on."""
    rows = votes(path, "model_a, model_b, vote")
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for a, b, vote in rows:
        first, second = sorted((a, b))
        c = counts[(first, second)]
        if vote == "tie":
            c[2] += 1
        elif vote == "both_bad":
            c[3] += 1
        else:
            winner = a if vote == "a" else b
            c[0 if winner == first else 1] += 1
    return [Pair(f, s, *c) for (f, s), c in sorted(counts.items())]


def table(path: str | Path) -> tuple[list[str], list[list[str]]]:
    """The results view (and `tunebench ab-report`): header and one row per pair."""
    head = ["model", "vs", "votes", "wins", "losses", "ties", "both bad", "win rate", "95% interval"]
    rows = []
    for p in pairs(path):
        rate = "-" if p.win_rate is None else f"{100 * p.win_rate:.1f}%"
        low, high = p.interval
        ci = "-" if not p.judged else f"{100 * low:.1f}% - {100 * high:.1f}%"
        rows.append([p.first, p.second, str(p.votes), str(p.first_wins), str(p.second_wins), str(p.ties),
                     str(p.both_bad), rate, ci])
    return head, rows


def report(path: str | Path) -> str:
    head, rows = table(path)
    if not rows:
        return f"{path}: no votes yet"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    total = sum(int(r[2]) for r in rows)
    return "\n".join([f"{path}: {total} vote(s); win rate of the first model, a tie counting half, Wilson 95% "
                      "interval", line(head), *map(line, rows)])
