"""Training data: documents -> tokens -> fixed-length blocks, split train / held-out by document.

Documents come from one of three sources (`resolve_source`):

  "offline"          the corpus that exists on every machine (residualkv.data: CPython's docs)
  a folder or file   .txt files (one document each) and .jsonl files (one document per line, `text` field)
  anything else      a Hugging Face `datasets` name (needs the hub, i.e. network access)

Each document is tokenised, followed by EOS, and the documents of one split are concatenated and cut
into `seq_len` blocks (the tail of each map batch of documents that does not fill a block is dropped).
Whether a document is held out depends only on its id (`residualkv.data.is_heldout`), so no text is
ever shared between the splits. The packed splits are saved with `Dataset.save_to_disk` under
`data_dir()/packed/<fingerprint>/`, where the fingerprint covers the documents, the tokenizer and the
packing settings: a rerun with the same inputs reuses them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..config import InputError
from ..data import is_heldout, offline_documents
from ..paths import data_dir, hub_unreachable
from ..saved import write_dir_atomically

PACKING_VERSION = 1  # bump when the packing rule changes, so old packed sets are not reused
DOCS_PER_BATCH = 1000  # documents per `map` batch; at most seq_len-1 tokens are dropped per batch
TEXT_SUFFIXES = (".txt", ".md", ".rst")


class DataError(InputError):
    """The training data cannot be built; the message names the input and how to fix it."""


# ---------------------------------------------------------------------------------------------
# Sources: where documents come from, and a fingerprint of exactly those documents.


@dataclass(frozen=True)
class OfflineSource:
    """CPython's documentation text (residualkv.data), identical on every machine with this Python."""

    name: str = "offline"

    def documents(self) -> Iterator[tuple[str, str]]:
        return offline_documents()

    def fingerprint(self) -> str:
        # The corpus depends on the interpreter's stdlib, so hash the text itself (a few MB, seconds).
        h = hashlib.sha256(f"offline:{sys.version}".encode())
        for doc_id, text in self.documents():
            h.update(doc_id.encode() + b"\0" + text.encode() + b"\0")
        return h.hexdigest()


@dataclass(frozen=True)
class LocalSource:
    """A folder (searched recursively) or a single file of .txt/.md/.rst documents and .jsonl rows."""

    path: Path
    text_field: str = "text"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def name(self) -> str:
        return str(self.path)

    def files(self) -> list[Path]:
        known = TEXT_SUFFIXES + (".jsonl",)
        if self.path.is_file():
            if self.path.suffix.lower() not in known:  # e.g. a .json array would be packed as raw JSON text
                raise DataError(f"--data {self.path}: a {self.path.suffix or 'suffix-less'} file is neither text "
                                f"({'/'.join(TEXT_SUFFIXES)}) nor JSON lines (.jsonl); convert it to one "
                                f"{{\"{self.text_field}\": \"...\"}} object per .jsonl line or rename a plain-text file")
            return [self.path]
        found = sorted(p for p in self.path.rglob("*") if p.is_file() and p.suffix.lower() in known)
        if not found:
            raise DataError(f"--data {self.path}: no .txt/.md/.rst/.jsonl files in this folder; "
                            "put one document per .txt file or one JSON object with a "
                            f"{self.text_field!r} field per .jsonl line")
        return found

    def documents(self) -> Iterator[tuple[str, str]]:
        root = self.path if self.path.is_dir() else self.path.parent
        for file in self.files():
            rel = file.relative_to(root).as_posix()
            if file.suffix.lower() == ".jsonl":
                yield from self._jsonl(file, rel)
            else:
                try:
                    yield rel, file.read_text(encoding="utf-8")
                except UnicodeDecodeError as error:
                    raise DataError(f"--data: {file} is not UTF-8 text ({error.reason} at byte {error.start}); "
                                    "re-encode it as UTF-8 (e.g. iconv -t UTF-8) or move it out of the folder") from None

    def _jsonl(self, file: Path, rel: str) -> Iterator[tuple[str, str]]:
        from ..data import iter_jsonl

        try:
            for n, row in iter_jsonl(file):
                if not isinstance(row, dict) or not isinstance(row.get(self.text_field), str):
                    raise DataError(f"{file}:{n} has no string field {self.text_field!r}; every line needs "
                                    f'{{"{self.text_field}": "..."}} (pick another field with --text-field)')
                yield str(row.get("id", f"{rel}:{n}")), row[self.text_field]
        except DataError:
            raise
        except UnicodeDecodeError as error:
            raise DataError(f"--data: {file} is not UTF-8 text ({error.reason} at byte {error.start}); "
                            "re-encode it as UTF-8 (e.g. iconv -t UTF-8)") from None
        except ValueError as error:  # a malformed line: same message, the packing error type
            raise DataError(str(error)) from None

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"local:{self.text_field}".encode())
        root = self.path if self.path.is_dir() else self.path.parent
        for file in self.files():
            h.update(file.relative_to(root).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(file.read_bytes()).digest())
        return h.hexdigest()


