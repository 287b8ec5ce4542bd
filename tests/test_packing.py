"""Data packing: documents -> EOS-separated token stream -> exact seq_len blocks, split by document."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from residualkv.data import is_heldout
from residualkv.training.packing import (DataError, HubSource, LocalSource, OfflineSource, pack_documents,
                                         resolve_source)

N_DOCS, N_WORDS = 40, 80


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer: <unk>=0, <eos>=1, d0..d39 (one marker per document), w0..w79."""
    words = ["<unk>", "<eos>"] + [f"d{i}" for i in range(N_DOCS)] + [f"w{i}" for i in range(N_WORDS)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")


def doc_text(i: int) -> str:
    """Document i: its marker d{i}, then 30..160 words."""
    n = 30 + (i * 37) % 131
    return " ".join([f"d{i}"] + [f"w{(i * 7 + j * 3) % N_WORDS}" for j in range(n)])


def write_corpus(folder, n_docs: int = N_DOCS):
    """Documents 0..n/2-1 as .txt files, the rest as rows of one .jsonl file (ids 'row-i')."""
    folder.mkdir(parents=True, exist_ok=True)
    half = n_docs // 2
    for i in range(half):
        (folder / f"doc{i:02d}.txt").write_text(doc_text(i))
    with open(folder / "rows.jsonl", "w") as f:
        for i in range(half, n_docs):
            f.write(json.dumps({"id": f"row-{i}", "text": doc_text(i)}) + "\n")
    return folder


def doc_ids_of(folder, n_docs: int = N_DOCS) -> dict[int, str]:
    half = n_docs // 2
    return {i: (f"doc{i:02d}.txt" if i < half else f"row-{i}") for i in range(n_docs)}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_blocks_are_exact_and_split_by_document(tmp_path, tok):
    corpus = write_corpus(tmp_path / "corpus")
    packed = pack_documents(LocalSource(corpus), tok, 64, heldout_fraction=0.25, root=tmp_path / "packed")
    ids = doc_ids_of(corpus)
    held = {i for i, d in ids.items() if is_heldout(d, 0.25)}
    assert held and len(held) < N_DOCS  # the fixture exercises both sides
    markers = {tok.convert_tokens_to_ids(f"d{i}"): i for i in range(N_DOCS)}

    for split, expect_held in (("train", False), ("heldout", True)):
        blocks = getattr(packed, split)
        assert len(blocks) > 0
        for row in blocks:
            assert len(row["input_ids"]) == 64
            seen = {markers[t] for t in row["input_ids"] if t in markers}
            assert all((i in held) == expect_held for i in seen), f"{split} block holds a document of the other split"
            assert all(is_heldout(d, 0.25) == expect_held for d in row["doc_ids"])

    # the training blocks are the train documents, in order, each followed by EOS, cut every 64 tokens
    stream = []
    for i in range(N_DOCS):
        if i not in held:
            stream += tok(doc_text(i), add_special_tokens=False).input_ids + [tok.eos_token_id]
    flat = [t for row in packed.train for t in row["input_ids"]]
    assert flat == stream[: len(stream) // 64 * 64]
    assert packed.meta["train_blocks"] == len(stream) // 64


def test_packed_sets_are_reused_and_keyed_by_inputs(tmp_path, tok):
    corpus = write_corpus(tmp_path / "corpus")
    root = tmp_path / "packed"
    a = pack_documents(LocalSource(corpus), tok, 64, root=root)
    b = pack_documents(LocalSource(corpus), tok, 64, root=root)
    assert a.path == b.path and (a.path / "splits").is_dir()
    assert pack_documents(LocalSource(corpus), tok, 32, root=root).path != a.path
    (corpus / "doc00.txt").write_text(doc_text(0) + " w1")  # edited documents are packed again
    assert pack_documents(LocalSource(corpus), tok, 64, root=root).path != a.path
    assert not list(root.glob(".*"))  # no temporary folders left behind


def test_hub_code_path_on_a_local_dataset(tmp_path, tok):
    # `datasets.load_dataset` on a local folder runs the same code as a hub name, offline
    folder = tmp_path / "hubdata"
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as f:
        for i in range(N_DOCS):
            f.write(json.dumps({"body": doc_text(i)}) + "\n")
    cache = str(tmp_path / "hf-cache")  # not the machine-wide datasets cache other processes write to
    with pytest.raises(DataError, match="--text-field"):
        HubSource(str(folder), cache_dir=cache).load()
    source = HubSource(str(folder), text_field="body", cache_dir=cache)
    packed = pack_documents(source, tok, 64, root=tmp_path / "packed")
    assert len(packed.train) > 0 and all(len(r["input_ids"]) == 64 for r in packed.train)
    assert all(d.startswith(f"{folder}:") for r in packed.train for d in r["doc_ids"])


def test_resolve_source_and_errors(tmp_path, tok):
    assert isinstance(resolve_source(None), OfflineSource)
    assert isinstance(resolve_source("offline"), OfflineSource)
    assert isinstance(resolve_source(str(tmp_path)), LocalSource)
    assert isinstance(resolve_source("HuggingFaceFW/fineweb-edu"), HubSource)  # not loaded here
    with pytest.raises(DataError, match="no such file"):
        resolve_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="no .txt"):
        LocalSource(tmp_path).files()

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "rows.jsonl").write_text('{"text": "w1 w2"}\n{"txt": "w3"}\n')
    with pytest.raises(DataError, match=r"rows.jsonl:2 .*'text'"):
        list(LocalSource(bad).documents())

    single = tmp_path / "corpus.json"  # a JSON array is not text: packing it would train on raw JSON
    single.write_text('[{"text": "w1 w2"}]')
    with pytest.raises(DataError, match=r"corpus.json: a .json file is neither text .* \.jsonl line"):
        LocalSource(single).files()
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "a.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"a.txt is not UTF-8 text .* re-encode it"):
        list(LocalSource(latin).documents())
    (latin / "a.txt").unlink()
    (latin / "rows.JSONL").write_bytes(b'{"text": "w1"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"rows.JSONL is not UTF-8"):  # found whatever the suffix's case
        list(LocalSource(latin).documents())

    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text("w1 w2 w3")
    with pytest.raises(DataError, match="lower --seq-len"):
        pack_documents(LocalSource(small), tok, 64, heldout_fraction=0.0, root=tmp_path / "packed")


def test_a_pack_without_held_out_documents_is_reused(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    tok = tiny_tokenizer()
    first = pack_documents(LocalSource(corpus), tok, 64, heldout_fraction=0.0, root=tmp_path / "packed")
    again = pack_documents(LocalSource(corpus), tok, 64, heldout_fraction=0.0, root=tmp_path / "packed")
    assert len(first.heldout) == len(again.heldout) == 0
    assert again.train["input_ids"] == first.train["input_ids"]


def test_another_module_reader_keeps_the_offline_ids():
    """A corpus read from the stdlib another way (benchmarks/stdlib_code_corpus.py reads whole files) keeps
    the default corpus's document ids, so its train / held-out split is the same."""
    from residualkv.data import offline_documents

    default = {doc_id for doc_id, _ in offline_documents()}
    marked = dict(offline_documents(text_of=lambda path: f"{path.name} " * 400))
    assert default and default <= set(marked)
    stdlib = {doc_id.removeprefix("stdlib:"): text for doc_id, text in marked.items() if doc_id.startswith("stdlib:")}
    assert stdlib and all(text.startswith(path.rsplit("/", 1)[-1] + " ") for path, text in stdlib.items())


def test_the_package_docs_corpus_adds_training_text_only(tmp_path):
    """benchmarks/package_docs_corpus.py doubles the offline training text with installed packages'
    docstrings: the offline documents come through unchanged under their ids, and every added document is
    one the split trains on, so the held-out set (the haystacks' source) is the offline corpus's."""
    import importlib.util

    from residualkv.data import offline_documents

    script = Path(__file__).parent.parent / "benchmarks" / "package_docs_corpus.py"
    spec = importlib.util.spec_from_file_location("package_docs_corpus", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "corpus.jsonl"
    assert module.main([str(out), "--ratio", "0.05"]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    offline = list(offline_documents())
    assert [(r["id"], r["text"]) for r in rows[: len(offline)]] == offline
    added = rows[len(offline):]
    assert added and all(r["id"].startswith("site:") and not is_heldout(r["id"]) for r in added)
    budget = 0.05 * sum(len(t) for d, t in offline if not is_heldout(d))
    assert sum(len(r["text"]) for r in added[:-1]) < budget <= sum(len(r["text"]) for r in added)
