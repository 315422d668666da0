"""Short probe of the CPU kernels' two paths against a dense matmul, to set ``OP_MAX_M``.

    python -m optkit.kernels.bench --shape 3072x576 --m 1,4,8,16,32,64,512 --dtype bfloat16

Prints the median milliseconds (after warm-up) of: the weight-only op forced for every M, the
rebuild + dense matmul forced for every M, what the kernel's own threshold picks, and a dense
``F.linear`` on a float weight of the same shape (the baseline in the same run; the machine is
shared, so read ratios rather than absolute numbers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from optkit.kernels.registry import build_linear
from optkit.quantize.rtn import quantize_weight_rtn
from optkit.quantize.scheme import QuantScheme


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="3072x576", help="out x in of the weight")
    ap.add_argument("--m", default="1,4,8,16,32,64,512", help="comma-separated batch rows")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out_f, in_f = (int(v) for v in args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    ms = [int(v) for v in args.m.split(",")]
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f)
    dense_w = w.to(dtype)
    schemes = {"int4-g64": QuantScheme(4, 64), "int8-ch": QuantScheme(8), "w8a8": QuantScheme(8, act_bits=8)}
    kernels = {label: build_linear(quantize_weight_rtn(w, s, torch.bfloat16), None, None, "cpu", dtype) for label, s in schemes.items()}
    print(f"# shape {out_f}x{in_f} {args.dtype}, {torch.get_num_threads()} threads, median ms of {args.reps}")
    print(f"{'M':>5} {'dense':>8} " + " ".join(f"{lbl + ':' + p:>16}" for lbl, k in kernels.items() for p in _paths(k)))
    for m in ms:
        x = torch.randn(m, in_f, dtype=dtype)
        row = [median_ms(lambda x=x: F.linear(x, dense_w), args.reps)]
        for k in kernels.values():
            for path in _paths(k):
                saved = getattr(k, "op_max_m", None)
                if path != "auto":
                    k.op_max_m = sys.maxsize if path == "op" else -1
                row.append(median_ms(lambda k=k, x=x: k(x), args.reps))
                if saved is not None:
                    k.op_max_m = saved
        print(f"{m:>5} " + " ".join(f"{v:>8.3f}" if i == 0 else f"{v:>16.3f}" for i, v in enumerate(row)))
    for label, k in kernels.items():
        print(f"# {label}: kernel {k.name}, weight_bytes {k.weight_bytes()}, op_max_m {getattr(k, 'op_max_m', '-')}")


def _paths(k) -> list[str]:
    return ["op", "rebuild", "auto"] if hasattr(k, "op_max_m") else ["auto"]


if __name__ == "__main__":
    main()
