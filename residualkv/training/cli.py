"""`rkv train`: pack the data, train a codec for a backbone, save it to <run dir>/codec.

    rkv train --backbone smollm2-135m --minutes 60
    rkv train --backbone smollm2-135m --steps 400 --loss rec --out data/codecs/smollm2-135m/rec-only

Rerunning the same command continues an interrupted run from its last checkpoint (the default run
name depends only on the settings); --restart discards the checkpoints, and the metrics and codec of
the discarded run, instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from .packing import pack_documents, resolve_source
from .trainer import CHECKPOINTS, CODEC, INITS, LOSSES, READINGS, REC_REDUCTIONS, TrainConfig, train_codec


def bf16_setting(value: str) -> str:
    if value != "auto":
        raise argparse.ArgumentTypeError(f"{value!r}: pass --bf16 alone (always bf16) or --bf16 auto")
    return value


def register(subparsers) -> None:
    from ..cli import at_least

    t = subparsers.add_parser("train", help="train a ResidualKV codec on a frozen backbone",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--backbone", default="smollm2-135m", help="registered name, backbone YAML, local folder or HF id")
    t.add_argument("--data", default="offline", help="'offline' (default), a folder/file of .txt/.jsonl, or a datasets name")
    t.add_argument("--text-field", default="text", help="text column of JSONL rows / hub datasets")
    t.add_argument("--data-config", default=None, help="hub dataset config name")
    t.add_argument("--data-split", default="train", help="hub dataset split")
    t.add_argument("--max-documents", type=at_least(1, "documents"), default=None, help="use only the first N hub documents")
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (fixes the LR schedule length)")
    t.add_argument("--minutes", type=float, default=None,
                   help="time budget; without --steps the schedule length is planned from the measured step time, "
                        "with it the schedule shrinks when its steps would not fit")
    t.add_argument("--batch-size", type=int, default=1)
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--lr", type=float, default=2e-4)
    t.add_argument("--warmup-frac", type=float, default=0.02)
    t.add_argument("--loss", default="rec+ntp", choices=LOSSES, help="rec: L_rec only (the ablation); rec+kd: L_rec + KL from the full cache's next-token distribution (not the seed's; see BENCHMARKS.md)")
    t.add_argument("--reading", default="reconstructed", choices=READINGS,
                   help="how L_ntp reads the cache: 'reconstructed' (the seed: every token attends over reconstructions) "
                        "or 'served' (a prompt prefilled exact, the rest scored through its compressed history; the "
                        "codec is then served with new_kv exact)")
    t.add_argument("--rec-reduction", default="sum", choices=REC_REDUCTIONS,
                   help="sum: the seed's sum of squares per sequence; mean: per-coordinate MSE (the recipes in "
                        "BENCHMARKS.md); layer-mean: each layer's MSE summed over the layers, as the authors' code "
                        "(= mean x the number of coded layers, 25 on SmolLM2)")
    t.add_argument("--rec-weight", type=float, default=1.0, help="L = rec_weight * L_rec + L_ntp")
    t.add_argument("--init", default="default", choices=INITS,
                   help="rec-warmstart: fit L_rec on captured true KV before the joint phase; fisher-pca: "
                        "closed-form Fisher-weighted decoder and an encoder regressed onto it (the fastest start)")
    t.add_argument("--warmstart-steps", type=int, default=500,
                   help="rec-warmstart: optimizer steps; fisher-pca: encoder-fit steps per layer")
    t.add_argument("--fisher-alpha", type=float, default=0.1,
                   help="fisher-pca: share of the plain metric mixed into the Fisher metric (0..1)")
    t.add_argument("--value-weight", type=float, default=1.0,
                   help="fisher-pca: how many times an error in the values counts against one in the keys "
                        "(retrieval leans on values more than the next-token Fisher says; BENCHMARKS.md)")
    t.add_argument("--warmstart-blocks", type=int, default=32)
    t.add_argument("--bits", type=int, default=None, help="latent bits while training (default: the backbone's, 4)")
    t.add_argument("--group-size", type=at_least(1, "coordinates"), default=None,
                   help="latent coordinates per quantisation group, one FP16 min and scale each (default: the "
                        "backbone's, 32); must divide d_c. Saved with the codec, which is served with it")
    t.add_argument("--d-c", type=at_least(1, "dimensions"), default=None, help="latent size (default: the backbone YAML's)")
    t.add_argument("--layer-d-c", action="append", default=[], metavar="LAYERS=D_C",
                   help="another latent size for some coded layers, e.g. 3-11=224 (repeatable; ranges skip "
                        "full-attention layers); the others keep --d-c, and KR follows the mean")
    t.add_argument("--d-ff", type=at_least(1, "dimensions"), default=None, help="SwiGLU width (default: the backbone YAML's)")
    t.add_argument("--stride", type=at_least(1, "tokens"), default=None,
                   help="reference stride (default: the backbone YAML's); saved with the codec, which is always "
                        "served with the stride it was trained for")
    t.add_argument("--init-from", default=None, metavar="CODEC_DIR",
                   help="start from the weights of a saved codec (e.g. an earlier run's <run dir>/codec) instead "
                        "of a fresh init; its shape and stride are kept")
    t.add_argument("--recall-spans", type=int, default=0,
                   help="copies of earlier text written into the second half of each training block, so the "
                        "next-token loss also asks for exact look-ups far back in the cache (0: plain text)")
    t.add_argument("--recall-span-len", type=int, default=24, help="tokens per recall span")
    t.add_argument("--out", default=None, help="run directory (default: <data>/codecs/<backbone>/<run-name>)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--bf16", nargs="?", const=True, default=False, type=bf16_setting, metavar="auto",
                   help="bf16 autocast (accelerate mixed precision); `--bf16 auto` only where the GPU or CPU "
                        "runs bf16 in hardware (AMX / AVX512-BF16), fp32 elsewhere")
    t.add_argument("--grad-checkpointing", action="store_true", help="recompute the backbone's MLPs in backward")
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--ckpt-every", type=int, default=50)
    t.add_argument("--eval-blocks", type=int, default=8, help="held-out blocks scored at the end")
    t.add_argument("--threads", type=at_least(1, "threads"), default=None,
                   help="torch CPU threads (default: torch's choice; 1 can be faster on a busy machine)")
    t.add_argument("--restart", action="store_true", help="delete this run's checkpoints, metrics and codec instead of resuming")
    t.add_argument("--json", action="store_true", help="print the result as one JSON object")
    t.set_defaults(func=cmd_train)


def run_name(args, source_name: str, start_digest: str | None = None) -> str:
    """Depends only on the settings (and the starting codec's weights), so the same command finds (and
    resumes) the same run, and a command whose `--init-from models:/NAME@champion` now names other weights
    starts a new one."""
    name = f"{args.loss.replace('+', '-')}-int{args.bits}-L{args.seq_len}-seed{args.seed}"
    if getattr(args, "init", "default") != "default":
        name += f"-init{args.init}"
    if args.rec_reduction != "sum" or args.rec_weight != 1.0:
        name += f"-rec{args.rec_reduction}{args.rec_weight:g}"
    # a different codec shape must never resume another shape's checkpoints
    for flag in ("d_c", "d_ff", "stride", "group_size"):
        if getattr(args, flag, None):
            name += f"-{flag.replace('_', '')}{getattr(args, flag)}"
    for spec in getattr(args, "layer_d_c", None) or []:
        name += "-l" + re.sub(r"[^0-9]+", "_", spec)
    if getattr(args, "reading", "reconstructed") != "reconstructed":
        name += f"-{args.reading}"
    if getattr(args, "recall_spans", 0):
        name += f"-recall{args.recall_spans}x{args.recall_span_len}"
    if getattr(args, "init_from", None):
        start = Path(args.init_from)
        name += "-from-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", (start.parent if start.name == "codec" else start).name)[:40]
        if start_digest:
            name += f"-{start_digest[:8]}"
    if source_name != "offline":
        name += "-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(source_name).name)[:40]
    return name


def cmd_train(args) -> int:
    from ..backbones import load_backbone
    from ..cli import base_config, check_codec_ref, codecs_dir, resolve_codec
    from ..codec import ResidualCodec, parse_layer_d_c
    from ..config import InputError, check_group_size

    if args.init_from and args.init != "default":
        raise InputError(f"--init {args.init} and --init-from start the codec two ways; pass one of them")
    # settings are checked before the model loads: a bad one fails in a second, not after the loading
    config = TrainConfig(seq_len=args.seq_len, steps=args.steps, minutes=args.minutes, batch_size=args.batch_size,
                         grad_accum=args.grad_accum, lr=args.lr, warmup_frac=args.warmup_frac, loss=args.loss,
                         reading=args.reading, rec_reduction=args.rec_reduction, rec_weight=args.rec_weight,
                         init="codec" if args.init_from else args.init, bf16=args.bf16,
                         warmstart_steps=args.warmstart_steps, warmstart_blocks=args.warmstart_blocks,
                         fisher_alpha=args.fisher_alpha, value_weight=args.value_weight, recall_spans=args.recall_spans,
                         recall_span_len=args.recall_span_len, init_from=args.init_from,
                         grad_checkpointing=args.grad_checkpointing, seed=args.seed, log_every=args.log_every,
                         ckpt_every=args.ckpt_every, eval_blocks=args.eval_blocks)
    # a missing --init-from or --data path (or an unreachable hub) fails before the model loads too
    check_codec_ref(args.init_from, "--init-from")
    source = resolve_source(args.data, text_field=args.text_field, config=args.data_config, split=args.data_split,
                            max_documents=args.max_documents)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, spec = load_backbone(args.backbone)
    backbone = spec.name if spec else re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(args.backbone)).name)
    codec_defaults = spec.codec if spec else {}
    start = None
    if args.init_from:
        start = resolve_codec(args.init_from, model, spec)
        start.check_shape(args.init_from, lambda field: "--" + field.replace("_", "-"), layer_d_c=args.layer_d_c,
                          **{field: getattr(args, field) for field in ("d_c", "d_ff", "stride", "bits")})
        codec_defaults = {"d_c": start.dims.d_c, "d_ff": start.dims.d_ff}
    d_c, d_ff = args.d_c or codec_defaults.get("d_c"), args.d_ff or codec_defaults.get("d_ff")
    if not d_c or not d_ff:
        raise InputError(f"{args.backbone} is not a registered backbone: pass the codec size with --d-c and --d-ff "
                         "(e.g. d_c = 2*d_k/4 and d_ff = 3*2*d_k, as in configs/backbones/smollm2-135m.yaml)")
    cache_config = start.config if start is not None else base_config(spec)
    args.bits = args.bits or cache_config.bits
    cache_config = cache_config.replace(bits=args.bits, **({"stride": args.stride} if args.stride else {}),
                                        **({"group_size": args.group_size} if args.group_size else {}))
    # CodecError, ConfigError: InputErrors, which `rkv` prints alone with exit status 2
    layer_d_c = parse_layer_d_c(args.layer_d_c, cache_config.coded_layers(model.config.num_hidden_layers))
    check_group_size(cache_config.group_size, (d_c, *layer_d_c.values()), label="--group-size ")

    packed = pack_documents(source, tokenizer, args.seq_len)
    main_process = int(os.environ.get("RANK", "0")) == 0  # under torchrun / accelerate launch: one report, not N
    if main_process:
        print(f"[rkv train] data: {packed.meta['train_blocks']} training and {packed.meta['heldout_blocks']} held-out "
              f"blocks of {args.seq_len} tokens from {source.name} ({packed.path})", file=sys.stderr, flush=True)

    start_digest = start.weights_digest() if start is not None else None
    out = Path(args.out) if args.out else codecs_dir(backbone) / run_name(args, source.name, start_digest)
    if args.restart:  # the discarded run's metrics and codec go too: neither may pass for the new run's
        for old in (out / CHECKPOINTS, out / CODEC):
            shutil.rmtree(old, ignore_errors=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if start is not None:
        start.config = cache_config  # --group-size re-groups the latents it goes on training (and is saved with)
    codec = start if start is not None else ResidualCodec.for_model(model.config, cache_config, d_c=d_c, d_ff=d_ff,
                                                                     layer_d_c=layer_d_c,
                                                                     backbone=backbone, seed=args.seed)
    metrics_file = out / "metrics.jsonl"

    def log_metrics(step: int, metrics: dict) -> None:  # the pipeline swaps this for MLflow
        with open(metrics_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    data_info = {"source": source.name, "fingerprint": packed.meta["fingerprint"], "seq_len": args.seq_len,
                 "train_blocks": packed.meta["train_blocks"], "heldout_blocks": packed.meta["heldout_blocks"]}
    result = train_codec(model, codec, packed.train, out, config, heldout_data=packed.heldout, data_info=data_info,
                         on_metrics=log_metrics)
    summary = {"codec": str(result.codec_path), "steps": result.steps, "total_steps": result.total_steps,
               "tokens": result.tokens, "train_seconds": round(result.seconds, 1), "resumed_from": result.resumed_from,
               "stopped_early": result.stopped_early, **result.metrics}
    if not main_process:
        return 0
    if args.json:
        print(json.dumps(summary))
    else:
        ev = result.metrics
        quality = (f"; held-out next-token loss {ev['eval/ntp_codec']:.4f} vs full cache {ev['eval/ntp_full']:.4f} "
                   f"(perplexity x{ev['eval/ppl_ratio']:.4f})") if ev else ""
        print(f"[rkv train] {result.steps}/{result.total_steps} steps, {result.tokens:,} tokens in "
              f"{result.seconds / 60:.1f} min{quality}")
        print(f"[rkv train] codec saved to {result.codec_path}")
    return 0


if __name__ == "__main__":  # python -m residualkv.training.cli ... (same as `rkv train ...`)
    parser = argparse.ArgumentParser(prog="python -m residualkv.training.cli")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["train", *sys.argv[1:]])
    sys.exit(ns.func(ns))
