"""A user's own torch parallelization verified on the ranks: its case, how the model is built and meshed, and its localiser."""
