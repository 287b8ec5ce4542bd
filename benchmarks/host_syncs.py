"""Count, on the CPU, the operations of a decode step that would stall a GPU (issue #6).

On a GPU, an operation whose result the host must know before it can go on (a tensor turned into a
Python bool or int, `nonzero`, indexing with a boolean mask, `unique`, `tolist`, `torch.equal`) waits
for every kernel queued before it: the host stops queueing work, and the GPU then idles while Python
catches up. A decode step of a small model is mostly such gaps. The CPU cannot time them, but it can
count them: the same aten operations run here, so `HostSyncCounter` (a TorchDispatchMode) counts each
one with the line of residualkv/ or kernels/ that asked for it. Not counted: host-to-device copies
(`.to(device)` of a CPU tensor is a no-op here), which stall less (pageable copies return once staged).

    python benchmarks/host_syncs.py [--backbone smollm2-135m] [--context 300] [--steps 8]
                                    [--methods standalone,omnikv,...] [--kernels] [--json OUT]

prints, per method, the host syncs per decode step of a tiny random Llama (4 layers, 2 of them full
attention), or of a real backbone, on the library's torch path, and the lines they come from. tests/test_sparse.py keeps the
counts from growing back.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_ALWAYS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default",
           "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
           "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor"}


def _bool_index(args) -> bool:
    """aten.index / index_put_ with a boolean mask among the indices: the kernel counts the mask's Trues
    (a nonzero) before it can size its output."""
    indices = args[1] if len(args) > 1 else ()
    return any(t is not None and t.dtype == torch.bool for t in indices)


class HostSyncCounter(TorchDispatchMode):
    """Counts operations that force a host-device sync on a GPU, by (operation, line of the library)."""

    def __init__(self):
        super().__init__()
        self.where: collections.Counter = collections.Counter()
        self._tolist = None

    @property
    def total(self) -> int:
        return sum(self.where.values())

    def _record(self, what: str) -> None:
        here = "?"
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = Path(frame.filename)
            if path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in ("residualkv", "kernels"):
                here = f"{path.relative_to(ROOT)}:{frame.lineno}"
                break
        self.where[(what, here)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in _ALWAYS or (name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default")
                               and _bool_index(args)):
            self._record(name.split(".")[1] + ("(bool mask)" if "index" in name else ""))
        return func(*args, **(kwargs or {}))

    # Tensor.tolist copies to the host without an aten call: patched while counting
    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter, original = self, self._tolist

        def tolist(t, *a, **k):
            counter._record("tolist")
            return original(t, *a, **k)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def tiny_setup(seed: int = 0, kernels: bool = False):
    """A tiny random Llama (4 layers; 0 and 2 full attention, so OmniKV has filter layers) and a random
    codec for it, on the torch path (`kernels`: the Triton path, in quantisation groups of 16, the smallest
    the fused kernel takes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from residualkv.codec import ResidualCodec
    from residualkv.config import ResidualKVConfig

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=2048)).eval()
    cfg = ResidualKVConfig(full_attention_layers=(0, 2), stride=4, n_sink=2, k=2, group_size=8, kernel_impl="torch",
                           full_group_size=16, full_window=16, select_budget=16, n_recent=4, snapkv_window=8)
    codec = ResidualCodec.for_model(model.config, cfg, d_c=16, d_ff=32, seed=seed)
    return model, codec, cfg.replace(kernel_impl="triton", group_size=16) if kernels else cfg


METHODS = {  # name -> ResidualKVConfig changes (None: OmniKV on the uncompressed cache)
    "standalone": {},
    "standalone-window": {"recent_window": 8},
    "omnikv": {"mode": "omnikv"},
    "omnikv-reuse": {"mode": "omnikv", "select_reuse": True},
    "snapkv": {"mode": "snapkv"},
    "omnikv-fp16": None,
}


def backbone_setup(name: str):
    """A real backbone on the library's torch path with its default cache config and an untrained codec of
    its default size (what a step asks of the device does not depend on the weights)."""
    from residualkv.backbones import load_backbone
    from residualkv.cli import base_config, untrained_codec

    model, _, spec = load_backbone(name)
    cfg = base_config(spec).replace(kernel_impl="torch", select_budget=256, n_recent=32)
    return model, untrained_codec(model, spec, cfg), cfg


def count_decode(model, codec, cfg, method: str, context: int = 300, steps: int = 8, batch: int = 1,
                 seed: int = 0) -> HostSyncCounter:
    """Prefill `context` random tokens (not counted), then count `steps` greedy decode steps."""
    from residualkv.cache import OmniKVCache, ResidualKVCache

    changes = METHODS[method]
    if changes is None:
        cache = OmniKVCache.from_model(model, cfg.replace(mode="omnikv"))
    else:
        cache = ResidualKVCache.from_model(model, codec, cfg, **changes)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)
    counter = HostSyncCounter()
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        pos = torch.full((batch, 1), context)
        with counter:
            for t in range(steps):
                out = model(input_ids=nxt, cache=cache, use_cache=True, position_ids=pos + t)
                nxt = out.logits[:, -1:].argmax(-1)
    return counter


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--backbone", help="a real backbone (e.g. smollm2-135m, from the data dir) with its default "
                    "cache config, an untrained codec and an OmniKV budget of 256 + 32 recent, in place of the tiny model")
    ap.add_argument("--kernels", action="store_true", help="the Triton kernel path (kernel_impl triton; on a CPU "
                    "run it under TRITON_INTERPRET=1, slow: use the tiny model) in place of the torch path")
    ap.add_argument("--json", type=Path, help="write {method: {per_step, by_line}} here")
    a = ap.parse_args(argv)
    model, codec, cfg = backbone_setup(a.backbone) if a.backbone else tiny_setup(kernels=a.kernels)
    if a.kernels:
        cfg = cfg.replace(kernel_impl="triton")
    report = {}
    for method in a.methods.split(","):
        if method not in METHODS:
            ap.error(f"--methods: unknown {method!r}; choose from {', '.join(METHODS)}")
        c = count_decode(model, codec, cfg, method, a.context, a.steps, a.batch)
        report[method] = {"per_step": c.total / a.steps,
                          "by_line": {f"{what} @ {here}": n / a.steps for (what, here), n in c.where.most_common()}}
        print(f"{method}: {c.total / a.steps:.1f} host syncs per decode step")
        for line, n in report[method]["by_line"].items():
            print(f"    {n:5.1f}  {line}")
    if a.json:
        a.json.write_text(json.dumps({"model": a.backbone or "tiny random Llama (4 layers)", "path": cfg.kernel_impl,
                                      "context": a.context,
                                      "steps": a.steps, "batch": a.batch, "methods": report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
