"""Tracing: a model and sample inputs -> a torch.export graph -> operators annotated from the registry."""
