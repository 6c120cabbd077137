"""Mutation suite: small monkeypatches of the compiler and runtime (the package ``catalog/``, one
module per family), each applied in every rank through a ``--module`` file, and a runner
(``python -m tests.mutants.run``) that runs a reduced ``python -m verify all`` against each and
prints the kill rate."""
