"""What a checkpoint carries besides tensors, as tensors: JSON as uint8 tensors (never a pickle),
and this process's random states (torch, CUDA, Python's random, NumPy's), taken cheaply at every
optimizer step and encoded only when a checkpoint is written."""

from __future__ import annotations

import ctypes
import json
import random
import sys
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
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _NUMPY.state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class NumpyState:
    """NumPy's global random state, `np.random.get_state()`, for about 1 us where that call takes
    about 33 (a session with accumulate > 1 takes it at every optimizer step: resume.position).
    Its generator's words (MT19937: 624 keys and a position, 2,500 bytes) are read straight from
    memory and compared with those of the last state read whole; the same words give the same
    state unless a cached gaussian may have changed without them: where the last state held one
    (a gaussian draw that uses the cache moves no word), or after `set_state`. Our own restore
    (set_rng_state) forgets the last state; a user's `np.random.set_state` to a state with the
    current words and a cached gaussian that the current state lacks is the one change missed.
    Where the words cannot be read as MT19937's (another NumPy layout), every call reads whole."""

    WORDS = 624 * 4 + 4

    def __init__(self) -> None:
        self.last: tuple[bytes, tuple] | None = None
        self.address: int | None = None  # where the words are; 0: not readable, read whole

    def state(self) -> tuple:
        import numpy as np

        if self.address is None:
            self.address = self._find(np)
        if not self.address:
            return np.random.get_state()
        words = ctypes.string_at(self.address, self.WORDS)
        if self.last is not None and self.last[0] == words and not self.last[1][3]:  # [3]: has_gauss
            return self.last[1]
        state = np.random.get_state()
        self.last = (words, state)
        return state

    def forget(self) -> None:
        self.last = None

    def _find(self, np: Any) -> int:
        """The address of the global generator's words, once checked against get_state(); else 0."""
        try:
            address = np.random.mtrand._rand._bit_generator.ctypes.state_address
            words = ctypes.string_at(address, self.WORDS)
        except (AttributeError, TypeError, ValueError):
            return 0
        kind, keys, pos, _, _ = np.random.get_state()
        same = (kind == "MT19937" and np.frombuffer(words[:-4], dtype=np.uint32).tolist() == keys.tolist()
                and int.from_bytes(words[-4:], sys.byteorder, signed=True) == pos)
        return address if same else 0


_NUMPY = NumpyState()


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
    _NUMPY.forget()
