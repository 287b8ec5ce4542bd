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
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from residualkv.data import SKIP_DIRS  # noqa: E402


def main(argv=None) -> int:
    import pydoc_data.topics

    out = Path((argv or sys.argv[1:] or ["stdlib_code.jsonl"])[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [(f"pydoc:{name}", pydoc_data.topics.topics[name].strip()) for name in sorted(pydoc_data.topics.topics)]
    for path in sorted(stdlib.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(stdlib).parts):
            continue
        try:
            docs.append((f"stdlib:{path.relative_to(stdlib).as_posix()}", path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    n = chars = 0
    with open(out, "w", encoding="utf-8") as f:
        for doc_id, text in docs:
            if len(text) >= 2000:  # the offline corpus's floor
                f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
                n, chars = n + 1, chars + len(text)
    print(f"{n} documents, {chars / 1e6:.1f}M characters -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
