"""Tensor memory a block of work takes: its peak above where it began, and what it leaves held.

CPU: torch keeps no allocator statistics there, so the block runs under torch's profiler with memory
profiling, which attributes every allocation and free to the aten op that made it (frees outside any op
arrive as `[memory]` events). Summed in time order they give the bytes live after each op; the peak is
their maximum. The resolution is one op: a temporary that an op allocates and frees inside itself nets
to zero and is not seen. Frees of tensors that existed before the block are left out (the profiler cannot
size them; a tensor allocated inside an earlier traced block is the exception, so garbage is collected
first), so `held_bytes` is what the block allocated and kept. Allocations made on intra-op
worker threads are not attributed; run with one thread (`torch.set_num_threads(1)`) for exact figures.
CUDA: the caching allocator's own counters (`max_memory_allocated`), which see every byte.

Used to check that the accounting (residualkv.accounting) names every byte a cache holds, and by the
benchmarks for peak memory of prefill and decode against the full cache.
"""

from __future__ import annotations

import gc
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class TensorMemory:
    peak_bytes: int = 0  # most bytes live at once, above the level at the start of the block
    held_bytes: int = 0  # bytes allocated inside the block and still live at its end


@contextmanager
def traced(device: str | torch.device = "cpu") -> Iterator[TensorMemory]:
    """`with traced() as mem: work()`; `mem` is filled in when the block ends."""
    device = torch.device(device)
    mem = TensorMemory()
    # garbage from before the block (caches live in reference cycles) must not be collected inside it:
    # the profiler remembers sizes from earlier profiled blocks, so such a free would count against this one
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield mem
        torch.cuda.synchronize(device)
        mem.peak_bytes = torch.cuda.max_memory_allocated(device) - start
        mem.held_bytes = torch.cuda.memory_allocated(device) - start
        return
    if device.type != "cpu":
        raise ValueError(f"traced(device={str(device)!r}): only 'cpu' and 'cuda' devices are measured")
    # torch 2.13's kineto writes two "USDT: ... profiler_start/stop" lines to stderr per profiled block (48
    # lines in the default profile's throughput step); its threshold has no level that drops those and keeps
    # its errors, so it is silenced unless the user set one. Read when kineto starts: the first profiled block.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # the profiler's own notices are not the caller's business
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield mem
    deltas = sorted((e.time_range.end, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, change in deltas:
        live += change
        peak = max(peak, live)
    mem.peak_bytes, mem.held_bytes = peak, live


@torch.no_grad()
def prefill(model, cache, input_ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """The prompt through `model` into `cache` (in calls of `chunk` tokens: the activations then scale
    with the chunk, and later chunks attend over the cache as stored); the greedy next token [B, 1]."""
    step = chunk or input_ids.shape[1]
    for s in range(0, input_ids.shape[1], step):
        logits = model(input_ids=input_ids[:, s : s + step], cache=cache, use_cache=True, logits_to_keep=1).logits
    return logits[:, -1:].argmax(-1)


@torch.no_grad()
def cache_memory(model, cache, input_ids: torch.Tensor, decode_steps: int = 2,
                 prefill_chunk: int | None = None) -> dict[str, float | int]:
    """Tensor memory of one prompt through `model` with `cache`, then greedy decode steps: the prefill's
    peak above where it began (the cache it builds, the activations, the compression's working tensors),
    the largest decode step's peak above the level before it (what a step needs beyond the cache), and
    what the cache holds at the end (`cache_held_bytes`; the accounting's `held_bytes` names it)."""
    device = input_ids.device
    with traced(device) as pre:
        token = prefill(model, cache, input_ids, prefill_chunk)
    held = pre.held_bytes - token.numel() * token.element_size()  # the cache's, not the next token's
    step_peak = 0
    for _ in range(decode_steps):
        with traced(device) as step:
            new = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        held += step.held_bytes - new.numel() * new.element_size()
        step_peak = max(step_peak, step.peak_bytes)
        token = new
    return {"prefill_peak_mib": pre.peak_bytes / 2**20, "decode_step_peak_mib": step_peak / 2**20,
            "cache_held_mib": held / 2**20, "cache_held_bytes": held}
