"""RULER-style synthetic tasks generated locally with the backbone's tokenizer (Hsieh et al., 2024).

Every sample's *whole prompt* (chat template, instructions, context, question and answer prefix, exactly
as `samples.encode_prompt` feeds it to the model) is `context_len` tokens long: the filler is measured
with the tokenizer and trimmed token by token until the length is exact. Samples are deterministic in
(seed, task, context_len, index). Answers are checked by string match (`scoring`).

Tasks (names as in the results):
  niah_single / niah_multikey / niah_multivalue / niah_multiquery   needle(s) "One of the special magic
        numbers for <key> is: <7-digit number>." in a haystack; distractor keys, several values per key,
        several queried keys;
  vt            variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... hidden in the haystack;
  cwe           common-word extraction from a numbered word list;
  fwe           frequent-word extraction from a Zipf-distributed text of coded words;
  kv_retrieval  the value of one UUID key in a JSON object of UUID pairs.
Haystacks: "noise" (RULER's repeated sentences) or "essay" (held-out offline corpus text, `data.offline_text`).
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

from ..config import InputError
from .samples import Sample, encode_prompt

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class LengthError(InputError):
    """The requested context length cannot hold the task (or cannot be hit exactly)."""


@dataclass(frozen=True)
class TaskConfig:
    name: str
    kind: str  # "niah", "vt", "cwe", "fwe", "kv"
    params: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = 32


# RULER's task list. Sizes are RULER's where a 135M model can still be asked (4 needles, 4 values, 4 queries,
# 4 hops with a one-shot example as RULER gives). Measured on SmolLM2-135M, the full cache scores 0 on the
# 4-key NIAH in an essay haystack at 2K and on RULER-size common-word extraction, so the default suite uses
# the noise haystack for multi-key and 3 common words x 30 against words seen once; the RULER-like variants
# stay available as niah_multikey_essay and cwe_ruler (10 words x 30, which needs more than 2K tokens by itself).
TASKS: dict[str, TaskConfig] = {t.name: t for t in [
    TaskConfig("niah_single", "niah", {"n_keys": 1, "n_values": 1, "n_queries": 1, "haystack": "noise"}, 16),
    TaskConfig("niah_single_essay", "niah", {"n_keys": 1, "n_values": 1, "n_queries": 1, "haystack": "essay"}, 16),
    TaskConfig("niah_multikey", "niah", {"n_keys": 4, "n_values": 1, "n_queries": 1, "haystack": "noise"}, 16),
    TaskConfig("niah_multikey_essay", "niah", {"n_keys": 4, "n_values": 1, "n_queries": 1, "haystack": "essay"}, 16),
    TaskConfig("niah_multivalue", "niah", {"n_keys": 1, "n_values": 4, "n_queries": 1, "haystack": "essay"}, 48),
    TaskConfig("niah_multiquery", "niah", {"n_keys": 4, "n_values": 1, "n_queries": 4, "haystack": "essay"}, 48),
    TaskConfig("vt", "vt", {"n_hops": 4, "haystack": "noise", "example": True}, 32),
    TaskConfig("cwe", "cwe", {"n_common": 3, "freq_common": 30, "freq_rare": 1}, 32),
    TaskConfig("cwe_ruler", "cwe", {"n_common": 10, "freq_common": 30, "freq_rare": 3}, 96),
    TaskConfig("fwe", "fwe", {"alpha": 2.0, "word_len": 6, "vocab": 60}, 32),
    TaskConfig("kv_retrieval", "kv", {"key_format": "uuid"}, 40),
]}

# Default suite: every RULER category, at sizes where SmolLM2-135M-Instruct with the FP16 full cache
# scores above 0 at 2K (every task) and 4K tokens (measured with 1-2 samples per task; see the issue #3 report).
SUITES: dict[str, list[str]] = {
    "synthetic": ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
                  "kv_retrieval"],
    "synthetic-all": ["niah_single", "niah_single_essay", "niah_multikey", "niah_multikey_essay", "niah_multivalue",
                      "niah_multiquery", "vt", "cwe", "cwe_ruler", "fwe", "kv_retrieval"],
}


# ---------------------------------------------------------------------------------------------
# Word sources


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words (4-10 letters) of the offline training corpus, in a fixed order."""
    from ..data import offline_text

    words = sorted(set(re.findall(r"\b[a-z]{4,10}\b", offline_text(400_000, heldout=False))))
    return tuple(words)


