#!/usr/bin/env python3
"""The Python peer of `xfer-bench --suite weights`: the same checkpoint file, the same machine.

    python3 benches/weights_torch.py target/xfer-bench/weights.safetensors [--reps 5]
        [--report target/xfer-bench/report.json]

Times, from the page cache (the file is read once first), each a median of --reps runs:

- `safetensors.torch.load_file(path, device="cuda:0")`;
- `load_file(path)` then `.to("cuda:0")` per tensor;
- the best Python recipe: `safe_open`, `get_tensor`, `pin_memory()`, `.to(non_blocking=True)`;
- `safetensors.torch.save_file` of the loaded tensors (to a file beside the input, removed).

Every load is checked against the file (each tensor equal to the CPU load's, on the GPU);
the saved file is checked to hold the same tensors. Prints GB/s per case and, with
--report, adds them to xfer-bench's report.json as "python_peer", so the record has both.
Needs PyTorch with CUDA and safetensors (both are on the GPU machine).
"""

import argparse
import json
import os
import statistics
import sys
import time


def same_bytes(a, b):
    """Whether two tensors hold the same bytes: random bf16 bytes hold NaNs, which
    `torch.equal` finds unequal to themselves."""
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def timed(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), max(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--report", help="xfer-bench's report.json, to add the figures to")
    args = ap.parse_args()

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if not torch.cuda.is_available():
        sys.exit("weights_torch.py: no CUDA device. Fix: run it on the GPU machine.")
    dev = "cuda:0"
    size = os.path.getsize(args.path)
    with open(args.path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    reference = load_file(args.path)  # on the CPU: the bytes to check against
    data_bytes = sum(t.numel() * t.element_size() for t in reference.values())

    def check(loaded):
        assert loaded.keys() == reference.keys(), "tensor names differ"
        for name, t in loaded.items():
            if not same_bytes(t, reference[name].to(dev)):
                sys.exit(f"weights_torch.py: tensor {name} differs from the file")

    def load_direct():
        out = load_file(args.path, device=dev)
        torch.cuda.synchronize()
        return out

    def load_then_to():
        out = {k: v.to(dev) for k, v in load_file(args.path).items()}
        torch.cuda.synchronize()
        return out

    def pinned_recipe():
        out = {}
        with safe_open(args.path, framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k).pin_memory().to(dev, non_blocking=True)
        torch.cuda.synchronize()
        return out

    cases = {}
    for name, fn in [
        ('load_file(path, device="cuda:0")', load_direct),
        ('load_file(path) then .to("cuda")', load_then_to),
        ("safe_open + pin_memory + .to(non_blocking=True)", pinned_recipe),
    ]:
        check(fn())
        med, lo, hi = timed(fn, args.reps)
        cases[name] = {"seconds": med, "min": lo, "max": hi, "gbps": data_bytes / med / 1e9}

    on_gpu = load_direct()
    out = args.path + ".torch-out.safetensors"

    def save():
        save_file(on_gpu, out)

    med, lo, hi = timed(save, args.reps)
    back = load_file(out)
    for name, t in back.items():
        if not same_bytes(t, reference[name]):
            sys.exit(f"weights_torch.py: saved tensor {name} differs")
    os.remove(out)
    cases["save_file(tensors on cuda:0)"] = {"seconds": med, "min": lo, "max": hi, "gbps": data_bytes / med / 1e9}

    import safetensors

    record = {
        "file": os.path.abspath(args.path),
        "file_bytes": size,
        "data_bytes": data_bytes,
        "tensors": len(reference),
        "reps": args.reps,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "device": torch.cuda.get_device_name(0),
        "cases": cases,
    }
    for name, c in cases.items():
        print(f"{name:50} {c['gbps']:8.2f} GB/s  ({c['seconds']:.3f} s median of {args.reps})")
    if args.report:
        with open(args.report) as f:
            report = json.load(f)
        report["python_peer"] = record
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)
        print(f"added to {args.report} as python_peer")
    else:
        print(json.dumps(record))


if __name__ == "__main__":
    main()
