"""Checkpoint writes that fail as on a full disk, for tests of what the user is told."""

from __future__ import annotations

import contextlib
import errno
import os

from torch.distributed.checkpoint.filesystem import FileSystem


class FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.stream, name)


def failing_create_stream(stream_class: type = FullDisk):
    """DCP's FileSystem.create_stream with every stream opened for writing wrapped in `stream_class`."""
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield stream_class(stream) if "w" in mode else stream

    return create_stream
