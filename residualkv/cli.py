"""`rkv`: the command line. Each subcommand is a thin shell over the library.

Contracts other tools rely on (keep them stable, extend rather than rename):
  rkv accounting --backbone B --method M --context-len N --json   -> {kr_measured, kr_formula, cr, bytes, ...}
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

from . import accounting
from .backbones import load_backbone
from .codec import CodecError, ResidualCodec
from .config import InputError, ResidualKVConfig, load_codec_defaults
from .methods import METHODS, build_cache, get_method
from .paths import data_dir


# ---- shared helpers (also used by the training and evaluation commands) ----

def base_config(spec) -> ResidualKVConfig:
    return load_codec_defaults(spec.codec, list(spec.full_attention_layers)) if spec else ResidualKVConfig()


def codecs_dir(backbone: str) -> Path:
    return data_dir() / "codecs" / backbone


def latest_codec_path(backbone: str) -> Path | None:
    """The most recently saved codec for a backbone under the data directory, if any."""
    root = codecs_dir(backbone)
    # a training run saves <run>/codec/; a codec may also be copied in as <name>/
    found = [*root.glob("*/codec/codec.json"), *root.glob("*/codec.json")] if root.is_dir() else []
    found.sort(key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def resolve_codec(ref: str | None, model, spec, *, required: bool = True) -> ResidualCodec | None:
    """--codec PATH_OR_URI, else the latest trained codec for the backbone."""
    if ref and ref.startswith("models:/"):
        from registry.serving import load_codec  # the registry wraps MLflow; the library does not import it

        return load_codec(ref, model_config=model.config)
    path = Path(ref) if ref else (latest_codec_path(spec.name) if spec else None)
    if path is None:
        if required:
            name = spec.name if spec else "<backbone>"
            raise CodecError(f"no trained codec for {name}: train one with `rkv train --backbone {name}` "
                             "or pass --codec PATH_OR_URI")
        return None
    return ResidualCodec.load(path, model_config=model.config)


def check_codec_ref(ref: str | None, flag: str = "--codec") -> None:
    """A codec that cannot be had fails before the model loads (minutes on a large model): a local path
    that does not exist, or a models:/ URI the registry does not serve (its own error, which says why)."""
    if ref and ref.startswith("models:/"):
        from registry.serving import servable_version  # the registry wraps MLflow; the library does not import it

        servable_version(ref)
    elif ref and not Path(ref).exists():
        raise CodecError(f"{flag} {ref}: no such codec folder; pass the `codec` folder `rkv train` saved, or a "
                         "registry URI models:/NAME@ALIAS")


def untrained_codec(model, spec, cfg: ResidualKVConfig) -> ResidualCodec:
    return ResidualCodec.for_model(model.config, cfg, d_c=spec.codec["d_c"], d_ff=spec.codec["d_ff"],
                                   backbone=spec.name)


def context_ids(tokenizer, n_tokens: int, batch: int = 1) -> torch.Tensor:
    from .data import offline_text

    ids = tokenizer(offline_text(n_tokens * 8), return_tensors="pt").input_ids[:, : n_tokens * batch]
    if ids.shape[1] < n_tokens * batch:
        raise InputError(f"the offline corpus gave only {ids.shape[1]} tokens; ask for a shorter --context-len")
    return ids.reshape(batch, n_tokens)


def prefill_then_decode(model, ids: torch.Tensor, cache, steps: int) -> float:
    """Prefill `ids` into `cache`, then decode `steps` greedy tokens; returns the prefill's seconds. The
    prefill attends densely in every mode: CR of a sparse mode is what the decode steps read."""
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        prefill_s = time.perf_counter() - t0
        for _ in range(steps):
            logits = model(input_ids=logits[:, -1:].argmax(-1), cache=cache, use_cache=True).logits
    return prefill_s


# ---- subcommands ----

def method_name(name: str) -> str:
    """argparse type: a registered method or one of its suffixed variants (residualkv-r08, -w64...)."""
    from .evaluation.harness import VARIANTS_HELP, known_method

    if not known_method(name):
        raise argparse.ArgumentTypeError(f"unknown method {name!r}; known: {', '.join(METHODS)}, and variants: "
                                         f"{VARIANTS_HELP}")
    return name


def cmd_accounting(args) -> int:
    from .evaluation.harness import build_method_cache, method_needs_codec

    check_codec_ref(args.codec)
    model, tok, spec = load_backbone(args.backbone)
    cfg = base_config(spec)
    codec, codec_note = None, "none"
    if method_needs_codec(args.method):
        codec = resolve_codec(args.codec, model, spec, required=False)
        codec_note = "trained" if codec is not None else "untrained (bytes do not depend on weights)"
        codec = codec or untrained_codec(model, spec, cfg)
    cache = build_method_cache(args.method, model, codec, cfg)
    ids = context_ids(tok, args.context_len, args.batch)
    t0 = time.perf_counter()
    prefill_s = prefill_then_decode(model, ids, cache, args.decode_steps)
    rep = accounting.report(cache)
    rep.update({"backbone": args.backbone, "method": args.method, "context_len": args.context_len,
                "decode_steps": args.decode_steps, "batch": args.batch, "codec": codec_note,
                "prefill_seconds": prefill_s, "decode_seconds": time.perf_counter() - t0 - prefill_s})
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(accounting.explain(rep))
        for k, v in rep["bytes"].items():
            print(f"  {k:28s} {v:>12,d} B")
    return 0


def _generate(model, tok, prompt: str, cache, max_new_tokens: int) -> str:
    if tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, cache=cache, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)


def cmd_generate(args) -> int:
    from .evaluation.harness import build_method_cache, method_needs_codec

    check_codec_ref(args.codec)
    model, tok, spec = load_backbone(args.backbone)
    codec = resolve_codec(args.codec, model, spec) if method_needs_codec(args.method) else None
    cache = build_method_cache(args.method, model, codec, base_config(spec))
    print(_generate(model, tok, args.prompt, cache, args.max_new_tokens))
    rep = accounting.report(cache)
    print(f"[{args.method}] measured KR {rep['kr_measured']:.2%} (formula {rep['kr_formula']:.2%}), CR {rep['cr']:.0%}",
          file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    check_codec_ref(args.codec)
    print(f"loading {args.backbone} (offline) …", flush=True)
    model, tok, spec = load_backbone(args.backbone)
    cfg = base_config(spec)
    codec = resolve_codec(args.codec, model, spec, required=False)
    note = "trained codec" if codec is not None else "UNTRAINED codec: text will be poor until `rkv train` has run"
    codec = codec or untrained_codec(model, spec, cfg)
    prompt = args.prompt
    for name in ("full", "residualkv-dagger", "residualkv"):
        cache = build_cache(name, model, codec, cfg)
        t0 = time.perf_counter()
        answer = _generate(model, tok, prompt, cache, args.max_new_tokens)
        rep = accounting.report(cache)
        print(f"\n== {name} ({note if name == 'residualkv' else get_method(name).description})")
        print(f"   {answer.strip()!r}")
        print(f"   measured KR {rep['kr_measured']:.2%}  formula {rep['kr_formula']:.2%}  CR {rep['cr']:.0%}  "
              f"{time.perf_counter() - t0:.1f}s")
    print("\nByte accounting at 4096 tokens: rkv accounting --backbone smollm2-135m --method residualkv --context-len 4096")
    return 0


def cmd_lowram_init(args) -> int:
    from .config import LowRAMConfig
    from .lowram.meta import learn_starts
    from .lowram.starts import starts_root
    from .training.packing import pack_documents, resolve_source

    config = LowRAMConfig(ratio=args.ratio)  # checked before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, spec = load_backbone(args.backbone)
    name = spec.name if spec else Path(str(args.backbone)).name
    packed = pack_documents(resolve_source(args.data, text_field=args.text_field), tok, args.seq_len)
    n_train, n_held = len(packed.train), len(packed.heldout)
    if n_train < args.contexts or n_held < args.heldout:
        raise InputError(f"{args.data} packs {n_train} training and {n_held} held-out blocks of {args.seq_len} "
                         f"tokens; ask for fewer --contexts / --heldout or a shorter --seq-len")
    # contexts drawn across the whole training split, not the first few documents
    pick = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed))[:args.contexts].sort().values
    train_ids = torch.tensor(packed.train.select(pick.tolist())["input_ids"])
    heldout_ids = torch.tensor(packed.heldout.select(range(args.heldout))["input_ids"])
    out = Path(args.out) if args.out else starts_root() / name / (
        f"L{args.seq_len}-n{args.contexts}-r{args.ratio:g}-w{args.warm_steps}-m{args.meta_steps}-k{args.inner_steps}-s{args.seed}")
    # rerunning the same command after a crash continues from here
    checkpoint = out.with_name(f".{out.name}.checkpoint.pt")
    starts = learn_starts(model, train_ids, heldout_ids, config, warm_steps=args.warm_steps,
                          meta_steps=args.meta_steps, inner_steps=args.inner_steps, accumulate=args.accumulate,
                          outer_lr=args.outer_lr, eval_steps=tuple(args.eval_steps), seed=args.seed, backbone=name,
                          checkpoint=checkpoint)
    starts.save(out)
    checkpoint.unlink(missing_ok=True)
    summary = {"path": str(out), **{k: starts.meta[k] for k in ("heldout_relative_error", "seconds")}}
    print(json.dumps(summary, indent=2) if args.json else
          f"[rkv lowram-init] saved {out}; methods lowram-warm, lowram-meta and lowram-q-meta now start from it")
    return 0


def at_least(minimum: int, what: str):
    """argparse type: an integer >= minimum, else a usage error that says what the number counts."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer number of {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"needs at least {minimum} {what}, got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rkv", description="ResidualKV: learned KV-cache compression for HF LLMs")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("accounting", help="measured KR/CR of a method at a context length")
    a.add_argument("--backbone", default="smollm2-135m")
    a.add_argument("--method", default="residualkv", type=method_name, help="a method of `rkv eval`, variants included")
    a.add_argument("--context-len", type=at_least(16, "tokens"), default=4096)
    a.add_argument("--batch", type=at_least(1, "rows"), default=1)
    a.add_argument("--decode-steps", type=at_least(0, "steps"), default=8, help="greedy tokens decoded after the prefill (CR is measured on them)")
    a.add_argument("--codec", default=None, help="codec directory or models:/NAME@ALIAS (default: latest trained)")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=cmd_accounting)

    g = sub.add_parser("generate", help="answer a prompt with a compressed cache")
    g.add_argument("prompt")
    g.add_argument("--backbone", default="smollm2-135m")
    g.add_argument("--method", default="residualkv", type=method_name, help="a method of `rkv eval`, variants included")
    g.add_argument("--codec", default=None)
    g.add_argument("--max-new-tokens", type=at_least(1, "tokens"), default=64)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="load SmolLM2 offline, generate with the compressed cache, print measured KR")
    d.add_argument("--backbone", default="smollm2-135m")
    d.add_argument("--codec", default=None)
    d.add_argument("--prompt", default="Explain in two sentences what a key-value cache is in a transformer.")
    d.add_argument("--max-new-tokens", type=at_least(1, "tokens"), default=48)
    d.set_defaults(func=cmd_demo)

    li = sub.add_parser("lowram-init", help="learn LowRAM's predictor starts for a backbone (warm start + FOMAML "
                        "meta-init), read by the methods lowram-warm, lowram-meta and lowram-q-meta")
    li.add_argument("--backbone", default="smollm2-135m")
    li.add_argument("--data", default="offline", help="'offline' (default), a folder/file of .txt/.jsonl, or a datasets name")
    li.add_argument("--text-field", default="text", help="text column of JSONL rows / hub datasets")
    li.add_argument("--contexts", type=at_least(1, "contexts"), default=16, help="training contexts (blocks of the training split)")
    li.add_argument("--heldout", type=at_least(1, "contexts"), default=4, help="held-out contexts the fit errors are measured on")
    li.add_argument("--seq-len", type=at_least(16, "tokens"), default=2048, help="tokens per context")
    li.add_argument("--ratio", type=float, default=4.0, help="LowRAM ratio whose xKV keys the predictors read")
    li.add_argument("--warm-steps", type=at_least(0, "steps"), default=25, help="Adam steps of the warm start on the pooled contexts (seed: 25)")
    li.add_argument("--meta-steps", type=at_least(0, "steps"), default=50, help="FOMAML outer steps")
    li.add_argument("--inner-steps", type=at_least(1, "steps"), default=2, help="online Adam steps the meta-init is learnt for (seed: 2)")
    li.add_argument("--accumulate", type=at_least(1, "contexts"), default=8, help="contexts per outer step (seed: 8)")
    li.add_argument("--outer-lr", type=float, default=3e-4, help="outer AdamW learning rate (seed: 3e-4)")
    li.add_argument("--eval-steps", type=lambda t: [int(x) for x in t.split(",")], default=[0, 2],
                    help="online step counts whose held-out error is measured from each start, e.g. 0,2,150")
    li.add_argument("--seed", type=int, default=0)
    li.add_argument("--threads", type=at_least(1, "threads"), default=None)
    li.add_argument("--out", default=None, help="folder to save to (default: <data dir>/lowram/<backbone>/<settings>)")
    li.add_argument("--json", action="store_true", help="print the path, held-out errors and timings as JSON")
    li.set_defaults(func=cmd_lowram_init)

    from .evaluation.cli import register as register_eval
    from .training.cli import register as register_train

    register_train(sub)
    register_eval(sub)
    # `rkv run / bench-regress / deploy` live with the flows, which own Prefect and MLflow; flows.cli
    # imports neither until a command runs, so the library stays free of them
    importlib.import_module("flows.cli").register(sub)
    importlib.import_module("registry.cli").register(sub)  # `rkv registry`: likewise, MLflow only when it runs
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as error:  # bad input (config, codec, backbone, task file, profile...): the message names it and the fix
        print(f"rkv {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
