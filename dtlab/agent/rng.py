"""Every random-number generator a training step may draw from, captured and restored.

The generators: Python's ``random``, numpy's global ``np.random``, torch's CPU generator
and each initialised CUDA device's. A resumed run matches the run that never stopped only
if all of them come back, so the checkpoint stores each one and every step record carries
a fingerprint of each (taken before the step draws from it), which lets a resume check
name the generator that was not restored.

States are kept in a safe form (tensors, ints, floats, None) that ``torch.load(...,
weights_only=True)`` reads back without unpickling any object.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import torch

NAMES = ("python", "numpy", "torch", "cuda")


def _numpy():
    try:
        import numpy
    except ImportError:  # numpy is optional for torch: no numpy, no numpy RNG to keep
        return None
    return numpy


def _cuda_ready() -> bool:
    # only devices already in use: asking for their state would initialise CUDA otherwise
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture() -> dict[str, Any]:
    """``{name: state in safe form}`` of every generator present on this rank."""
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
    }
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        states["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    if _cuda_ready():
        states["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return states


def restore(states: dict[str, Any]) -> tuple[str, ...]:
    """Set every generator found in ``states``; returns the names it set."""
    done = []
    if "python" in states:
        s = states["python"]
        random.setstate((s["version"], tuple(s["state"].tolist()), s["gauss"]))
        done.append("python")
    if "torch" in states:
        torch.set_rng_state(states["torch"])
        done.append("torch")
    np = _numpy()
    if "numpy" in states and np is not None:
        s = states["numpy"]
        keys = s["keys"].numpy().astype("uint32")
        np.random.set_state((s["kind"], keys, s["pos"], s["has_gauss"], s["cached"]))
        done.append("numpy")
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(states["cuda"]))
        done.append("cuda")
    return tuple(done)


def fingerprints() -> tuple[tuple[str, int], ...]:
    """``((name, a 32-bit hash of its state), ...)``: cheap (~40 us, most of it numpy's
    get_state), so every step records it."""
    prints = [
        # ints hash alike in every process (unlike str); a third of crc32-of-an-array's cost
        ("python", hash(random.getstate()[1]) & 0xFFFFFFFF),
        ("torch", zlib.crc32(torch.get_rng_state().numpy().tobytes())),
    ]
    np = _numpy()
    if np is not None:
        _, keys, pos, _, _ = np.random.get_state()
        prints.append(("numpy", zlib.crc32(keys.tobytes()) ^ int(pos)))
    if _cuda_ready():
        states = b"".join(s.numpy().tobytes() for s in torch.cuda.get_rng_state_all())
        prints.append(("cuda", zlib.crc32(states)))
    return tuple(prints)