def _essay_text(min_chars: int) -> str:
    """Held-out offline corpus text (documents never used for codec training), repeated when a long
    context needs more than the held-out split holds (about 137K characters), as RULER repeats its essays."""
    text = _heldout_corpus()
    return "\n\n".join([text] * (min_chars // len(text) + 1)) if len(text) < min_chars else text


@lru_cache(maxsize=1)
def _heldout_corpus() -> str:
    from ..data import is_heldout, offline_documents

    return "\n\n".join(text for doc_id, text in offline_documents() if is_heldout(doc_id))


class Haystacks:
    """Token streams of filler text for one tokenizer (tokenised once, sliced per sample)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[tuple[str, int], tuple[list[int], list[int]]] = {}  # (kind, characters) -> stream

    def stream(self, kind: str, n_tokens: int) -> tuple[list[int], list[int]]:
        """(ids, sentence_starts): at least n_tokens (plus slack) of filler and where its sentences start."""
        need = n_tokens + 64
        # the stream depends on the size asked for alone (50K-character buckets), never on what was generated
        # before: a sample is fixed by (seed, task, context length, index), whichever samples came first
        chars = 50_000 * -(-need * 8 // 50_000)
        if (kind, chars) in self._cache:
            return self._cache[(kind, chars)]
        if kind == "noise":
            text = NOISE * (chars // len(NOISE) + 1)
        elif kind == "essay":
            text = _essay_text(chars)
        else:
            raise ValueError(f"unknown haystack {kind!r}; use 'noise' or 'essay'")
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc.input_ids, enc.offset_mapping
        starts = [i for i, (a, _) in enumerate(offsets) if i == 0 or text[max(0, a - 2):a].rstrip(" ").endswith((".", "\n"))]
        self._cache[(kind, chars)] = (ids, starts)
        if len(ids) < need:
            raise LengthError(f"the {kind} haystack has only {len(ids)} tokens; ask for a shorter context")
        return ids, starts

    def text(self, kind: str, n_tokens: int, rng_start: float, shift: int = 0) -> str:
        """n_tokens of filler starting at a sentence start chosen by rng_start in [0, 1)."""
        if n_tokens <= 0:
            return ""
        ids, starts = self.stream(kind, n_tokens)
        usable = [s for s in starts if s + n_tokens + shift <= len(ids)]
        s = usable[int(rng_start * len(usable))] + shift if usable else shift
        return self.tok.decode(ids[s:s + n_tokens])


def insert_at_depths(haystack: str, needles: list[str], depths: list[float]) -> str:
    """Insert needles between the haystack's sentences at fractional depths (sorted, stable)."""
    sentences = [s for s in _SENTENCE_END.split(haystack.strip()) if s]
    slots: dict[int, list[str]] = {}
    for needle, d in sorted(zip(needles, depths), key=lambda x: x[1]):
        slots.setdefault(int(round(d * len(sentences))), []).append(needle)
    out = []
    for i in range(len(sentences) + 1):
        out.extend(slots.get(i, []))
        if i < len(sentences):
            out.append(sentences[i])
    return " ".join(out)


# ---------------------------------------------------------------------------------------------
# Task renderers: (rng, fill) -> Sample fields. `fill` is filler tokens (haystack tasks) or items (list tasks)


def _magic_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    h = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _join_and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


class _Builder:
    """Builds one sample of one task for one target length, exactly."""

    def __init__(self, tokenizer, haystacks: Haystacks, task: TaskConfig, target: int, key: str):
        self.tok, self.hay, self.task, self.target, self.key = tokenizer, haystacks, task, target, key

    def length(self, sample: Sample) -> int:
        return len(encode_prompt(self.tok, sample))

    # -- haystack tasks: fixed content, variable filler tokens --

    def haystack_sample(self, content: Callable[[random.Random], dict[str, Any]]) -> Sample:
        parts = content(random.Random(self.key))
        kind = parts.pop("haystack")
        place = random.Random(self.key + ":start").random()

        def render(n: int, shift: int) -> Sample:
            filler = self.hay.text(kind, n, place, shift)
            body = insert_at_depths(filler, parts["needles"], parts["depths"]) if filler else " ".join(parts["needles"])
            return self._sample(parts, parts["header"] + "\n" + body + "\n")

        return self._fit_filler(render)

    def _fit_filler(self, render: Callable[[int, int], Sample], pad_mode: bool = False) -> Sample:
        base = self.length(render(0, 0))
        if base > self.target:
            raise LengthError(f"{self.task.name}: the prompt needs {base} tokens without filler, more than "
                              f"context_len={self.target}")
        for shift in range(8):
            n, seen = self.target - base, set()
            for _ in range(24):
                s = render(n, shift)
                got = self.length(s)
                if got == self.target:
                    s.meta["filler_tokens"] = n
                    return s
                seen.add(n)
                n = max(0, n + self.target - got)
                if n in seen:
                    n = max(0, n - 1) if got > self.target else n + 1
                    if n in seen:
                        break
        raise LengthError(f"{self.task.name}: could not hit exactly {self.target} tokens")

    # -- list tasks: variable item count, then a few " ...." tokens of padding to land exactly --

    def list_sample(self, content: Callable[[random.Random, int], dict[str, Any]], min_items: int = 1) -> Sample:
        def render(m: int, pad: int, shift: int = 0) -> Sample:
            parts = content(random.Random(self.key), m)
            padding = " ".join(["...."] * (pad + shift)) if pad else ""  # RULER's "ignore the dots" filler
            body = parts["body"] if not padding else padding + "\n" + parts["body"]
            return self._sample(parts, parts["header"] + "\n" + body + "\n")

        shortest = self.length(render(min_items, 0))
        if shortest > self.target:
            raise LengthError(f"{self.task.name}: {min_items} item(s) already exceed context_len={self.target} "
                              f"({shortest} tokens); use a longer --context-len, or "
                              f"leave {self.task.name} out with --synthetic-tasks")
        lo, hi = min_items, min_items * 2
        while self.length(render(hi, 0)) <= self.target:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # largest item count that fits without padding
            mid = (lo + hi) // 2
            if self.length(render(mid, 0)) <= self.target:
                lo = mid
            else:
                hi = mid
        for m in range(lo, max(min_items, lo - 8) - 1, -1):
            try:
                s = self._fit_filler(lambda n, shift, m=m: render(m, n, shift))
                s.meta["items"] = m
                return s
            except LengthError:
                continue
        raise LengthError(f"{self.task.name}: could not hit exactly {self.target} tokens")

    def _sample(self, parts: dict[str, Any], context: str) -> Sample:
        return Sample(id=f"{self.task.name}-{self.target}-{self.key.rsplit(':', 1)[-1]}", task=self.task.name,
                      context=context, question=parts["question"], answers=parts["answers"],
                      max_new_tokens=self.task.max_new_tokens, answer_prefix=parts["prefix"], metric="all",
                      answer_sep=parts.get("sep", ", "), meta={"context_len": self.target})


def _niah(p: dict[str, Any]):
    def content(rng: random.Random) -> dict[str, Any]:
        words = rng.sample(vocabulary(), p["n_keys"])
        values = {k: [_magic_number(rng) for _ in range(p["n_values"])] for k in words}
        needles = [f"One of the special magic numbers for {k} is: {v}." for k in words for v in values[k]]
        rng.shuffle(needles)
        depths = sorted(rng.random() for _ in needles)
        queries = words[: p["n_queries"]]
        answers = [v for k in queries for v in values[k]]
        plural = len(answers) > 1
        q = _join_and(queries)
        if plural:
            question = f"What are all the special magic numbers for {q} mentioned in the provided text?"
            prefix = f"The special magic numbers for {q} mentioned in the provided text are"
        else:
            question = f"What is the special magic number for {q} mentioned in the provided text?"
            prefix = f"The special magic number for {q} mentioned in the provided text is"
        header = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                  "I will quiz you about the numbers afterwards.")
        return {"header": header, "needles": needles, "depths": depths, "question": question, "prefix": prefix,
                "answers": answers, "haystack": p["haystack"]}
    return content


def _vt(p: dict[str, Any]):
    def content(rng: random.Random) -> dict[str, Any]:
        names: list[str] = []
        while len(names) < p["n_hops"] + 1:
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10_000, 99_999))
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
        depths = sorted(rng.random() for _ in needles)
        header = "Memorize and track the chain of variable assignments hidden in the following text."
        if p.get("example"):
            header = _VT_EXAMPLE + header
        return {"header": header,
                "needles": needles, "depths": depths,
                "question": f"Question: Find all variables that are assigned the value {value} in the text above.",
                "prefix": (f"Answer: According to the chain of variable assignments in the text above, {len(names)} "
                           f"variables are assigned the value {value}, they are:"),
                "answers": names, "haystack": p["haystack"], "sep": " "}  # as its example writes them
    return content


