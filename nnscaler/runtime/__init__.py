"""Runtime: differentiable collectives, rank meshes, and the per-rank program of a partitioned op."""
