"""The progress of a training loop: a bar on rank 0 with the loss and global samples per second,
and the epoch bookkeeping of `Session.progress` (paratrain/session/session.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch.utils._pytree import tree_flatten
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from paratrain.session.session import Session


def progress(session: "Session", loader: Iterable, desc: str | None = None) -> Iterator[Any]:
    """Iterate `loader` once with a bar on rank 0 (see `Session.progress`)."""
    # the training loader reads session.epoch at each pass and a complete pass ends it
    # (data/loader.py); its epoch is chosen here already, so that the bar's total is that epoch's
    if session.loader is not None and loader is session.loader:
        loader.set_epoch(session.epoch)
    replicas = session.model.replicas if session.model is not None else 1
    try:
        total = len(loader)  # type: ignore[arg-type]
    except TypeError:  # a stream, or a loader of the user's own without a length
        total = None
    bar = tqdm(total=total, desc=desc or f"epoch {session.epoch}", leave=False, mininterval=0.5,
               disable=not (session.is_main and session.progress_bar), dynamic_ncols=True)
    samples, start = 0, time.perf_counter()
    try:
        for batch in loader:
            yield batch
            samples += batch_len(batch) * replicas
            session.samples_per_second = samples / (time.perf_counter() - start)
            # the loss is read (a wait for the device) only when the bar is due to redraw
            if session.last_loss is not None and not bar.disable and _redraw_due(bar):
                bar.set_postfix(loss=f"{session.last_loss.item():.4f}",
                                samples_s=f"{session.samples_per_second:.0f}", refresh=False)
            bar.update()
    finally:  # also when the loop breaks early
        bar.close()


def _redraw_due(bar: tqdm) -> bool:
    """Whether the next bar.update() will print, by tqdm's rule: miniters updates and mininterval
    seconds since the last print."""
    return bar.n + 1 - bar.last_print_n >= bar.miniters and time.time() - bar.last_print_t >= bar.mininterval


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor that has one."""
    tensors = [t for t in tree_flatten(batch)[0] if torch.is_tensor(t) and t.dim() > 0]
    return tensors[0].shape[0] if tensors else 1
