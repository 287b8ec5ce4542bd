"""Every byte a cache holds is named by the accounting: the allocator's count equals the report's
`held_bytes` (stored + spare + working + bookkeeping) for every method, after a prefill and decode steps."""

import os
import subprocess
import sys

import pytest
import torch

from residualkv import accounting
from residualkv.config import ResidualKVConfig
from residualkv.memory import cache_memory, traced
from residualkv.methods import build_cache

from .test_training import tiny_codec, tiny_model

PROMPT, STEPS = 96, 3
BASE = ResidualKVConfig(full_attention_layers=(0,), n_sink=2, stride=4)
SELECT = dict(select_budget=16, n_recent=8)  # below the prompt, so the sparse reads engage
LOWRAM = dict(fit_steps=3, sr_budget=16, sr_outliers=2, sr_window=8)
SR_PROMPT = 200  # LowRAM-SR's landmarks and exact chunks fit its bytes (and selection engages) from here

CASES = {
    "full": {}, "kivi4": {}, "kivi2": {}, "residualkv-dagger": {}, "snapkv": {}, "omnikv": SELECT,
    "residualkv": SELECT, "residualkv-reuse": SELECT, "residualkv-standalone": {}, "residualkv-int2": {},
    "residualkv-snapkv": dict(select_budget=16), "lowram": LOWRAM, "lowram-q": LOWRAM,
    "lowram-sr": dict(LOWRAM, ratio=2.0), "lowram-sr-reuse": dict(LOWRAM, ratio=2.0), "lowram-e": LOWRAM,
}
READS_PART = {"snapkv", "omnikv", "residualkv", "residualkv-reuse", "residualkv-snapkv", "lowram-sr", "lowram-sr-reuse",
              "lowram-e"}  # each path's selection or eviction engaged (CR < 1), so its memory is in the count


# allocations on intra-op worker threads are not attributed (residualkv.memory)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_and_codec():
    model = tiny_model()
    return model, tiny_codec(model)


def _run(model, cache, ids) -> None:
    with torch.no_grad():
        token = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(STEPS):
            token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("name", list(CASES))
def test_accounting_names_every_byte_the_cache_holds(model_and_codec, name):
    model, codec = model_and_codec
    n = SR_PROMPT if name.startswith("lowram-sr") else PROMPT
    ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(0))
    _run(model, build_cache(name, model, codec, BASE, **CASES[name]), ids)  # one-time set-up shared by caches
    with traced() as mem:  # from its construction: a cache holds nothing the accounting does not name
        cache = build_cache(name, model, codec, BASE, **CASES[name])
        _run(model, cache, ids)
    rep = accounting.report(cache)
    assert mem.held_bytes == rep["held_bytes"], (name, mem.held_bytes - rep["held_bytes"])
    assert rep["total_bytes"] < rep["fp16_bytes"] or name in ("full", "omnikv")
    assert mem.peak_bytes >= mem.held_bytes
    assert (rep.get("cr", 1.0) < 1) == (name in READS_PART)
    assert (rep.get("working_vs_fp16", 0) > 0) == name.endswith("-reuse")


@pytest.mark.parametrize("name", ["residualkv", "residualkv-snapkv", "lowram-e"])
def test_every_byte_named_with_a_left_padded_batch(model_and_codec, name):
    model, codec = model_and_codec
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def run(cache):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
            token, m, p = out.logits[:, -1:].argmax(-1), mask, pos[:, -1:]
            for _ in range(STEPS):
                m, p = torch.cat([m, torch.ones_like(m[:, :1])], 1), p + 1
                token = model(input_ids=token, attention_mask=m, position_ids=p, cache=cache,
                              use_cache=True).logits[:, -1:].argmax(-1)

    run(build_cache(name, model, codec, BASE, **CASES[name]))
    with traced() as mem:
        cache = build_cache(name, model, codec, BASE, **CASES[name])
        run(cache)
    rep = accounting.report(cache)
    assert rep["bookkeeping_bytes"] >= 2 * 8  # two row groups' row indices at least
    assert mem.held_bytes == rep["held_bytes"], (name, mem.held_bytes - rep["held_bytes"])


def test_cache_memory_of_prefill_and_steps(model_and_codec):
    """What the benchmarks and the pipeline report: the cache held after the steps is the accounting's
    held_bytes; the full cache holds float32 K/V here (twice the FP16 bytes KR is measured against)."""
    model, codec = model_and_codec
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    out, reps = {}, {}
    for name in ("full", "residualkv"):
        cache_memory(model, build_cache(name, model, codec, BASE, **CASES[name]), ids)
        cache = build_cache(name, model, codec, BASE, **CASES[name])
        out[name], reps[name] = cache_memory(model, cache, ids, decode_steps=2), accounting.report(cache)
        assert out[name]["cache_held_bytes"] == reps[name]["held_bytes"]
        assert out[name]["prefill_peak_mib"] > out[name]["decode_step_peak_mib"] > 0
    assert out["full"]["cache_held_bytes"] == 2 * reps["full"]["fp16_bytes"]
    assert out["residualkv"]["cache_held_bytes"] < out["full"]["cache_held_bytes"] / 2
    # a prefill in chunks holds the same kind of cache (the same tokens, attended as stored) at a lower peak
    cache = build_cache("residualkv", model, codec, BASE, **CASES["residualkv"])
    chunked = cache_memory(model, cache, ids, decode_steps=2, prefill_chunk=PROMPT // 4)
    assert chunked["cache_held_bytes"] == accounting.report(cache)["held_bytes"]
    assert cache.get_seq_length() == PROMPT + 2
    assert chunked["prefill_peak_mib"] < out["residualkv"]["prefill_peak_mib"]


def test_traced_counts_peak_and_held():
    with traced() as mem:
        kept = torch.ones(1000, dtype=torch.float32)  # 4000 bytes, kept
        tmp = torch.ones(5000, dtype=torch.float64)  # 40000 bytes, freed before the end
        del tmp
    assert mem.held_bytes == 4000
    assert mem.peak_bytes == 44000
    assert kept.sum() == 1000
    with pytest.raises(ValueError, match="only 'cpu' and 'cuda'"):
        with traced("meta"):
            pass


def test_traced_keeps_stderr_quiet():
    """kineto's per-block USDT lines (torch 2.13) would bury a pipeline step's log: traced() silences them,
    unless the user asked for kineto's logging."""
    code = ("import torch\nfrom residualkv.memory import traced\n"
            "for _ in range(3):\n    with traced():\n        torch.ones(8) + 1\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "profiler_start" not in quiet.stderr, quiet.stderr
    loud = subprocess.run([sys.executable, "-c", code], env={**env, "KINETO_LOG_LEVEL": "0"}, capture_output=True,
                          text=True, check=True)
    assert loud.stderr.count("profiler_start") == 3, loud.stderr  # the user's setting wins
