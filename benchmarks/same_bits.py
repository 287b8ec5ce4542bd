"""Same bits? A digest of what each method generates and stores, to compare two trees of the library.

A speed change that claims "bit-identical" must leave greedy tokens, the logits of every step and
every byte the caches store unchanged. This script runs each method on one fixed prompt through
`model.generate` and records, per method, the tokens, a SHA-256 of the per-step logits (float32) and
a SHA-256 of every tensor the cache holds (references, packed codes with their mins and scales,
reference indices, windows, eviction ordinals; the full cache's keys and values), layer by layer.
Run it once against each tree (`--tree` picks the library it imports) and compare:

    python benchmarks/same_bits.py --tree /path/to/old/checkout --out /tmp/old.json
    python benchmarks/same_bits.py --out /tmp/new.json
    python benchmarks/same_bits.py --compare /tmp/old.json /tmp/new.json   # exit 1 on any difference

Without --codec the latest trained codec for the backbone is used, else an untrained one at the
backbone's dims (seeded, so both trees build the same weights; bits do not need a good codec).
Runs on CPU with 1 thread: another thread count may round differently.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from trees import check_tree, describe, use_tree

DEFAULT_METHODS = "full,kivi4,residualkv-standalone,residualkv,residualkv-snapkv,omnikv"
# the tensors a store holds, by attribute name, in the order they are digested
STORED = ("refs", "codes", "ref_idx", "win", "ref_ord", "code_ord", "ref_visible", "kq", "vq", "win_k", "win_v",
          "k", "v")


def tensor_digest(h, t) -> None:
    import torch

    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def value_digest(h, name: str, value) -> None:
    import torch

    if value is None:
        return
    h.update(name.encode())
    if isinstance(value, torch.Tensor):
        tensor_digest(h, value)
    else:  # a NamedTuple of tensors (quant.Packed)
        for field in value._fields:
            value_digest(h, f"{name}.{field}", getattr(value, field))


def store_digest(h, store) -> None:
    inner = getattr(store, "stores", None)  # RowStores: one store per row after SnapKV
    if isinstance(inner, list):
        for s in inner:
            store_digest(h, s)
        return
    for name in STORED:
        if name == "ref_idx" and getattr(store, name, None) is not None:
            # by value, as int64: their storage went from int16 to bit-packed (quant.PackedIndices), and
            # trees on either side of that change must still compare; unit tests pin the packing itself
            value_digest(h, name, store.indices.unpack() if hasattr(store, "indices") else store.ref_idx.long())
        elif hasattr(store, name):
            value_digest(h, name, getattr(store, name))


def cache_digests(cache) -> list[str]:
    """One SHA-256 per layer of everything the layer stores."""
    out = []
    for layer in cache.layers:
        h = hashlib.sha256()
        stores = getattr(layer, "stores", None)
        if stores is None:  # transformers' DynamicLayer (the full cache)
            value_digest(h, "keys", layer.keys)
            value_digest(h, "values", layer.values)
        else:
            for s in stores:
                store_digest(h, s)
        out.append(h.hexdigest())
    return out


def run(args) -> dict:
    tree = use_tree(args.tree)
    import torch

    torch.set_num_threads(1)
    from residualkv.attention import install
    from residualkv.backbones import load_backbone
    from residualkv.cli import base_config, context_ids, latest_codec_path, untrained_codec
    from residualkv.codec import ResidualCodec
    from residualkv.methods import build_cache, get_method

    check_tree(tree)
    model, tok, spec = load_backbone(args.backbone)
    install(model)
    cfg = base_config(spec)
    path = args.codec or latest_codec_path(spec.name)
    if path:
        codec, codec_desc = ResidualCodec.load(path, model_config=model.config), f"trained ({path})"
    else:
        torch.manual_seed(0)
        codec, codec_desc = untrained_codec(model, spec, cfg), "untrained, seed 0"
    ids = context_ids(tok, args.prompt_len, batch=args.batch)
    mask = torch.ones_like(ids)
    for b in range(1, args.batch):  # later rows shorter, left-padded: the row-group paths
        cut = 37 * b
        ids[b, cut:] = ids[b, :-cut].clone()
        ids[b, :cut] = tok.pad_token_id if tok.pad_token_id is not None else 0
        mask[b, :cut] = 0
    rows = {}
    for name in args.methods.split(","):
        method = get_method(name)
        # a small budget, so that the selecting methods really select (and SnapKV evicts) on a short prompt
        sparse = name in ("residualkv", "residualkv-snapkv", "omnikv")
        changes = {"select_budget": args.select_budget} if sparse else {}
        cache = build_cache(name, model, codec if method.needs_codec else None, cfg, **changes)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        h = hashlib.sha256()
        for s in out.scores:
            tensor_digest(h, s.float())
        rows[name] = {"tokens": out.sequences[:, ids.shape[1]:].tolist(), "logits_sha256": h.hexdigest(),
                      "stored_sha256_per_layer": cache_digests(cache),
                      "seconds": round(time.perf_counter() - t0, 2)}
        print(f"{name}: {rows[name]['seconds']} s, tokens {rows[name]['tokens']}", file=sys.stderr)
    return {"tree": str(tree), "commit": describe(tree), "backbone": spec.name, "codec": codec_desc,
            "prompt_len": args.prompt_len,
            "batch": args.batch, "select_budget": args.select_budget, "new_tokens": args.new_tokens,
            "torch": torch.__version__, "methods": rows}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    setup = ("backbone", "codec", "prompt_len", "batch", "new_tokens", "select_budget")
    if any(a[k] != b[k] for k in setup):
        raise SystemExit(f"the two runs differ in set-up ({', '.join(f'{k}: {a[k]} / {b[k]}' for k in setup)}): "
                         "rerun them with the same options")
    differ = 0
    for name in sorted(set(a["methods"]) | set(b["methods"])):
        ra, rb = a["methods"].get(name), b["methods"].get(name)
        if ra is None or rb is None:
            print(f"{name}: only in {'the first' if rb is None else 'the second'} run")
            continue
        bad = [f for f in ("tokens", "logits_sha256") if ra[f] != rb[f]]
        sa, sb = ra["stored_sha256_per_layer"], rb["stored_sha256_per_layer"]
        layers = [i for i, (x, y) in enumerate(zip(sa, sb)) if x != y]
        if len(sa) != len(sb):
            layers.append("count")
        if layers:
            bad.append(f"stored bytes (layers {layers})")
        differ += bool(bad)
        print(f"{name}: {'identical' if not bad else 'DIFFERENT: ' + ', '.join(bad)}"
              f" ({ra['seconds']} s / {rb['seconds']} s)")
    return 1 if differ else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]),
                   help="root of the checkout whose residualkv/ to import (default: this one)")
    p.add_argument("--backbone", default="smollm2-135m")
    p.add_argument("--codec", help="codec directory (default: the latest trained one, else untrained, seed 0)")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--prompt-len", type=int, default=700)
    p.add_argument("--batch", type=int, default=1,
                   help="rows; rows after the first are left-padded, 37 tokens more each")
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--select-budget", type=int, default=128,
                   help="tokens OmniKV selects per step / SnapKV keeps (residualkv, residualkv-snapkv, omnikv)")
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two runs' files and exit")
    args = p.parse_args()
    if args.compare:
        raise SystemExit(compare(*args.compare))
    res = run(args)
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
