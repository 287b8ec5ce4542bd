"""Which CPU is this, and does bf16 pay on it? Times one of SmolLM2-135M's MLP products for a
1024-token block (1024x576 by 576x1536) in fp32 and bf16 and prints GFLOP/s side by side.

The 2-core machines this project runs on are not all alike: on an Intel CPU with AMX, bf16 ran 6.9x
fp32; on an AMD EPYC without AVX512-BF16 torch emulates it, ~100x slower. `rkv train --bf16` warns
on the second kind (cpu_has_native_bf16); this script gives the figures behind that.

    python benchmarks/cpu_matmul.py [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from residualkv.training.trainer import cpu_has_native_bf16


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gflops(dtype: torch.dtype, m: int, k: int, n: int, seconds: float) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b  # first call: allocation and dispatch, not timed
    calls, t0 = 0, time.perf_counter()
    while True:
        a @ b
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return 2 * m * k * n * calls / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=2.0, help="time spent per dtype")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = (1024, 576, 1536)
    res = {"cpu": cpu_model(), "threads": args.threads, "native_bf16": cpu_has_native_bf16(),
           "torch": torch.__version__, "shape": list(shape)}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        res[f"{name}_gflops"] = gflops(dt, *shape, args.seconds)
    res["bf16_vs_fp32"] = res["bf16_gflops"] / res["fp32_gflops"]
    print(f"{res['cpu']} ({args.threads} threads, native bf16: {res['native_bf16']}): "
          f"fp32 {res['fp32_gflops']:.0f} GFLOP/s, bf16 {res['bf16_gflops']:.1f} GFLOP/s, "
          f"bf16/fp32 {res['bf16_vs_fp32']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
