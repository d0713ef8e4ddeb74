"""What a rank's per-step recording costs per parameter byte, against the read floor.

    python benchmarks/record_cost.py                        # CPU, one thread
    python benchmarks/record_cost.py --device cuda          # where a GPU is lent

For each model shape (many small tensors like the demo's, a mid-size model, a few big
tensors), in one run: the floor (one read of every byte: ``sum`` of one contiguous buffer
as large as all the tensors together), the per-parameter norms dtlab takes
(``_foreach_norm``), its fingerprints (``recorder.fingerprints``: XXH3-64 on the host, a
weighted sum read back once on an accelerator), and the weighted sum on the host for
comparison (the host's fingerprint before XXH3). Medians of --repeats; ratio = time /
floor.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtlab.agent import recorder

SHAPES = {  # name: (tensor count, elements per tensor)
    "demo-like: 44 x 6k": (44, 6_163),
    "mid: 200 x 256k": (200, 262_144),
    "big: 8 x 16M": (8, 16_777_216),
}


def _median_s(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(device: torch.device, repeats: int) -> list[dict]:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows = []
    for name, (count, numel) in SHAPES.items():
        tensors = [torch.randn(numel, device=device) for _ in range(count)]
        flat = torch.randn(count * numel, device=device)
        nbytes = flat.numel() * flat.element_size()
        floor = _median_s(lambda f=flat: f.sum().item(), repeats, sync)
        timed = {
            "norms": lambda t=tensors: torch.stack(torch._foreach_norm(t)).tolist(),
            "fingerprints": lambda t=tensors: recorder.fingerprints(t),
        }
        if device.type == "cpu":
            timed["weighted sum on the host"] = lambda t=tensors: recorder.device_prints(t)
        for what, fn in timed.items():
            seconds = _median_s(fn, repeats, sync)
            rows.append(
                {
                    "shape": name,
                    "what": what,
                    "ms": seconds * 1e3,
                    "ns_per_byte": seconds / nbytes * 1e9,
                    "floor_ms": floor * 1e3,
                    "ratio": seconds / floor,
                    "floor_gb_s": nbytes / floor / 1e9,
                }
            )
        del tensors, flat
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = measure(device, args.repeats)
    print(f"device {device}, {torch.get_num_threads()} thread(s); medians of {args.repeats}")
    print("| tensors | what | ms | ns / byte | floor ms (GB/s) | / floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['what']} | {r['ms']:.3f} | {r['ns_per_byte']:.3f} "
            f"| {r['floor_ms']:.3f} ({r['floor_gb_s']:.1f}) | {r['ratio']:.2f}x |"
        )


if __name__ == "__main__":
    main()
