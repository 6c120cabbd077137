"""Processes: the persistent gang of ranks, their isolation (memory caps, parent death), and torchrun."""
