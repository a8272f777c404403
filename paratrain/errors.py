"""Errors a user can cause. Each message says what went wrong and what to do."""


class ParatrainError(Exception):
    """Base class of every error paratrain raises on purpose."""

    # True on an error that another rank's fault can raise here too (a NaN gradient averaged in
    # from a rank whose loss was NaN): `paratrain run`'s summary then leads with a rank whose error
    # has a cause of its own (launch/worker.py notes it, debug/postmortem.py reads it)
    may_echo_another_rank = False

    def echoing(self) -> "ParatrainError":
        """This error, marked as one that another rank's fault may have caused."""
        self.may_echo_another_rank = True
        return self


class ConfigError(ParatrainError, ValueError):
    """The arguments or the environment do not describe a job that can run."""


class CommError(ParatrainError, RuntimeError):
    """A collective failed or timed out, or ranks disagree about what to do."""


class CheckpointError(ParatrainError, RuntimeError):
    """A checkpoint could not be written; the ones written before are intact."""


class UsageError(ParatrainError, RuntimeError):
    """The library was called in an order or a way it cannot honour."""
