"""Errors a user can cause. Each message says what went wrong and what to do."""


class ParatrainError(Exception):
    """Base class of every error paratrain raises on purpose."""


class ConfigError(ParatrainError, ValueError):
    """The arguments or the environment do not describe a job that can run."""


class CommError(ParatrainError, RuntimeError):
    """A collective failed or timed out, or ranks disagree about what to do."""


class CheckpointError(ParatrainError, RuntimeError):
    """A checkpoint could not be written; the ones written before are intact."""


class UsageError(ParatrainError, RuntimeError):
    """The library was called in an order or a way it cannot honour."""
