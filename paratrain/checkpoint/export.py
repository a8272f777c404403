"""One `.safetensors` file written a tensor at a time, never the whole model in memory.

`session.export(path)` writes the trained model from rank 0, which gathers it a piece at a time
(a ZeRO-3 unit, a pipeline stage) and writes each before the next is gathered.

`paratrain ckpt export DIR OUT.safetensors [--dtype bf16]` turns a checkpoint into the file an
inference stack loads, offline: no process group and no model code. It reads one parameter at a
time from the checkpoint (torch.distributed.checkpoint gathers a sharded one from the files of
the ranks that wrote it), so its memory peaks at about the largest tensor, not the model.

The output holds the plain model's state-dict keys: every parameter under its own name, a tied
parameter also under each of its other names (a copy each, as `model.state_dict()` lists them,
so `model.load_state_dict(safetensors.torch.load_file(OUT))` is strict-clean), and the buffers
the model saves (not the non-persistent ones). The checkpoint records those names when saved
(checkpoint/save_load.py, `_state_dict_names`); a checkpoint from before that exports its parameters and
every buffer it holds.

The file is the safetensors format (an 8-byte little-endian header length, a JSON header of
dtype, shape and byte offsets per tensor, then the raw bytes). The header comes first but is
known only at the end, so the bytes are spooled to a side file as they arrive and copied behind
the header once: disk, not memory, pays for streaming.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
from torch import nn

from paratrain.checkpoint.files import agree, rank
from paratrain.checkpoint.save_load import describe
from paratrain.errors import ConfigError
from paratrain.parallel.base import names_by_first, state_pieces

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}
DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class SafetensorsWriter:
    """Add tensors one at a time; `close()` writes `path` (atomically: `path.partial`, renamed)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._spool = self.path.with_name(self.path.name + ".data")
        if self.path.is_dir():
            raise ConfigError(f"cannot export to {self.path}: it is a directory; pass a file path, such as "
                              f"{self.path / 'model.safetensors'}")
        if not self.path.parent.is_dir():
            raise ConfigError(f"cannot export to {self.path}: its folder {self.path.parent} does not exist")
        try:
            self._data = open(self._spool, "wb")
        except OSError as e:
            raise ConfigError(f"cannot export to {self.path}: {e}") from e
        self._header: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"safetensors has no dtype for {tensor.dtype} ({name})")
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        self._data.write(memoryview(raw))
        end = self._offset + raw.nbytes
        self._header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self._offset, end]}
        self._offset = end

    @property
    def tensors(self) -> int:
        return len(self._header)

    @property
    def nbytes(self) -> int:
        return self._offset

    def close(self) -> Path:
        """Write the file; a failure (a full disk) leaves neither side file behind."""
        self._data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        try:
            with open(self._partial, "wb") as out, open(self._spool, "rb") as data:
                out.write(struct.pack("<Q", len(header)))
                out.write(header)
                shutil.copyfileobj(data, out, 16 << 20)
            os.replace(self._partial, self.path)
        except OSError as e:
            self.discard()
            raise ConfigError(f"writing {self.path} failed: {e}; nothing was left behind") from e
        self._spool.unlink()
        return self.path

    def discard(self) -> None:
        self._data.close()
        for side in (self._spool, self._partial):
            side.unlink(missing_ok=True)

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.discard()


def export_model(path: str | os.PathLike, model: nn.Module) -> Path | None:
    """Write the whole model as `path` (.safetensors) from rank 0, gathering a piece at a time
    (a ZeRO-3 unit, a pipeline stage: parallel/base.py `state_pieces`), so no rank ever holds the
    whole model. A collective; a write that fails on rank 0 raises on every rank, after the
    gathering is done (the others would wait in the next gather otherwise). Returns the path on
    rank 0, None elsewhere."""
    writer, failed = None, None
    try:
        writer = SafetensorsWriter(path) if rank() == 0 else None
    except ConfigError as e:
        failed = e
    for piece in state_pieces(model):
        if writer is not None and failed is None:
            try:
                for name, value in piece.items():
                    writer.add(name, value)
            except (OSError, TypeError) as e:
                failed = e
        del piece

    def finish() -> Path:
        if failed is not None:
            if writer is not None:
                writer.discard()
            if isinstance(failed, ConfigError):
                raise failed
            raise ConfigError(f"exporting to {path} failed: {failed}") from failed
        return writer.close()

    out = agree(finish)
    return out if rank() == 0 else None


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype | None = None) -> dict:
    """Write checkpoint `path`'s model as `out` (.safetensors), a tensor at a time; floating
    tensors cast to `dtype` if given. Checks the checksums first (DamagedCheckpoint). Returns
    {"tensors", "bytes", "largest"}: what was written, and the largest tensor read."""
    meta, stored = describe(path)
    kinds = {key: (dtype_, shape) for key, dtype_, shape in stored}
    every_name = names_by_first(meta.get("aliases", {}))
    buffers = meta.get("buffers")
    if buffers is None:
        buffers = [key.split("/", 1)[1] for key in kinds if key.startswith("buffers/")]
    from paratrain.checkpoint.dcp_io import SafeReader, read_entries  # DCP on use: checkpoint/dcp_io.py

    reader = SafeReader(Path(path))
    largest = 0
    with SafetensorsWriter(out) as writer:
        for name, names in [*((n, every_name.get(n, [n])) for n in meta["shapes"]), *((b, [b]) for b in buffers)]:
            key = f"model/{name}" if name in meta["shapes"] else f"buffers/{name}"
            stored_dtype, shape = kinds[key]
            size = shape  # a parameter: flattened in format 1, a 0-d one as one element
            if key.startswith("model/") and (meta["format"] == 1 or not shape):
                size = (torch.Size(shape).numel(),)
            flat = torch.empty(size, dtype=stored_dtype)
            read_entries({key: flat}, reader, Path(path), no_dist=True)
            value = flat.view(shape)
            largest = max(largest, value.nbytes)
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            for n in names:
                writer.add(n, value)
            del flat, value
    return {"tensors": writer.tensors, "bytes": writer.nbytes, "largest": largest}
