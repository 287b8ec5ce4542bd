"""Train a ResidualKV codec on a frozen backbone (seed §2.9).

    L = w · L_rec + L_ntp        (w = rec_weight, 1 by default: the seed's L = L_rec + L_ntp)

L_ntp is the next-token cross-entropy of the backbone run with a ResidualKVCache, i.e. every layer
attends over the *reconstructed* keys and values of the sequence (codes quantised to `bits` with a
straight-through estimator), so its gradient reaches the codec through the frozen backbone.
`loss: rec+kd` swaps L_ntp for L_kd, the KL divergence from the full cache's next-token distribution to
the compressed cache's, per token (not in the seed; see BENCHMARKS.md): L_ntp rewards any change of the
model that fits the training corpus better, so a codec trained on one narrow corpus also becomes a
domain adapter; L_kd asks only that the compressed cache make the model say what the full cache makes
it say. The teacher is the same frozen backbone run without the cache (no gradient).
L_rec is the squared error between each compressed layer's true pre-RoPE kv and its reconstruction,
summed over layers, tokens and coordinates as the seed writes it (`rec_reduction="sum"`, averaged
over the sequences of a batch), or the mean per coordinate (`"mean"`, an MSE). Both are taken from
the same forward pass (the cache's `collect_rec_loss` hook).

Only the codec trains: the backbone's parameters have requires_grad=False and it stays in eval mode.
`accelerate` places the work, runs bf16 autocast and gradient accumulation, and scales out under
`accelerate launch` (the codec is all that DDP synchronises). The run directory holds

    checkpoints/step-N/   codec weights, optimizer, scheduler, RNG states, data position (last 2 kept)
    codec/                the trained codec (ResidualCodec.save), written at the end

and a run started on a directory with checkpoints resumes from the newest one, on the same data order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, Sampler

from ..backbones import kv_digest
from ..cache import ResidualKVCache
from ..codec import ResidualCodec
from ..config import InputError, ResidualKVConfig
from ..saved import write_dir_atomically
from .packing import insert_recalls
from .warmstart import coding_config

LOSSES = ("rec+ntp", "rec", "ntp", "rec+kd")
# how the next-token loss reads the cache: "reconstructed" (the seed's: one teacher-forced forward, every
# token attends over reconstructions) or "served" (each block split at a random point: the prefix runs as a
# prompt prefill reading its own exact keys and values and is stored compressed, the rest is scored
# reading that compressed history: `new_kv: exact`, how a serving engine prefills; not in the seed)
READINGS = ("reconstructed", "served")
INITS = ("default", "zero-decoder", "rec-warmstart", "fisher-pca", "codec")
REC_REDUCTIONS = ("sum", "mean", "layer-mean")
CHECKPOINTS = "checkpoints"
CODEC = "codec"
STATE = "trainer_state.json"
# Config fields a resumed run must share with the run it continues (the rest may change between runs).
RESUME_FIELDS = ("seq_len", "batch_size", "grad_accum", "lr", "warmup_frac", "weight_decay", "loss",
                 "rec_reduction", "rec_weight", "seed", "init", "recall_spans", "recall_span_len", "reading",
                 "bf16", "max_grad_norm")
# Held-out recall probe (evaluate): copies of earlier text in each block, scored only where predicting
# them needs the copied source; fixed so that codecs trained any way are compared on the same probe.
EVAL_RECALL_SPANS, EVAL_RECALL_SPAN_LEN = 4, 24


class TrainError(InputError):
    """Training cannot start or continue; the message names the setting and how to fix it."""


@dataclass
class TrainConfig:
    seq_len: int = 512
    steps: int | None = None  # optimizer steps; fixes the LR schedule length
    minutes: float | None = None  # wall-clock budget of this invocation (see CodecTrainer.plan)
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 2e-4
    warmup_frac: float = 0.02
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    loss: str = "rec+ntp"
    reading: str = "reconstructed"  # see READINGS
    rec_reduction: str = "sum"
    rec_weight: float = 1.0
    init: str = "default"  # "default" (nn.Linear init), "zero-decoder" (start at kv_hat = mean_ref) or
    # "rec-warmstart" (fit L_rec on captured true KV first) or "fisher-pca" (closed-form Fisher-weighted
    # decoder, encoder regressed onto it), see warmstart.py, or "codec" (go on from the weights of the codec
    # passed in, e.g. an earlier run's: `rkv train --init-from DIR`)
    warmstart_steps: int = 500  # rec-warmstart: optimizer steps; fisher-pca: encoder-fit steps per layer
    warmstart_blocks: int = 32
    fisher_alpha: float = 0.1  # fisher-pca: weight of the plain (unweighted) metric mixed into the Fisher
    value_weight: float = 1.0  # fisher-pca: how many times a value error counts against a key error
    bf16: bool | str = False  # "auto": where bf16 runs in hardware (resolve_bf16); a bool after __post_init__
    grad_checkpointing: bool = False
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 50
    keep_checkpoints: int = 2
    eval_blocks: int = 8  # held-out blocks scored at the end (0: none)
    # recall spans per training block (packing.insert_recalls; 0: the text as packed) and their length
    recall_spans: int = 0
    recall_span_len: int = 24
    init_from: str | None = None  # init "codec": where the starting codec came from (recorded, not read)

    def __post_init__(self) -> None:
        _check(self.seq_len >= 2, "seq_len", self.seq_len, "use at least 2 tokens per sequence")
        _check(self.steps is not None or self.minutes is not None, "steps", self.steps,
               "pass --steps N (schedule length) or --minutes M (time budget), or both")
        _check(self.steps is None or self.steps >= 1, "steps", self.steps, "train at least one step")
        _check(self.minutes is None or self.minutes > 0, "minutes", self.minutes, "give a positive time budget")
        for name in ("batch_size", "grad_accum", "log_every", "ckpt_every", "keep_checkpoints"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "use a positive integer")
        _check(self.lr > 0, "lr", self.lr, "use a positive learning rate (seed: 2e-4)")
        _check(0 <= self.warmup_frac < 1, "warmup_frac", self.warmup_frac, "use a fraction in [0, 1) (seed: 0.02)")
        _check(self.loss in LOSSES, "loss", self.loss, f"choose one of {LOSSES}")
        _check(self.reading in READINGS, "reading", self.reading, f"choose one of {READINGS}")
        _check(self.reading != "served" or self.seq_len >= 8, "seq_len", self.seq_len,
               "reading 'served' splits each block into a prompt and a scored rest: use at least 8 tokens")
        _check(self.rec_reduction in REC_REDUCTIONS, "rec_reduction", self.rec_reduction, f"choose one of {REC_REDUCTIONS}")
        _check(self.rec_weight >= 0, "rec_weight", self.rec_weight, "use a non-negative weight")
        _check(self.init in INITS, "init", self.init, f"choose one of {INITS}")
        _check(self.warmstart_steps >= 1 and self.warmstart_blocks >= 1, "warmstart_steps", self.warmstart_steps,
               "use at least one warm-start step and block")
        _check(0 <= self.fisher_alpha <= 1, "fisher_alpha", self.fisher_alpha, "use a weight in [0, 1] (default 0.1)")
        _check(self.value_weight > 0, "value_weight", self.value_weight, "use a positive weight (1: keys and values alike)")
        _check(isinstance(self.bf16, bool) or self.bf16 == "auto", "bf16", self.bf16,
               "use true, false or \"auto\" (bf16 where the GPU or CPU runs it in hardware)")
        self.bf16 = resolve_bf16(self.bf16)
        _check(self.eval_blocks >= 0, "eval_blocks", self.eval_blocks, "use 0 or more held-out blocks")
        _check((self.init == "codec") == bool(self.init_from), "init_from", self.init_from,
               "init 'codec' goes on from a saved codec: give both init: codec and init_from: DIR_OR_URI, or neither")
        _check(self.recall_span_len >= 2, "recall_span_len", self.recall_span_len, "use spans of 2 or more tokens")
        slots = (self.seq_len - self.seq_len // 2) // self.recall_span_len
        _check(0 <= self.recall_spans <= slots and (self.recall_spans == 0 or self.seq_len // 2 >= self.recall_span_len),
               "recall_spans", self.recall_spans,
               f"use 0 to {slots} spans of {self.recall_span_len} tokens (they fill at most the second half of a "
               f"{self.seq_len}-token block), or a shorter --recall-span-len")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def _check(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise TrainError(f"invalid {name}={value!r}: {fix}")


# ---------------------------------------------------------------------------------------------
# The objective: one module holding the trainable codec and the frozen backbone, so accelerate wraps a
# single forward (DDP hooks, autocast) and DDP sees only the codec's parameters (the others need no grad).


def trained_reading(codec: ResidualCodec):
    """The cache config a codec is teacher-force-evaluated with (and trained with under the seed's reading):
    standalone (the paper trains the codec reconstructing every token, whatever mode serves it), the
    sequence's own tokens included, and no FP16 recent window (`coding_config`)."""
    return coding_config(codec.config).replace(new_kv="reconstructed")


def served_reading(codec: ResidualCodec):
    """The cache config of reading 'served': a forward call's own tokens read exact (a prompt prefill, or a
    chunk after it), the history written by earlier calls read back from the compressed store (all of
    it: no FP16 recent window, `coding_config`)."""
    return coding_config(codec.config).replace(new_kv="exact")


def served_split(seq_len: int, generator: torch.Generator | None = None) -> int:
    """Where reading 'served' splits a block: prompt = tokens [0, p), scored rest = [p, seq_len), p drawn
    uniformly from the middle half so both sides are long (the prompt: history to retrieve from; the rest:
    tokens whose loss reads it). The trainer passes a generator seeded by the data position, so a resumed
    run splits each block where the uninterrupted run did."""
    lo, hi = seq_len // 4, max(seq_len // 4 + 1, (3 * seq_len) // 4)
    return int(torch.randint(lo, hi, (1,), generator=generator))


def served_forward(model: nn.Module, cache: ResidualKVCache, ids: torch.Tensor, start: int, **kwargs):
    """Reading 'served' of ids (B, T): tokens [0, start) prefilled (their attention reads their exact kv;
    the cache stores them compressed), then tokens [start, T) run through that compressed history; returns
    the second call's output (`kwargs`: labels, logits_to_keep...)."""
    model(input_ids=ids[:, :start], cache=cache, use_cache=True, logits_to_keep=1)
    return model(input_ids=ids[:, start:], cache=cache, use_cache=True, **kwargs)


def token_kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(p_teacher || p_student) from next-token log-probabilities [..., V]: summed over the vocabulary,
    averaged over the predicted tokens (differentiable in `student`)."""
    return torch.nn.functional.kl_div(student.flatten(0, -2), teacher.flatten(0, -2), log_target=True,
                                      reduction="batchmean")


class CodecObjective(nn.Module):
    def __init__(self, model: nn.Module, codec: ResidualCodec, config: TrainConfig):
        super().__init__()
        self.model, self.codec = model, codec
        self.loss_kind, self.rec_reduction, self.rec_weight = config.loss, config.rec_reduction, config.rec_weight
        self.served = config.reading == "served"
        # "reconstructed": one forward attends over reconstructions only; "served": the prompt reads itself
        # exact, the rest reads the prompt's reconstruction (and its own exact kv, as a prefill chunk would)
        self.cache_config = served_reading(codec) if self.served else trained_reading(codec)

    def forward(self, input_ids: torch.Tensor, split: int | None = None) -> dict[str, torch.Tensor]:
        """`split`: reading 'served''s prompt length (served_split); None splits the block in half."""
        p = (input_ids.shape[1] // 2 if split is None else split) if self.served else 0
        teacher = None
        if self.loss_kind == "rec+kd":
            with torch.no_grad():  # the full cache's distribution: the target, not something to train
                # logits of the scored positions only (logits_to_keep counts from the end)
                teacher = self.model(input_ids=input_ids, logits_to_keep=input_ids.shape[1] - p).logits[:, :-1]
                teacher = teacher.float().log_softmax(-1)
        cache = ResidualKVCache.from_model(self.model, self.codec, self.cache_config)
        terms = cache.collect_rec_loss()
        wants_ntp = self.loss_kind != "rec"
        # logits_to_keep=1 under --loss rec: the KV is all it needs, so skip most of the LM head
        kw = {"labels": input_ids[:, p:] if wants_ntp else None, "logits_to_keep": 0 if wants_ntp else 1}
        if self.served:
            # the prompt's attention reads exact kv, so the backbone keeps no graph there; only the codec's
            # writes do, and the rest's loss reaches them through the history it reads
            cache.keep_grad_history()
            out = served_forward(self.model, cache, input_ids, p, **kw)
        else:
            out = self.model(input_ids=input_ids, cache=cache, use_cache=True, **kw)
        rec = self._reduce(torch.stack(terms).sum(), input_ids) if terms else input_ids.new_zeros((), dtype=torch.float32)
        ntp = out.loss.float() if wants_ntp else rec.new_zeros(())
        result = {"rec": rec.detach(), "ntp": ntp.detach()}
        if teacher is not None:
            kd = token_kl(teacher, out.logits[:, :-1].float().log_softmax(-1))
            result["kd"] = kd.detach()
            return {"loss": self.rec_weight * rec + kd, **result}
        loss = {"rec+ntp": self.rec_weight * rec + ntp, "rec": rec, "ntp": ntp}[self.loss_kind]
        return {"loss": loss, **result}

    def _reduce(self, total: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        if self.rec_reduction == "sum":  # the seed's sum over layers and tokens, per sequence
            return total / B
        if self.rec_reduction == "layer-mean":  # the authors' code: each layer's MSE, summed over the layers
            return total / (B * T * self.codec.dims.d_kv)
        # every coordinate's MSE: 1/(coded layers) of layer-mean's weight
        return total / (B * T * len(self.codec.layer_ids) * self.codec.dims.d_kv)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16), where bf16 autocast pays
    (BENCHMARKS.md, "bf16 autocast": 6.9x the fp32 matmul rate with AMX). torch exposes the checks
    privately; a torch without them answers False."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(bool(check()) for check in checks if check is not None)


def resolve_bf16(bf16: bool | str) -> bool:
    """`bf16: auto` is bf16 autocast where it pays: a CUDA GPU with bf16 units, or a CPU with AMX or
    AVX512-BF16 (three 2048-token runs of the recipe tie three fp32 ones at 55% of the time there; BENCHMARKS.md).
    Elsewhere torch emulates bf16 on the CPU about 100x slower than fp32, so auto trains in fp32."""
    if bf16 != "auto":
        return bool(bf16)
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def freeze_backbone(model: nn.Module) -> None:
    """No parameter of the backbone trains, and eval mode turns off dropout (gradients still flow through it)."""
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()


def enable_mlp_checkpointing(model: nn.Module) -> int:
    """Recompute each decoder layer's MLP in the backward pass instead of keeping its activations.

    transformers' own `gradient_checkpointing_enable` cannot be used here: it checkpoints whole decoder
    layers and therefore drops the cache (`cache=None`), so the forward would silently attend over the
    true KV and the codec would get no gradient; replaying attention would also write the cache twice.
    The MLP is stateless and holds most of a layer's activations, so it is the part worth recomputing.
    Returns the number of wrapped MLPs.
    """
    from torch.utils.checkpoint import checkpoint

    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None or not all(hasattr(layer, "mlp") for layer in layers):
        raise TrainError(f"grad_checkpointing: {type(model).__name__} has no `model.layers[i].mlp`; "
                         "run without --grad-checkpointing")
    for layer in layers:
        mlp = layer.mlp
        if getattr(mlp, "_rkv_checkpointed", False):
            continue
        plain = mlp.forward
        # use_reentrant=False: works although the frozen inputs' parameters need no grad
        mlp.forward = lambda x, _f=plain: checkpoint(_f, x, use_reentrant=False) if torch.is_grad_enabled() else _f(x)
        mlp._rkv_checkpointed = True
    return len(layers)


def zero_decoders(codec: ResidualCodec) -> None:
    """W_d = 0: the untrained codec reconstructs kv_hat = mean_ref (the references' mean), a sane start
    instead of random noise; the first step gives W_d a gradient and then the encoder follows."""
    for layer in codec.layers.values():
        if hasattr(layer, "w_d"):
            nn.init.zeros_(layer.w_d.weight)


# ---------------------------------------------------------------------------------------------
# Data order: a seeded permutation per epoch, entered at any offset, so a resumed run reads exactly
# the batches the interrupted one would have read.


class EpochSampler(Sampler[int]):
    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.epoch, self.offset = 0, 0

    def set_position(self, epoch: int, offset: int) -> None:
        self.epoch, self.offset = epoch, offset

    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self):
        return iter(self.order(self.epoch)[self.offset :])

    def __len__(self) -> int:
        return max(self.n - self.offset, 0)


# ---------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Everything besides tensors that a checkpoint must restore."""

    step: int = 0  # optimizer steps done
    total_steps: int = 0  # LR schedule length
    epoch: int = 0
    micro_in_epoch: int = 0  # global micro-batches consumed in this epoch (the data position)
    tokens: int = 0
    train_seconds: float = 0.0  # summed over all invocations
    history: list[list[float]] = field(default_factory=list)  # [step, loss, rec, ntp] per logged window
    # [step, new total] per re-plan of a --minutes run whose steps ran slower than calibrated (see replanned)
    replans: list[list[int]] = field(default_factory=list)
    planned_steps: int = 0  # the length first planned (0: total_steps, in checkpoints written before re-plans)


@dataclass
class TrainResult:
    codec_path: Path
    steps: int
    total_steps: int
    tokens: int
    seconds: float
    resumed_from: int | None
    stopped_early: bool
    metrics: dict[str, float]


def replanned(planned_steps: int, warmup_frac: float, replans: list[list[int]]) -> Callable[[int], float]:
    """The LR factor of a schedule planned for `planned_steps` (linear_warmup_decay) and re-planned at each
    [step s, total T] of `replans`: from s on it decays linearly from the factor then in force to 0 at T,
    so the rate never jumps and still reaches 0 where the run now ends. Reads `replans` at every call: a
    re-plan appended later applies from its step on."""
    base = linear_warmup_decay(planned_steps, warmup_frac)

    def factor(step: int) -> float:
        value = base(step)
        current = base
        for s, total in replans:
            if step < s:
                break
            start = current(s)
            current = lambda t, s=s, total=total, start=start: start * max(0, total - t) / max(1, total - s)  # noqa: E731
            value = current(step)
        return value

    return factor


def linear_warmup_decay(total_steps: int, warmup_frac: float) -> Callable[[int], float]:
    warmup = max(1, round(warmup_frac * total_steps)) if warmup_frac > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor


class CodecTrainer:
    """Train `codec` on `train_data` (a datasets.Dataset of `input_ids` blocks) with `model` frozen.

    `on_metrics(step, metrics)` is called every `log_every` optimizer steps and once at the end.
    `data_info` is recorded in the codec's metadata (source, fingerprint, seq_len).
    """

    def __init__(self, model: nn.Module, codec: ResidualCodec, train_data, out_dir: str | Path,
                 config: TrainConfig, *, heldout_data=None, data_info: dict[str, Any] | None = None,
                 on_metrics: Callable[[int, dict[str, float]], None] | None = None, progress: bool = True):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import GradientAccumulationPlugin

        self.config, self.out_dir = config, Path(out_dir)
        self.heldout_data, self.data_info = heldout_data, dict(data_info or {})
        self.on_metrics, self.progress = on_metrics, progress
        self.start_time = time.monotonic()
        self._check_data(train_data)
        # accelerate keeps process-wide singletons; a trainer owns precision and accumulation for its run,
        # so forget those of an earlier run in this process (the process group, PartialState, stays).
        AcceleratorState._reset_state()
        GradientState._reset_state()
        # sync_with_dataloader=False: accumulation windows run on across epoch ends, so the data
        # position alone says where a resumed run stands.
        # cpu=True without a GPU: under torchrun/`accelerate launch` on CPUs, accelerate then runs DDP over gloo
        # (without it every process would train alone, racing on one folder)
        self.accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            mixed_precision="bf16" if config.bf16 else "no",
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=config.grad_accum,
                                                                    sync_with_dataloader=False))
        torch.manual_seed(config.seed)
        if config.bf16 and self.accelerator.device.type == "cpu" and not cpu_has_native_bf16():
            self._say("warning: --bf16 on a CPU without AMX or AVX512-BF16 emulates bf16 matmuls and runs slower "
                      "than fp32 (about 100x on an AMD EPYC Milan, BENCHMARKS.md); drop --bf16 here")
        freeze_backbone(model)
        codec.kv_digest = kv_digest(model)  # learnt on this model's weights from here on (a start too)
        self.identity = codec_identity(codec)
        if config.grad_checkpointing:
            enable_mlp_checkpointing(model)
        if config.init == "zero-decoder":
            zero_decoders(codec)
        self.state = TrainState()
        self.resumed_from = self._latest_checkpoint()
        if self.resumed_from is not None:
            # before any weight is loaded: a checkpoint of another backbone or codec shape must not continue
            # here (its weights would load into a same-shape codec stamped with this model's digest)
            self._check_identity(self.resumed_from)
            self._load_codec_weights(codec, self.resumed_from)
        elif config.init in ("rec-warmstart", "fisher-pca"):  # a resumed run already carries its warm start
            from .warmstart import fisher_pca_init, warm_start

            n = min(config.warmstart_blocks, len(train_data))
            blocks = torch.tensor(train_data.select(range(n))["input_ids"])
            common = dict(steps=config.warmstart_steps, seed=config.seed, on_metrics=on_metrics, progress=progress)
            if config.init == "rec-warmstart":
                self.warmstart = warm_start(model, codec, blocks, lr=config.lr, **common)
            else:
                self.warmstart = fisher_pca_init(model, codec, blocks, alpha=config.fisher_alpha,
                                                 value_weight=config.value_weight, **common)
        self.codec, self.train_data = codec, train_data
        self.sampler = EpochSampler(len(train_data), config.seed)
        loader = DataLoader(train_data.with_format("torch", columns=["input_ids"]), batch_size=config.batch_size,
                            sampler=self.sampler, drop_last=True)
        optimizer = torch.optim.AdamW([p for p in codec.parameters() if p.requires_grad], lr=config.lr,
                                      weight_decay=config.weight_decay)
        self.objective, self.optimizer, self.loader = self.accelerator.prepare(
            CodecObjective(model, codec, config), optimizer, loader)
        self.scheduler = None  # built by plan() once the schedule length is known
        self.replanning = False  # this invocation's --minutes bounds a fresh schedule (see plan, _replan)

    # ---- planning ---------------------------------------------------------------------------

    def _check_data(self, train_data) -> None:
        if "input_ids" not in train_data.column_names or len(train_data) == 0:
            raise TrainError("train_data must be a non-empty datasets.Dataset with an `input_ids` column "
                             "(see residualkv.training.packing.pack_documents)")
        n = len(train_data[0]["input_ids"])
        if n != self.config.seq_len:
            raise TrainError(f"seq_len={self.config.seq_len} but the packed blocks hold {n} tokens; "
                             "pack the data with the same seq_len")
        if len(train_data) < self.config.batch_size:
            raise TrainError(f"batch_size={self.config.batch_size} exceeds the {len(train_data)} training blocks; "
                             "use a smaller --batch-size or more data")

    def plan(self) -> None:
        """Fix the LR schedule length: --steps when given; otherwise the steps that fit in --minutes at the
        step time measured on two calibration steps (which do not update the codec). A resumed run keeps
        the length it was planned with."""
        cfg = self.config
        if self.resumed_from is not None:
            self._load_state(self.resumed_from)
            if cfg.steps is not None and cfg.steps != self.state.total_steps:
                raise TrainError(f"steps={cfg.steps} but the run in {self.out_dir} was planned with "
                                 f"{self.state.total_steps}; pass --steps {self.state.total_steps} to resume it, "
                                 "or use a new --out")
            if cfg.minutes is not None:  # the plan made under the first budget stands; this one bounds this call
                self._say(f"the run keeps the {self.state.total_steps} steps it was planned with; --minutes "
                          f"{cfg.minutes:g} bounds this invocation only")
        elif cfg.steps is not None:
            self.state.total_steps = cfg.steps
            # --steps with --minutes: the steps are the plan and the budget a cap. Stopped by the cap part-way
            # down the schedule, the codec would ship with its learning rate undecayed; re-planning (shrinks
            # only) ends the schedule where the cap does instead, and leaves a machine fast enough untouched.
        else:
            step_s = self._calibrate()
            self.state.total_steps = self._agreed(self._steps_that_fit(step_s))
            self._say(f"measured {step_s:.1f}s per optimizer step: planning {self.state.total_steps} steps "
                      f"for the {cfg.minutes:g}-minute budget")
        # a fresh plan under a budget is re-planned as the measured pace drifts; a resumed one keeps its plan
        self.replanning = self.resumed_from is None and cfg.minutes is not None
        st = self.state
        st.planned_steps = st.planned_steps or st.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer.optimizer, replanned(st.planned_steps, cfg.warmup_frac, st.replans))
        if self.resumed_from is not None:  # after the scheduler exists, so the restored LR is the one in force
            self._load_tensors(self.resumed_from)

    def _calibrate(self) -> float:
        rows = self.train_data.with_format("torch", columns=["input_ids"])[: self.config.batch_size]
        batch = rows["input_ids"].to(self.accelerator.device)
        times = []
        for _ in range(2):  # the first pass pays for allocation and warm-up; time the second
            t0 = time.perf_counter()
            self.accelerator.backward(self.objective(batch)["loss"])
            times.append(time.perf_counter() - t0)
        self.optimizer.zero_grad(set_to_none=True)
        return times[-1] * self.config.grad_accum

    def _reserve_seconds(self, step_s: float) -> float:
        """Time kept back from the budget for the final held-out evaluation and the final saves.

        Scoring a block (two no-grad forwards) costs about one micro-step; writing the checkpoint and the
        codec costs well under two steps (the weights are small next to a step's activations)."""
        n_eval = min(self.config.eval_blocks, len(self.heldout_data) if self.heldout_data is not None else 0)
        return (n_eval / self.config.grad_accum + 2) * step_s + 1.0

    def _steps_that_fit(self, step_s: float) -> int:
        """Steps of `step_s` seconds left in the --minutes budget (at least one), 3% kept as a margin."""
        left = self.config.minutes * 60 - self.elapsed() - self._reserve_seconds(step_s)
        return max(1, int(0.97 * left / step_s))

    def elapsed(self) -> float:
        return time.monotonic() - self.start_time

    REPLAN_EVERY = 5  # steps between re-plans, and the steps whose mean time predicts the rest

    def _replan(self, recent: list[float]) -> int | None:
        """A --minutes run, planned from two calibration steps or given --steps: when the steps run slower
        (a shared machine, allocator growth, a slower CPU), the budget would stop the run before its learning
        rate has decayed. Every few steps, if the remaining steps no longer fit at the recent pace, the run
        is re-planned to end when the budget does: the new total, or None. Shrinks only; the budget check
        still stops the run."""
        st = self.state
        if not self.replanning or len(recent) < self.REPLAN_EVERY or st.step >= st.total_steps:
            return None
        if st.replans and st.step - st.replans[-1][0] < self.REPLAN_EVERY:
            return None
        fits = st.step + self._steps_that_fit(sum(recent[-self.REPLAN_EVERY:]) / self.REPLAN_EVERY)
        new = fits if fits < st.total_steps - max(1, st.total_steps // 50) else None  # 2% slack: no churn
        return self._agreed(new)

    def _out_of_time(self, step_s: float) -> bool:
        if self.config.minutes is None:
            return False
        return self._agreed(self.elapsed() + step_s + self._reserve_seconds(step_s) > self.config.minutes * 60)

    def _agreed(self, value):
        """The main process's `value` on every process. Decisions taken from a wall clock (the planned length,
        when to stop) differ between processes; taken apart, one process would stop while the others wait
        for it in the next gradient all-reduce, for ever."""
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    # ---- the loop -----------------------------------------------------------------------------

    def train(self) -> TrainResult:
        self.plan()
        cfg, st = self.config, self.state
        if self.resumed_from is not None:
            self._say(f"resuming from {self.resumed_from} (step {st.step} of {st.total_steps})")
        bar = self._bar()
        window: list[dict[str, float]] = []
        stopped_early, step_s, recent, first_step = False, 0.0, [], True
        t_step = time.perf_counter()
        micro: list[dict[str, float]] = []
        while st.step < st.total_steps and not stopped_early:
            self.sampler.set_position(st.epoch, st.micro_in_epoch * cfg.batch_size * self.accelerator.num_processes)
            for batch in self.loader:
                micro.append(self._micro_step(batch["input_ids"]))
                st.micro_in_epoch += 1
                st.tokens += batch["input_ids"].numel() * self.accelerator.num_processes
                if not self.accelerator.sync_gradients:
                    continue
                self._optimizer_step(micro)
                window.append(_mean(micro))
                micro = []
                step_s = time.perf_counter() - t_step
                t_step = time.perf_counter()
                st.train_seconds += step_s
                st.step += 1
                bar.update(1)
                bar.set_postfix({k: f"{window[-1][k]:.4g}" for k in ("loss", "rec", "ntp", "kd") if k in window[-1]})
                if first_step:  # the invocation's first step pays for warm-up: not a pace to plan on
                    first_step = False
                else:
                    recent.append(step_s)
                new_total = self._replan(recent)
                if new_total is not None:
                    self._say(f"steps take {sum(recent[-self.REPLAN_EVERY:]) / self.REPLAN_EVERY:.3g}s, not the "
                              f"planned pace: re-planning {st.total_steps} -> {new_total} steps so the learning "
                              f"rate still decays to 0 inside the {cfg.minutes:g}-minute budget")
                    st.replans.append([st.step, new_total])
                    st.total_steps = new_total
                    bar.total = new_total
                    bar.refresh()
                if st.step % cfg.log_every == 0 or st.step == st.total_steps:
                    self._log(window, step_s)
                    window = []
                if st.step % cfg.ckpt_every == 0 and st.step < st.total_steps:
                    self.save_checkpoint()
                if st.step >= st.total_steps:
                    break
                if self._out_of_time(step_s):
                    stopped_early = True
                    self._say(f"time budget of {cfg.minutes:g} min reached at step {st.step} of {st.total_steps}: "
                              "stopping and saving the codec")
                    break
            else:  # the epoch ran out
                st.epoch, st.micro_in_epoch = st.epoch + 1, 0
        bar.close()
        if window:
            self._log(window, step_s)
        self.save_checkpoint()
        metrics = self.evaluate()
        if metrics and self.on_metrics is not None and self.accelerator.is_main_process:
            self.on_metrics(st.step, metrics)
        path = self.save_codec(stopped_early, metrics)
        return TrainResult(codec_path=path, steps=st.step, total_steps=st.total_steps, tokens=st.tokens,
                           seconds=st.train_seconds, resumed_from=self._step_of(self.resumed_from),
                           stopped_early=stopped_early, metrics=metrics)

    def _micro_step(self, input_ids: torch.Tensor) -> dict[str, float]:
        cfg = self.config
        # Draws seeded by the data position, not torch's global RNG (which starting a DataLoader iterator
        # also draws from, once more in a resumed run): a resumed run writes the same copies into the same
        # blocks and splits them where the uninterrupted run did.
        g = torch.Generator().manual_seed(
            hash((cfg.seed, self.state.epoch, self.state.micro_in_epoch, self.accelerator.process_index)) % 2**62)
        if cfg.recall_spans:
            ids, _ = insert_recalls(input_ids.cpu(), cfg.recall_spans, cfg.recall_span_len, g)
            input_ids = ids.to(input_ids.device)
        split = served_split(input_ids.shape[1], g) if cfg.reading == "served" else None
        with self.accelerator.accumulate(self.objective):
            out = self.objective(input_ids, split)
            self.accelerator.backward(out["loss"])
        return {k: float(v.detach()) for k, v in out.items()}

    def _optimizer_step(self, micro: list[dict[str, float]]) -> None:
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else float("inf")
        norm = self.accelerator.clip_grad_norm_(self.codec.parameters(), max_norm)
        micro[-1]["grad_norm"] = float(norm)
        micro[-1]["lr"] = self.scheduler.get_last_lr()[0]  # the rate this step used, before the schedule moves on
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _log(self, window: list[dict[str, float]], step_s: float) -> None:
        st = self.state
        m = _mean(window)
        st.history.append([st.step, m["loss"], m["rec"], m["ntp"]])
        tokens_per_step = self.config.seq_len * self.config.batch_size * self.config.grad_accum * self.accelerator.num_processes
        metrics = m | {"lr": window[-1]["lr"], "tokens": st.tokens, "step_seconds": step_s,
                       "tokens_per_second": tokens_per_step / step_s if step_s else 0.0, "epoch": st.epoch}
        if self.on_metrics is not None and self.accelerator.is_main_process:
            self.on_metrics(st.step, metrics)

    def _bar(self):
        from tqdm.auto import tqdm

        return tqdm(total=self.state.total_steps, initial=self.state.step, desc="training codec", unit="step",
                    disable=not (self.progress and self.accelerator.is_local_main_process), dynamic_ncols=True)

    # ---- evaluation -----------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the trained codec (heldout_metrics)."""
        n = min(self.config.eval_blocks, len(self.heldout_data) if self.heldout_data is not None else 0)
        if n == 0:
            return {}
        objective = self.accelerator.unwrap_model(self.objective)
        blocks = torch.tensor(self.heldout_data.select(range(n))["input_ids"])
        with self.accelerator.autocast():
            return heldout_metrics(objective.model, objective.codec, blocks.to(self.accelerator.device))

    # ---- checkpoints ------------------------------------------------------------------------------

    def _checkpoints(self) -> list[Path]:
        root = self.out_dir / CHECKPOINTS
        found = [p for p in root.glob("step-*") if p.is_dir() and (p / STATE).is_file()] if root.is_dir() else []
        return sorted(found, key=self._step_of)

    @staticmethod
    def _step_of(path: Path | None) -> int | None:
        return None if path is None else int(path.name.split("-", 1)[1])

    def _latest_checkpoint(self) -> Path | None:
        found = self._checkpoints()
        return found[-1] if found else None

    def save_checkpoint(self) -> None:
        """Write checkpoints/step-N atomically (a temporary folder renamed into place); keep the newest few."""
        self.accelerator.wait_for_everyone()
        if not self.accelerator.is_main_process:
            return
        root = self.out_dir / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.state.step}"
        if final.exists():  # e.g. the end of a run that resumed exactly here
            return
        codec = self.accelerator.unwrap_model(self.objective).codec
        state = dataclasses.asdict(self.state) | {"config": self.config.to_dict(), "data": self.data_info,
                                                 "num_processes": self.accelerator.num_processes,
                                                 "codec": self.identity}

        def write(tmp: Path) -> None:
            save_file({k: v.detach().contiguous().cpu() for k, v in codec.state_dict().items()},
                      str(tmp / "codec.safetensors"))
            torch.save(self.optimizer.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(_rng_states(), tmp / "rng.pt")
            (tmp / STATE).write_text(json.dumps(state, indent=1))  # last: its presence marks a whole checkpoint

        write_dir_atomically(final, write)
        for old in self._checkpoints()[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".step-*"):  # temporary folders of a run killed mid-write
            shutil.rmtree(stale, ignore_errors=True)

    def _check_identity(self, ckpt: Path) -> None:
        saved = json.loads((ckpt / STATE).read_text()).get("codec")
        if saved is None:  # written before checkpoints recorded it
            return
        for key, ours in self.identity.items():
            theirs = saved.get(key)
            if key == "cache_config":
                # a setting added after the checkpoint was written had its default then
                theirs = json.loads(json.dumps(ResidualKVConfig().to_dict() | (theirs or {})))
                diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
                what = f"the codec's cache settings ({', '.join(diff)}: {', '.join(f'{k}={theirs.get(k)!r}' for k in diff)} " \
                       f"there, {', '.join(f'{k}={ours.get(k)!r}' for k in diff)} here)" if diff else ""
            elif key == "kv_digest":
                what = "the backbone's weights (another checkpoint: its K/V projections differ)" if ours != theirs else ""
            else:
                what = f"the codec's {key} ({theirs!r} there, {ours!r} here)" if ours != theirs else ""
            if what:
                raise TrainError(f"the run in {self.out_dir} was trained with other {what}; resume it with the same "
                                 "--backbone and codec options, or use a new --out (or --restart) to start over")

    def _load_codec_weights(self, codec: ResidualCodec, ckpt: Path) -> None:
        codec.load_state_dict(load_file(str(ckpt / "codec.safetensors")))

    def _load_state(self, ckpt: Path) -> None:
        saved = json.loads((ckpt / STATE).read_text())
        for name in RESUME_FIELDS:
            # a field an older checkpoint lacks had its default then
            ours, theirs = getattr(self.config, name), saved["config"].get(name, _DEFAULTS.get(name))
            if ours != theirs:
                raise TrainError(f"{name}={ours!r} but the run in {self.out_dir} used {theirs!r}; pass the same value "
                                 "to resume it, or use a new --out (or --restart) to start over")
        for key in ("fingerprint", "source"):
            if key in self.data_info and self.data_info[key] != saved["data"].get(key):
                raise TrainError(f"data {key} {self.data_info[key]!r} differs from {saved['data'].get(key)!r} used by "
                                 f"the run in {self.out_dir}; pass the same --data/--seq-len or use a new --out")
        if saved["num_processes"] != self.accelerator.num_processes:
            raise TrainError(f"the run in {self.out_dir} used {saved['num_processes']} processes, this one "
                             f"{self.accelerator.num_processes}; resume with the same `accelerate launch` setup")
        fields = {f.name for f in dataclasses.fields(TrainState)}
        self.state = TrainState(**{k: v for k, v in saved.items() if k in fields})

    def _load_tensors(self, ckpt: Path) -> None:
        self.optimizer.optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        self.scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
        _set_rng_states(torch.load(ckpt / "rng.pt", weights_only=False))

    # ---- the result -------------------------------------------------------------------------------

    def save_codec(self, stopped_early: bool, metrics: dict[str, float]) -> Path:
        path = self.out_dir / CODEC
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            objective = self.accelerator.unwrap_model(self.objective)
            codec = objective.codec
            codec.extra = dict(codec.extra) | {"training": self.summary(stopped_early, metrics)}
            codec.config = codec.config.replace(new_kv=objective.cache_config.new_kv)  # served the way it was trained
            codec.save(path)
        return path

    def summary(self, stopped_early: bool, metrics: dict[str, float]) -> dict[str, Any]:
        st, cfg = self.state, self.config
        hist = st.history

        def avg(rows):
            return {k: sum(r[i] for r in rows) / len(rows) for i, k in ((1, "loss"), (2, "rec"), (3, "ntp"))} if rows else {}

        stride = max(1, math.ceil(len(hist) / 100))
        return {
            "steps": st.step, "total_steps": st.total_steps, "stopped_early": stopped_early, "tokens": st.tokens,
            "planned_steps": st.planned_steps, "replans": st.replans,
            "train_seconds": round(st.train_seconds, 1), "loss": cfg.loss, "reading": cfg.reading, "rec_reduction": cfg.rec_reduction,
            "rec_weight": cfg.rec_weight, "seq_len": cfg.seq_len, "batch_size": cfg.batch_size,
            "grad_accum": cfg.grad_accum, "lr": cfg.lr, "seed": cfg.seed, "bits": self.codec.config.bits,
            "init": cfg.init, "init_from": cfg.init_from,
            **({"fisher_alpha": cfg.fisher_alpha, "value_weight": cfg.value_weight} if cfg.init == "fisher-pca" else {}),
            "recall_spans": cfg.recall_spans,
            "recall_span_len": cfg.recall_span_len, "bf16": cfg.bf16, "data": self.data_info,
            "loss_first": avg(hist[:3]), "loss_last": avg(hist[-3:]),
            "loss_history": [[round(v, 6) for v in row] for row in hist[::stride]],
            "eval": metrics,
        }

    def _say(self, message: str) -> None:
        if self.accelerator.is_main_process:
            print(f"[rkv train] {message}", file=sys.stderr, flush=True)  # stdout holds only the result


def served_start(codec: ResidualCodec | None, seq_len: int) -> int:
    """Where held-out scoring starts for `codec`: 0 for the seed's reading (teacher-forced, every token
    reconstructed); half the block for a codec served with `new_kv: exact` (reading "served"): the first
    half prefilled exact and stored compressed, the second half scored through it, as trained."""
    return seq_len // 2 if codec is not None and codec.config.new_kv == "exact" else 0


def _logprobs(model: nn.Module, ids: torch.Tensor, codec: ResidualCodec | None, start: int = 0) -> torch.Tensor:
    """(T-1-start, V) log-probabilities of tokens start+1..T-1 of one sequence: through the full cache when
    `codec` is None, else through `codec`'s cache read as it was trained (start 0: teacher-forced, every
    token reconstructed; start > 0: tokens [0, start) prefilled exact, the rest read that compressed history)."""
    if codec is None:
        logits = model(input_ids=ids[None], logits_to_keep=ids.shape[0] - start).logits[0, :-1]
    elif start == 0:
        logits = model(input_ids=ids[None], cache=ResidualKVCache.from_model(model, codec, trained_reading(codec)),
                       use_cache=True).logits[0, :-1]
    else:
        cache = ResidualKVCache.from_model(model, codec, served_reading(codec))
        logits = served_forward(model, cache, ids[None], start).logits[0, :-1]
    return logits.float().log_softmax(-1)


def _nll(ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:  # per predicted token, (T-1,)
    return -logprobs.gather(-1, ids[1:, None])[:, 0]


def _has_probe(blocks: torch.Tensor) -> bool:
    return blocks.shape[1] // 2 >= EVAL_RECALL_SPANS * EVAL_RECALL_SPAN_LEN


@torch.no_grad()
def heldout_losses(model: nn.Module, blocks: torch.Tensor, codec: ResidualCodec | None = None) -> dict[str, float]:
    """The recall probe of held-out `blocks` (N, T): each block with EVAL_RECALL_SPANS copies of its own
    earlier text, mean next-token loss on the tokens that need the copy's source (`recall_nll`), through
    `codec`'s compressed cache or through the full cache when `codec` is None; empty when the blocks are
    too short for the probe. The copies depend only on the blocks, so the full cache's part can be
    computed once and handed to `heldout_metrics(full=...)` for any number of codecs."""
    if not _has_probe(blocks):
        return {"blocks": blocks.shape[0]}
    g = torch.Generator().manual_seed(0)
    total = 0.0
    # the copies sit in the second half: scoring from served_start still scores every copied token
    start = served_start(codec, blocks.shape[1])
    for ids in blocks:
        copied, mask = insert_recalls(ids[None].cpu(), EVAL_RECALL_SPANS, EVAL_RECALL_SPAN_LEN, g)
        copied = copied[0].to(ids.device)
        lp = _logprobs(model, copied, codec, start)
        total += float(_nll(copied[start:], lp)[mask[0, start + 1:].to(ids.device)].mean())
    return {"recall_nll": total / blocks.shape[0], "blocks": blocks.shape[0]}


@torch.no_grad()
def heldout_metrics(model: nn.Module, codec: ResidualCodec, blocks: torch.Tensor,
                    full: dict[str, float] | None = None) -> dict[str, float]:
    """The codec against the full cache on held-out `blocks` (N, T), read as the codec was trained
    (`served_start`: teacher-forced with every token reconstructed, or, for a codec served with the
    prompt read exact, the second half of each block scored through the first half's compressed
    history; both caches are scored on the same tokens, from `eval/scored_from`): next-token loss of the
    text through both caches (whether the codec keeps language modelling), the mean per-token KL from the
    full cache's next-token distribution to the codec's (whether the model keeps saying what it said: a
    codec can lower the loss on text like its training corpus by changing the model; the KL counts that),
    and the recall probe (`heldout_losses`:
    whether it keeps the exact look-ups retrieval tasks make). `full`: the full cache's
    `heldout_losses(model, blocks)` when the caller already has it (the text needs both caches' full
    distributions, so only the probe's full-cache half can be reused)."""
    full = full if full is not None else heldout_losses(model, blocks)
    n = blocks.shape[0]
    if full.get("blocks") != n:
        raise ValueError(f"full: losses of {full.get('blocks')} blocks given for {n} blocks")
    sums = {"full": 0.0, "codec": 0.0, "kl": 0.0}
    start = served_start(codec, blocks.shape[1])
    for ids in blocks:
        teacher, student = _logprobs(model, ids, None, start), _logprobs(model, ids, codec, start)
        sums["full"] += float(_nll(ids[start:], teacher).mean())
        sums["codec"] += float(_nll(ids[start:], student).mean())
        sums["kl"] += float(token_kl(teacher, student))
        del teacher, student  # vocabulary-sized: free them before the next block's
    m = {k: v / n for k, v in sums.items()}
    out = {"eval/ntp_full": m["full"], "eval/ntp_codec": m["codec"], "eval/ppl_ratio": math.exp(m["codec"] - m["full"]),
           "eval/kl": m["kl"], "eval/blocks": n, "eval/scored_from": start}
    mine = heldout_losses(model, blocks, codec)
    if "recall_nll" in mine:
        out |= {"eval/recall_nll_full": full["recall_nll"], "eval/recall_nll_codec": mine["recall_nll"],
                "eval/recall_ppl_ratio": math.exp(mine["recall_nll"] - full["recall_nll"])}
    return out


def codec_identity(codec: ResidualCodec) -> dict[str, Any]:
    """What a checkpoint's weights belong to (the backbone's weights and the codec's shape and cache
    settings), as JSON would read it back, so a resume compares like with like."""
    meta = codec.meta()
    keys = ("kv_digest", "fingerprint_hash", "dims", "layer_ids", "layer_d_c", "cache_config")
    return json.loads(json.dumps({k: meta[k] for k in keys}))


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = set().union(*rows)
    return {k: sum(r[k] for r in rows if k in r) / sum(1 for r in rows if k in r) for k in keys}


def _rng_states() -> dict[str, Any]:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def train_codec(model: nn.Module, codec: ResidualCodec, train_data, out_dir: str | Path, config: TrainConfig,
                **kwargs) -> TrainResult:
    """Train (or resume training) and save the codec to `out_dir/codec`. See CodecTrainer."""
    return CodecTrainer(model, codec, train_data, out_dir, config, **kwargs).train()


__all__ = ["TrainConfig", "TrainError", "TrainResult", "CodecTrainer", "CodecObjective", "train_codec",
           "heldout_losses", "heldout_metrics", "token_kl", "trained_reading", "served_reading", "served_split",
           "served_forward", "served_start", "READINGS", "freeze_backbone", "enable_mlp_checkpointing",
           "zero_decoders", "linear_warmup_decay", "replanned", "LOSSES"]
