"""What a checkpoint carries besides tensors, as tensors: JSON as uint8 tensors (never a pickle),
and this process's random states (torch, CUDA, Python's random, NumPy's), taken cheaply at every
optimizer step and encoded only when a checkpoint is written."""

from __future__ import annotations

import json
import random
from typing import Any

import torch


def json_tensor(obj: Any) -> torch.Tensor:
    """A JSON-able object as a uint8 tensor: what a checkpoint holds instead of a pickle."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def json_of(blob: torch.Tensor) -> Any:
    return json.loads(bytes(blob.tolist()).decode())


def rng_state() -> dict[str, Any]:
    """This process's random states as they are (torch, CUDA, Python's random, NumPy's): a few
    copies, cheap enough for every optimizer step; `rng_tensors` makes them a checkpoint's."""
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def rng_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`rng_state()` as uint8 tensors, what a checkpoint holds (tensors already, e.g. "loader", stay)."""
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    out = {k: v for k, v in state.items() if torch.is_tensor(v)}
    out["plain"] = json_tensor({"python": state["python"], "numpy": [kind, keys.tolist(), pos, has_gauss, gauss]})
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    plain = json_of(state["plain"])
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