@dataclass(frozen=True)
class HubSource:
    """A `datasets` name on the Hugging Face hub (online only). Documents are rows of `text_field`."""

    name: str
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    max_documents: int | None = None
    cache_dir: str | None = None  # `datasets`' own cache (None: ~/.cache/huggingface/datasets)

    def load(self):
        import datasets

        if offline := hub_unreachable(self.name):
            raise DataError(f"--data {self.name}: the Hugging Face hub is unreachable ({offline}). Offline, use "
                            "--data offline or a local folder of .txt/.jsonl files (a dataset already in the "
                            "datasets cache loads with HF_HUB_OFFLINE=1).")
        try:
            ds = datasets.load_dataset(self.name, self.config, split=self.split, cache_dir=self.cache_dir)
        except Exception as error:  # offline, unknown name, gated: all end here
            raise DataError(f"--data {self.name}: `datasets.load_dataset` failed ({type(error).__name__}: {error}). "
                            "Offline, use --data offline or a local folder of .txt/.jsonl files.") from error
        if self.text_field not in ds.column_names:
            raise DataError(f"--data {self.name}: no column {self.text_field!r} (columns: {ds.column_names}); "
                            "pick the text column with --text-field")
        if self.max_documents is not None:
            ds = ds.select(range(min(self.max_documents, len(ds))))
        return ds

    def dataset(self):
        """The rows as a (disk-backed) table with `doc_id` and `text`, however large the dataset is."""
        ds = self.load()
        name, field = self.name, self.text_field
        return ds.map(lambda b, idx: {"doc_id": [f"{name}:{i}" for i in idx], "text": b[field]}, with_indices=True,
                      batched=True, remove_columns=ds.column_names, desc="reading documents")

    def documents(self) -> Iterator[tuple[str, str]]:
        for row in self.dataset():
            yield row["doc_id"], row["text"]

    def fingerprint(self) -> str:
        # `datasets` fingerprints the loaded table by content; name/config/split keep it readable.
        ds = self.load()
        key = f"hub:{self.name}:{self.config}:{self.split}:{self.text_field}:{self.max_documents}:{ds._fingerprint}"
        return hashlib.sha256(key.encode()).hexdigest()


Source = OfflineSource | LocalSource | HubSource


def resolve_source(data: str | os.PathLike | None, *, text_field: str = "text", config: str | None = None,
                   split: str = "train", max_documents: int | None = None) -> Source:
    """'offline' (default), an existing local path, or else a `datasets` hub name."""
    if data is None or str(data) == "offline":
        return OfflineSource()
    path = Path(data).expanduser()
    if path.exists():
        return LocalSource(path.resolve(), text_field=text_field)
    if str(data).startswith((".", "/", "~")) or str(data).endswith((".jsonl", ".txt")):
        raise DataError(f"--data {data}: no such file or folder; pass an existing path, 'offline', or a datasets name")
    return HubSource(str(data), config=config, split=split, text_field=text_field, max_documents=max_documents)


# ---------------------------------------------------------------------------------------------
# Tokenise and pack.


@dataclass
class PackedData:
    """Fixed-length blocks (`input_ids`, plus the `doc_ids` each block was cut from) per split."""

    train: Any  # datasets.Dataset
    heldout: Any  # datasets.Dataset
    path: Path
    meta: dict[str, Any]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}:{tokenizer.eos_token_id}:{body}".encode()).hexdigest()


def pack_documents(source: Source, tokenizer, seq_len: int, *, heldout_fraction: float = 0.1,
                   root: str | Path | None = None, reuse: bool = True) -> PackedData:
    """Tokenise and pack `source` into `seq_len` blocks, or reuse the set packed earlier from the same inputs."""
    if seq_len < 2:
        raise DataError(f"seq_len={seq_len}: a block needs at least 2 tokens for next-token prediction")
    if not 0.0 <= heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction={heldout_fraction}: use a fraction in [0, 1), e.g. 0.1")
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; set tokenizer.eos_token so documents can be separated")
    settings = {"version": PACKING_VERSION, "source": source.name, "source_fingerprint": source.fingerprint(),
                "tokenizer": tokenizer_fingerprint(tokenizer), "seq_len": seq_len, "heldout_fraction": heldout_fraction,
                "eos_token_id": tokenizer.eos_token_id}
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = (Path(root) if root is not None else data_dir() / "packed") / fingerprint
    if reuse and (folder / "meta.json").is_file():
        return _load(folder)
    return _build(source, tokenizer, seq_len, heldout_fraction, settings | {"fingerprint": fingerprint}, folder)


