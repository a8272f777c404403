"""What a checkpoint carries besides tensors, as tensors: JSON as uint8 tensors (never a pickle),
and this process's random states (torch, CUDA, Python's random, NumPy's), taken cheaply at every
optimizer step and encoded only when a checkpoint is written."""

from __future__ import annotations

import _random
import ctypes
import json
import random
import struct
import sys
from typing import Any, Callable

import torch


def json_tensor(obj: Any) -> torch.Tensor:
    """A JSON-able object as a uint8 tensor: what a checkpoint holds instead of a pickle."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def json_of(blob: torch.Tensor) -> Any:
    return json.loads(bytes(blob.tolist()).decode())


def rng_state() -> dict[str, Any]:
    """This process's random states as they are (torch, CUDA, Python's random, NumPy's): a few
    copies, cheap enough for every optimizer step; `rng_tensors` makes them a checkpoint's."""
    state = {"torch": torch.get_rng_state(), "python": _PYTHON.state(), "numpy": _NUMPY.state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class WatchedState:
    """A Mersenne Twister's state as `read()` gives it, read again only when the generator's
    words in memory (624 keys and a position, 2,500 bytes), or `extra()`, differ from those of the
    last read. A session with accumulate > 1 takes the states at every optimizer step
    (resume.position): np.random.get_state() takes 33 us, and random.getstate() 9, or 27 in a
    training loop after backward and the optimizer have run; comparing the words takes about 1.

    The words are found once (`address()`) and checked against `words_of(read())`; where they do
    not match (another layout or build), every call reads whole. `reusable(state)`: whether
    unchanged words and extra imply an unchanged state."""

    SIZE = 624 * 4 + 4

    def __init__(self, read: Callable[[], Any], address: Callable[[], int], words_of: Callable[[Any], bytes],
                 extra: Callable[[], Any] = lambda: None, reusable: Callable[[Any], bool] = lambda state: True):
        self.read, self.address, self.words_of, self.extra, self.reusable = read, address, words_of, extra, reusable
        self.memory: Any = None  # a ctypes view of the words; False: not readable, read whole
        self.last: tuple[bytes, Any, Any] | None = None  # (words, extra, state) of the last read

    def state(self) -> Any:
        if self.memory is None:
            self.memory = self._find()
        if self.memory is False:
            return self.read()
        words, extra = self.memory.raw, self.extra()
        last = self.last
        if last is not None and last[0] == words and last[1] == extra and self.reusable(last[2]):
            return last[2]
        state = self.read()
        self.last = (words, extra, state)
        return state

    def forget(self) -> None:
        """The state was set from outside (set_rng_state): read it whole next time."""
        self.last = None

    def _find(self) -> Any:
        try:
            memory = (ctypes.c_char * self.SIZE).from_address(self.address())
            return memory if memory.raw == self.words_of(self.read()) else False
        except (AttributeError, ImportError, TypeError, ValueError, OverflowError, struct.error):
            return False


def _numpy_get() -> tuple:
    import numpy as np

    return np.random.get_state()


def _numpy_address() -> int:
    import numpy as np

    return np.random.mtrand._rand._bit_generator.ctypes.state_address  # MT19937: uint32 key[624]; int pos


def _numpy_words(state: tuple) -> bytes:
    kind, keys, pos, _, _ = state
    return keys.astype("=u4").tobytes() + struct.pack("=i", pos) if kind == "MT19937" else b""


def _python_address() -> int:
    """Where CPython's random object keeps `int index; uint32_t state[624]` (after its 16-byte
    object header); refused where reading there could leave the object (another build)."""
    if sys.implementation.name != "cpython" or _random.Random.__basicsize__ < 16 + WatchedState.SIZE:
        raise ValueError("not CPython's layout")
    return id(random._inst) + 16


def _python_words(state: tuple) -> bytes:
    _, words, _ = state  # (version, 624 keys and the index, gauss_next)
    return struct.pack("=i624I", words[-1], *words[:-1])


# NumPy's legacy state also holds a cached gaussian (has_gauss): using it moves no word, so a
# state that held one is read whole. Missed: a user's np.random.set_state to a state with the
# current words and a cached gaussian the current one lacks (our set_rng_state forgets).
_NUMPY = WatchedState(_numpy_get, _numpy_address, _numpy_words, reusable=lambda state: not state[3])
_PYTHON = WatchedState(random.getstate, _python_address, _python_words, extra=lambda: random._inst.gauss_next)


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
    _PYTHON.forget()