_VT_EXAMPLE = (
    "Example: Memorize and track the chain of variable assignments hidden in the following text.\n"
    "The grass is green. VAR QPXZM = 16938. The sky is blue. VAR BNTKS = VAR QPXZM. The sun is yellow. "
    "VAR HJWUE = VAR BNTKS. Here we go.\n"
    "Question: Find all variables that are assigned the value 16938 in the text above.\n"
    "Answer: According to the chain of variable assignments in the text above, 3 variables are assigned the value "
    "16938, they are: QPXZM BNTKS HJWUE\n\n"
)


def _cwe(p: dict[str, Any]):
    n_common = p["n_common"]

    def content(rng: random.Random, m: int) -> dict[str, Any]:
        words = rng.sample(vocabulary(), n_common + m)
        common, rare = words[:n_common], words[n_common:]
        items = common * p["freq_common"] + rare * p["freq_rare"]
        rng.shuffle(items)
        body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return {"header": ("Below is a numbered list of words. In these words, some appear more often than others. "
                           "Memorize the ones that appear most often."),
                "body": body,
                "question": f"Question: What are the {n_common} most common words in the above list?",
                "prefix": f"Answer: The top {n_common} words that appear most often in the list are:",
                "answers": common}
    return content


def _fwe(p: dict[str, Any]):
    def content(rng: random.Random, m: int) -> dict[str, Any]:
        vocab: list[str] = []
        while len(vocab) < p["vocab"]:
            w = "".join(rng.choice(string.ascii_lowercase) for _ in range(p["word_len"]))
            if w not in vocab:
                vocab.append(w)
        weights = [1 / (r + 1) ** p["alpha"] for r in range(len(vocab))]
        total = sum(weights)
        counts = [max(1, int(m * w / total)) for w in weights]  # deterministic Zipf counts, strictly ordered top 3
        counts[1] = min(counts[1], counts[0] - 1) if counts[0] > 1 else counts[1]
        counts[2] = min(counts[2], counts[1] - 1) if counts[1] > 1 else counts[2]
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        rng.shuffle(words)
        return {"header": ("Read the following coded text and track the frequency of each coded word. Find the three "
                           "most frequently appeared coded words."),
                "body": " ".join(words),
                "question": ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the "
                             "three most frequently appeared words in the above coded text?"),
                "prefix": "Answer: According to the coded text above, the three most frequently appeared words are:",
                "answers": vocab[:3]}
    return content