def _build(source: Source, tokenizer, seq_len: int, heldout_fraction: float, meta: dict[str, Any],
           folder: Path) -> PackedData:
    import datasets

    docs = source.dataset() if isinstance(source, HubSource) else _documents_table(source)
    if len(docs) == 0:
        raise DataError(f"--data {source.name}: no documents found")
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids],
                "heldout": [is_heldout(d, heldout_fraction) for d in batch["doc_id"]]}

    tokens = docs.map(tokenize, batched=True, remove_columns=["text"], desc="tokenising documents")
    splits = {}
    for name, held in (("train", False), ("heldout", True)):
        part = tokens.filter(lambda b, h=held: [x == h for x in b["heldout"]], batched=True, desc=f"selecting {name}")
        splits[name] = part.map(_pack_batch, batched=True, batch_size=DOCS_PER_BATCH, fn_kwargs={"seq_len": seq_len},
                                remove_columns=part.column_names, desc=f"packing {name} into {seq_len}-token blocks")
    if len(splits["train"]) == 0:
        n = sum(len(x) for x in tokens.filter(lambda b: [not h for h in b["heldout"]], batched=True)["input_ids"])
        raise DataError(f"--data {source.name}: the training documents hold {n} tokens, fewer than one "
                        f"seq_len={seq_len} block; lower --seq-len or add documents")
    meta |= {"n_documents": len(docs), "n_heldout_documents": int(sum(tokens["heldout"])),
             "train_blocks": len(splits["train"]), "heldout_blocks": len(splits["heldout"])}
    # datasets cannot reload an empty split (a tiny corpus may have no held-out document): only non-empty
    # splits are written, and _load rebuilds an empty one from the train split's features
    _save_atomically(datasets.DatasetDict({k: v for k, v in splits.items() if len(v)}), meta, folder)
    return PackedData(train=splits["train"], heldout=splits["heldout"], path=folder, meta=meta)


def _documents_table(source: Source):
    """Small corpora (offline, local files) as an in-memory table: nothing stale is cached on disk."""
    import datasets

    rows: dict[str, list[str]] = {"doc_id": [], "text": []}
    seen: set[str] = set()
    for doc_id, text in source.documents():
        if doc_id in seen:  # the split is by id: two documents with one id would land together
            raise DataError(f"--data {source.name}: document id {doc_id!r} appears twice; ids must be unique")
        seen.add(doc_id)
        if text.strip():
            rows["doc_id"].append(doc_id)
            rows["text"].append(text)
    return datasets.Dataset.from_dict(rows)


def _pack_batch(batch: dict[str, list], seq_len: int) -> dict[str, list]:
    """Concatenate the documents of one batch (each already ends in EOS) and cut whole blocks."""
    blocks, owners = [], []
    buf: list[int] = []
    buf_docs: list[str] = []
    for doc_id, ids in zip(batch["doc_id"], batch["input_ids"]):
        pos = 0
        while pos < len(ids):
            take = min(seq_len - len(buf), len(ids) - pos)
            buf.extend(ids[pos : pos + take])
            if not buf_docs or buf_docs[-1] != doc_id:
                buf_docs.append(doc_id)
            pos += take
            if len(buf) == seq_len:
                blocks.append(buf)
                owners.append(buf_docs)
                buf, buf_docs = [], []
    return {"input_ids": blocks, "doc_ids": owners}


def _save_atomically(dataset_dict, meta: dict[str, Any], folder: Path) -> None:
    def write(tmp: Path) -> None:
        dataset_dict.save_to_disk(str(tmp / "splits"))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))

    if not folder.exists():  # else a concurrent run finished first: its copy is identical
        write_dir_atomically(folder, write)


def _load(folder: Path) -> PackedData:
    import datasets

    splits = datasets.load_from_disk(str(folder / "splits"))
    meta = json.loads((folder / "meta.json").read_text())
    train = splits["train"]
    heldout = splits["heldout"] if "heldout" in splits else datasets.Dataset.from_dict(
        {k: [] for k in train.column_names}, features=train.features)
    return PackedData(train=train, heldout=heldout, path=folder, meta=meta)


# ---------------------------------------------------------------------------------------------
# Recall spans: copies of earlier text written into a block, so next-token prediction on the copy
# depends on reading exact keys and values far back in the cache (what retrieval tasks need).


def insert_recalls(ids, spans: int, span_len: int, generator) -> tuple[Any, Any]:
    """Overwrite `spans` slots of `span_len` tokens in the second half of each row of `ids` (B, T) with
    copies of random spans from its first half. Returns the new ids and a (B, T) mask of the tokens a
    model can only predict by recall (every copied token but the first of each span)."""
    import torch

    B, T = ids.shape
    half = T // 2
    slots = (T - half) // span_len
    if spans < 1 or span_len < 2 or spans > slots or half < span_len:
        raise DataError(f"{spans} recall spans of {span_len} tokens do not fit in blocks of {T} tokens; "
                        "use fewer or shorter spans (they fill at most the second half of a block)")
    out, mask = ids.clone(), torch.zeros_like(ids, dtype=torch.bool)
    for b in range(B):
        for slot in torch.randperm(slots, generator=generator)[:spans].tolist():
            dst = half + slot * span_len
            src = int(torch.randint(0, half - span_len + 1, (1,), generator=generator))
            out[b, dst:dst + span_len] = ids[b, src:src + span_len]
            mask[b, dst + 1:dst + span_len] = True
    return out, mask


__all__ = ["DataError", "OfflineSource", "LocalSource", "HubSource", "PackedData", "resolve_source",
           "pack_documents", "tokenizer_fingerprint", "insert_recalls"]
