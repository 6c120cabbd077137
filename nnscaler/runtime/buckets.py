"""When a bucket of gradients is complete in a backward: the one scheduler that gradient sync's
all-reduces (:mod:`.grad_sync`) and ZeRO's reduce-scatters (:mod:`.zero`) share.

A hook after each parameter's gradient accumulation counts down its bucket; the last gradient of a
bucket launches the bucket's collective, and the first gradient of a backward queues the finish (it
runs once, at the end of that backward: waits, and launches buckets some gradient never reached)."""
from __future__ import annotations

from typing import Callable, Iterable

import torch


class ReadyBuckets:
    """``launch(bucket)`` once every parameter of ``bucket.params`` has its gradient in a backward;
    ``finish()`` at the end of that backward. While :attr:`paused` the hooks do nothing (gradients
    accumulate unsynchronised, e.g. between micro-batches). :attr:`launched`: ids of the buckets
    launched since the last finish."""

    def __init__(self, launch: Callable[[object], None], finish: Callable[[], None]):
        self._launch, self._finish = launch, finish
        self.paused = False
        self.launched: set[int] = set()
        self._left: dict[int, int] = {}
        self._queued = False

    def attach(self, buckets: Iterable) -> None:
        for b in buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self._ready(b))

    def _ready(self, b) -> None:
        if self.paused:
            return
        self.begin()
        left = self._left[id(b)] = self._left.get(id(b), len(b.params)) - 1
        if left == 0:
            self.launched.add(id(b))
            self._launch(b)

    def begin(self) -> None:
        """Within a backward: have :meth:`end` run at its end (once)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end)

    def end(self) -> None:
        """Finish now (the end of a backward, or after paused ones): ``finish()``, then forget the counts."""
        try:
            self._finish()
        finally:
            self._queued = False
            self._left.clear()
            self.launched.clear()
