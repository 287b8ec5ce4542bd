"""Write the standard library's full source (not only its docstrings) as a JSONL corpus for `rkv train --data`.

The offline corpus (residualkv.data) is pydoc's topics plus the docstrings of the stdlib's pure-Python
modules, ~0.4M tokens. This writes the same topics plus each module's whole source, ~2.8M tokens of
mostly code, under the same document ids ("pydoc:<topic>", "stdlib:<path>"), so the train / held-out split
is the offline corpus's: a module held out there (and whose docstrings the synthetic haystacks are cut from)
is held out here too.

    python benchmarks/stdlib_code_corpus.py /tmp/corpus_code/corpus.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from residualkv.data import offline_documents  # noqa: E402


def whole_source(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:] or ["stdlib_code.jsonl"])[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    n = chars = 0
    with open(out, "w", encoding="utf-8") as f:
        for doc_id, text in offline_documents(text_of=whole_source):
            f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
            n, chars = n + 1, chars + len(text)
    print(f"{n} documents, {chars / 1e6:.1f}M characters -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
