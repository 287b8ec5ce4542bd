"""Write a document-QA task file in the user JSONL format (`rkv eval --tasks FILE.jsonl`), offline.

Issue #4 asks for quality "on user JSONL tasks at 2K and 4K"; no user file exists offline, so this
builds one the way a user's would look (documents in the context, a question about one of them, a short
answer scored by string match) from the corpus's *held-out* documents (CPython's documentation that the
codec never trained on; `residualkv.data`), and evaluation goes through the same path a user's file does.

Two tasks, `n` samples each, every context filled to about `--tokens` with titled sections (whole
held-out documents, cut to at most `--section-tokens`), the one the question is about at a random depth:

- doc_continue: quote 8 words of a sentence from one section; the answer is the 3 words that follow
  (a copy from natural text, where the synthetic suite copies numbers and UUIDs);
- doc_source: quote a whole sentence; the answer is the title of the section that holds it (a look-up
  that needs the sentence matched and the heading far above it recalled).

A quoted span occurs exactly once in its context; the files are deterministic for a seed (and a Python
version: the corpus is the interpreter's own documentation).

    python benchmarks/make_docqa.py --tokens 2048 --n 8 --out benchmarks/tasks/docqa_2k.jsonl
    rkv eval --tasks benchmarks/tasks/docqa_2k.jsonl --context-len 2048 --methods full,residualkv-standalone ...
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv.data import is_heldout, offline_documents  # noqa: E402
from residualkv.evaluation.samples import Sample, encode_prompt, write_jsonl  # noqa: E402

_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_WORDS = re.compile(r"[A-Za-z][A-Za-z'-]*")
MIN_TITLE = 6  # shorter titles ("calls") are too likely to turn up in any answer by chance


def title_of(doc_id: str) -> str:
    kind, name = doc_id.split(":", 1)
    return name if kind == "pydoc" else name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def reflow(text: str) -> str:
    """Hard-wrapped prose paragraphs joined into single lines (as a rendered page shows them); indented
    blocks (code, tables) kept as they are."""
    paras = []
    for para in text.split("\n\n"):
        lines = para.split("\n")
        paras.append(para if any(l.startswith((" ", "\t")) for l in lines) else " ".join(l.strip() for l in lines))
    return "\n\n".join(paras)


def sentences(text: str) -> list[str]:
    """Prose sentences of 11+ plain words, on one line of the text (so a quote matches it verbatim)."""
    out = []
    for line in text.split("\n"):
        if line.startswith((" ", "\t")):
            continue
        for s in _SENTENCE.split(line.strip()):
            words = s.split(" ")
            if len(words) >= 11 and all(_WORDS.fullmatch(w.strip(".,;:()")) for w in words[:11]):
                out.append(s)
    return out


def build(tokenizer, tokens: int, n: int, seed: int, section_tokens: int) -> list[Sample]:
    docs = [(title_of(i), t) for i, t in offline_documents() if is_heldout(i)]
    rng = random.Random(seed)
    cut = {}
    for title, text in docs:  # each section at most section_tokens, ending at a sentence boundary
        text = reflow(text)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        body = tokenizer.decode(ids[:section_tokens]) if len(ids) > section_tokens else text
        if len(ids) > section_tokens:
            body = body[: max(body.rfind(". "), body.rfind(".\n"), 0) + 1] or body
        cut[title] = body.strip()
    targets = [t for t, _ in docs if len(t) >= MIN_TITLE and sentences(cut[t])]
    samples: list[Sample] = []
    used: set[str] = set()
    for task in ("doc_continue", "doc_source"):
        made, tries = 0, 0
        while made < n:
            tries += 1
            if tries > 200 * n:
                raise SystemExit(f"could not build {n} {task} samples at {tokens} tokens: ask for fewer or shorter ones")
            target = rng.choice(targets)
            sentence = rng.choice(sentences(cut[target]))
            if sentence in used:
                continue
            words = sentence.split(" ")
            if task == "doc_continue":
                start = rng.randrange(0, len(words) - 10)  # 8 quoted + 3 answer words fit
                quote = " ".join(words[start : start + 8])
                # verbatim, as a copy would write it (inner punctuation kept), outer punctuation dropped
                answer = " ".join(words[start + 8 : start + 11]).strip(".,;:()\"'")
                question = (f'Which three words come right after "{quote}" in the documentation above? '
                            "Quote them exactly.")
                prefix = f'Answer: In the documentation above, "{quote}" is followed by "'
            else:
                quote, answer = sentence, target
                question = (f'Which section of the documentation above contains the sentence "{quote}"? '
                            "Answer with the section title.")
                prefix = 'Answer: The sentence is in the section titled "'
            others = [t for t, _ in docs if t != target]
            rng.shuffle(others)
            sections = [target]
            sample = None
            for other in others + [None]:
                order = list(sections)
                # the target at a random depth, the same position whichever section is added last
                rng_depth = random.Random(f"{seed}-{task}-{made}")
                order.remove(target)
                order.insert(rng_depth.randrange(0, len(order) + 1), target)
                context = "\n\n".join(f"## {t}\n\n{cut[t]}" for t in order)
                trial = Sample(id=f"{task}-{tokens}-{made}", task=task, context=context, question=question,
                               answers=[answer], max_new_tokens=16, answer_prefix=prefix, metric="all")
                if len(encode_prompt(tokenizer, trial)) > tokens:
                    break
                sample = trial
                if other is None:
                    break
                sections.append(other)
            if sample is None or len(encode_prompt(tokenizer, sample)) < 0.75 * tokens:
                continue  # the target alone does not fit, or the context is far from the length asked for
            if sample.context.count(quote) != 1 or (task == "doc_source" and sample.context.count(f"## {target}\n") != 1):
                continue
            used.add(sentence)
            sample.meta = {"section": target, "sections": sample.context.count("\n## ") + 1, "seed": seed}
            samples.append(sample)
            made += 1
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, required=True, help="prompt length to fill (chat template included)")
    ap.add_argument("--n", type=int, default=8, help="samples per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--section-tokens", type=int, default=1200, help="longest section (a document is cut there)")
    ap.add_argument("--tokenizer", default=str(ROOT / "data" / "backbones" / "smollm2-135m"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    samples = build(tokenizer, args.tokens, args.n, args.seed, args.section_tokens)
    rows = []
    for s in samples:
        row = {"id": s.id, "task": s.task, "context": s.context, "question": s.question, "answers": s.answers,
               "max_new_tokens": s.max_new_tokens, "answer_prefix": s.answer_prefix, "metric": s.metric}
        rows.append(row)
    write_jsonl(rows, args.out)
    lengths = [len(encode_prompt(tokenizer, s)) for s in samples]
    print(f"wrote {len(rows)} samples to {args.out}: prompts {min(lengths)}-{max(lengths)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
