"""The Session, and what it composes: resuming, the optimizer step and its checks, the step
watch, automatic logging, the progress bar and checkpoint-on-preemption."""

from paratrain.session.session import Session

__all__ = ["Session"]