def _kv(p: dict[str, Any]):
    def make_key(rng):
        return _uuid(rng) if p["key_format"] == "uuid" else "".join(rng.choice("0123456789abcdef") for _ in range(8))

    def content(rng: random.Random, m: int) -> dict[str, Any]:
        pairs = [(make_key(rng), make_key(rng)) for _ in range(m)]
        qk, qv = pairs[rng.randrange(m)]
        body = "{" + ", ".join(f'"{k}": "{v}"' for k, v in pairs) + "}"
        return {"header": "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:",
                "body": body, "question": f'Key: "{qk}"\nWhat is the value corresponding to this key?',
                "prefix": f'The value of key "{qk}" is "', "answers": [qv]}
    return content


# ---------------------------------------------------------------------------------------------


class SyntheticGenerator:
    """Generates samples for one tokenizer; reuse it across tasks and lengths (tokenised haystacks are cached)."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tok, self.seed = tokenizer, seed
        self.haystacks = Haystacks(tokenizer)

    def sample(self, task: str | TaskConfig, context_len: int, index: int) -> Sample:
        cfg = task if isinstance(task, TaskConfig) else get_task(task)
        b = _Builder(self.tok, self.haystacks, cfg, context_len, f"{self.seed}:{cfg.name}:{context_len}:{index}")
        p = cfg.params
        if cfg.kind == "niah":
            return b.haystack_sample(_niah(p))
        if cfg.kind == "vt":
            return b.haystack_sample(_vt(p))
        if cfg.kind == "cwe":
            return b.list_sample(_cwe(p))
        if cfg.kind == "fwe":
            return b.list_sample(_fwe(p), min_items=p["vocab"])
        if cfg.kind == "kv":
            return b.list_sample(_kv(p), min_items=2)
        raise ValueError(f"unknown task kind {cfg.kind!r}")

    def generate(self, tasks: list[str], context_len: int, n_samples: int) -> list[Sample]:
        return [self.sample(t, context_len, i) for t in tasks for i in range(n_samples)]


def get_task(name: str) -> TaskConfig:
    if name not in TASKS:
        raise InputError(f"unknown synthetic task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]


def suite_tasks(name: str) -> list[str]:
    if name not in SUITES:
        raise InputError(f"unknown synthetic suite {name!r}; known: {', '.join(SUITES)}")
    return list(SUITES[name])
