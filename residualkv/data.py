"""Text that exists offline on every machine: CPython's own documentation.

`pydoc_data.topics` (the language reference behind `help()`) plus the docstrings of the standard
library's pure-Python modules, read with `ast` (nothing is imported). Each topic or module is one
document, so a train / held-out split by document never leaks text across the split.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Callable, Iterator

from .config import InputError

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo", "tkinter"}


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line of a JSONL file; a malformed line raises a
    ValueError (InputError) naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{n} is not valid JSON ({error.msg}); write one JSON object per line") from None


def offline_documents(min_chars: int = 2000,
                      text_of: Callable[[Path], str] | None = None) -> Iterator[tuple[str, str]]:
    """(doc_id, text) pairs in a fixed order. `text_of` reads a stdlib module (default: its docstrings);
    a corpus built with another reader keeps these document ids, hence the same train / held-out split."""
    text_of = text_of or module_docstrings
    import pydoc_data.topics

    for name in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[name].strip()
        if len(text) >= min_chars:
            yield f"pydoc:{name}", text
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(stdlib).parts):
            continue
        text = text_of(path)
        if len(text) >= min_chars:
            yield f"stdlib:{path.relative_to(stdlib).as_posix()}", text


def module_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80:
                parts.append(doc.strip())
    return "\n\n".join(parts)


def is_heldout(doc_id: str, fraction: float = 0.1) -> bool:
    """Deterministic split by document id."""
    h = int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16)
    return (h % 10_000) < fraction * 10_000


def offline_text(n_chars: int, heldout: bool = True) -> str:
    """At least n_chars of held-out (or training) text, documents joined by blank lines."""
    out, size = [], 0
    for doc_id, text in offline_documents():
        if is_heldout(doc_id) != heldout:
            continue
        out.append(text)
        size += len(text)
        if size >= n_chars:
            break
    if size < n_chars:
        raise ValueError(f"the offline corpus has only {size} characters of {'held-out' if heldout else 'training'} "
                         f"text; ask for fewer than {n_chars}")
    return "\n\n".join(out)
