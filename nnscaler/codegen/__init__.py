"""Code generation: one Python module per plan rank."""
