"""A user's Python file (a GRPO reward or environment) read once: its bytes hashed, and exactly those bytes run.

A resume compares a file's hash with the one its checkpoint recorded before the file runs (a changed file would run
other code than the run trained with, and could be anything a visitor left where the run resumes); reading the file
again to import it would run whatever is there by then. importlib's loader reads the path itself, so the module is
made here from the bytes that were hashed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import types
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class UserFile:
    path: Path
    source: bytes

    @classmethod
    def read(cls, path: str | Path) -> UserFile:
        return cls(Path(path), Path(path).read_bytes())

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source).hexdigest()

    def run(self, module_name: str) -> types.ModuleType:
        """The module these bytes make (its errors raised as they are: the caller says them in one line)."""
        spec = importlib.util.spec_from_loader(module_name, loader=None, origin=str(self.path))
        module = importlib.util.module_from_spec(spec)
        module.__file__ = str(self.path)
        exec(compile(self.source, str(self.path), "exec"), module.__dict__)  # noqa: S102 - the user's own file
        return module
