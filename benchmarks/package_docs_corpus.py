"""Write the offline corpus plus as much again of the installed packages' docstrings, as a JSONL corpus
for `rkv train --data`.

The offline corpus (residualkv.data) holds 187 training blocks of 2048 tokens, so an hour of bf16 steps on
it is two epochs of the same text. The packages installed beside the project (torch, transformers, scipy,
pandas, ...) carry ~50M characters of docstrings, prose of the same kind, on every machine that ran
`make setup`. This keeps the offline corpus's documents under their ids (so its held-out documents, the
haystacks' source, stay held out and the held-out blocks are the same) and adds package modules' docstrings,
in a fixed hash order, until the added text matches the offline training text (`--ratio 1`). Only package
modules that `is_heldout` would train on are added, so the held-out set is unchanged.

    python benchmarks/package_docs_corpus.py /tmp/corpus_pkgdocs/corpus.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from residualkv.data import is_heldout, module_docstrings, offline_documents  # noqa: E402

SKIP_PARTS = {"test", "tests", "testing", "__pycache__"}


def package_documents(min_chars: int = 2000):
    """(doc_id, docstrings) of every installed package module with enough prose, in a fixed hash order
    (so a budget takes a mix of packages rather than the alphabet's first ones)."""
    site = Path(sysconfig.get_paths()["purelib"])
    paths = [p for p in site.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(site).parts)]
    doc_id = lambda p: f"site:{p.relative_to(site).as_posix()}"  # noqa: E731
    for path in sorted(paths, key=lambda p: hashlib.sha256(doc_id(p).encode()).hexdigest()):
        if is_heldout(doc_id(path)):
            continue
        text = module_docstrings(path)
        if len(text) >= min_chars:
            yield doc_id(path), text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ratio", type=float, default=1.0,
                    help="package text to add, as a multiple of the offline corpus's training text")
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    offline = list(offline_documents())
    budget = args.ratio * sum(len(t) for d, t in offline if not is_heldout(d))
    added, packages = 0, set()
    with open(args.out, "w", encoding="utf-8") as f:
        for doc_id, text in offline:
            f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
        for doc_id, text in package_documents():
            if added >= budget:
                break
            f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
            added += len(text)
            packages.add(doc_id.split("/")[0])
    print(f"{len(offline)} offline documents and {added / 1e6:.2f}M characters of docstrings from "
          f"{len(packages)} packages -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
