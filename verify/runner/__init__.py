"""Processes: the persistent gang of ranks, the loop each rank runs (:mod:`.worker`, which asks the kind
registry, :mod:`verify.kinds`), their isolation (memory caps, parent death), and torchrun."""
