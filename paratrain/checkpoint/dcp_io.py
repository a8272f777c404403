"""DCP's file reader and writer as paratrain checkpoints use them: errors that name the file,
the files each rank wrote recorded for their checksums, and metadata unpickled with an
allow-list of DCP's own classes.

Imported only when a checkpoint is read or written (checkpoint/save_load.py, checkpoint/export.py): importing
torch.distributed.checkpoint takes over a second (it brings DTensor), which `import paratrain`,
and so every launcher and every rank, paid whether it checkpointed or not.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from paratrain.checkpoint.files import (
    ADVICE,
    DamagedCheckpoint,
    FileError,
    describe_failure,
    full_disk,
    listed_files,
    os_cause,
    own_file,
)
from paratrain.errors import ConfigError, ParatrainError, UsageError

# What a file's own state causes, read or written; anything else (a planner's assertion) is not its fault.
# RuntimeError: torch.load of a damaged zip record ("PytorchStreamReader failed reading zip archive").
_READ_ERRORS = (OSError, EOFError, pickle.UnpicklingError, RuntimeError)
_WRITE_ERRORS = (OSError,)


class NamedFS(FileSystem):
    """DCP's local file system, which names the file in any error raised while a file is open, and
    records the files this process wrote (so that it hashes its own, see [Note: the marker])."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[str] = set()

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        name, writing = Path(path).name, "w" in mode
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except (ParatrainError, FileError):
            raise
        # a tuple of exception classes chosen at run time (ruff's B030 cannot see it): DCP would
        # report the bare error only
        except (_WRITE_ERRORS if writing else _READ_ERRORS) as e:  # noqa: B030
            raise FileError(f"{os_cause(e)} writing {name}" if writing else f"{name} {_read_cause(e)}") from e
        except RuntimeError as e:  # torch.save's zip writer, short of space: "unexpected pos 704 vs 598"
            if writing and (full := full_disk(Path(path).parent)):
                raise FileError(f"{full} writing {name} ({type(e).__name__}: {str(e)[:120]})") from e
            raise
        if writing:
            self.written.add(name)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP writes `.metadata.tmp`, then renames it
        if Path(path).name in self.written:
            self.written.discard(Path(path).name)
            self.written.add(Path(new_path).name)


def _read_cause(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError):
        return "is missing"
    if isinstance(e, OSError):
        return f"cannot be read ({os_cause(e)})"
    return f"is truncated or corrupt ({type(e).__name__}{f': {str(e)[:200]}' if str(e) else ''})"


class Writer(dcp.FileSystemWriter):
    """DCP's writer, naming the file in its errors and recording the files this rank wrote."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fs = NamedFS()


class SafeReader(dcp.FileSystemReader):
    """DCP's reader, naming the file in its errors, with its metadata file unpickled with an
    allow-list of DCP's own classes."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fs = NamedFS()

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        listed = listed_files(Path(self.path)) or None  # None: saved before checksums, no list
        stored = {}  # each file once (a file holds many tensors), named by the first tensor in it
        for index, info in metadata.storage_data.items():
            stored.setdefault(info.relative_path, index.fqn)
        for name, fqn in stored.items():
            own_file(Path(self.path), name, listed, f"where {fqn!r} is stored")
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self._MODULES or (module, name) in self._NAMES or dtype:
            return super().find_class(module, name)
        raise UsageError(f"refusing to load {module}.{name} from checkpoint metadata: a checkpoint "
                         "holds only tensors and DCP's metadata")


def read_or_damaged(fn, path: Path):
    """`fn()`, a read of checkpoint `path`: what DCP or the unpickler raise on a damaged file becomes
    DamagedCheckpoint naming it."""
    try:
        return fn()
    except (ConfigError, UsageError):
        raise
    except (Exception, dcp.CheckpointException) as e:  # a damaged file, seen by DCP or the unpickler
        cause = describe_failure(e) if isinstance(e, dcp.CheckpointException) else str(e)
        raise DamagedCheckpoint(f"checkpoint {path} cannot be read: {cause}{ADVICE}") from e


def read_entries(entries: dict, reader: SafeReader, path: Path, **options: Any) -> None:
    """Fill `entries` in place from checkpoint `path` through `reader` (dcp.load with `options`);
    a damaged file raises DamagedCheckpoint naming it."""
    with quiet_dcp():
        read_or_damaged(lambda: dcp.load(entries, storage_reader=reader, **options), path)


@contextlib.contextmanager
def quiet_dcp():
    """Without two warnings of DCP's the user can do nothing about: torch's FutureWarning on every
    use of a ShardedTensor ("use DTensor instead"; checkpoint/layout.py describes the boxes a rank
    holds with them, which a DTensor cannot: a ZeRO shard's pieces sit at arbitrary offsets), and
    "torch.distributed is disabled", once per tensor read offline (no_dist=True: intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
