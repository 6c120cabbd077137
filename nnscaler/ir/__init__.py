"""The compiler IR: tensors and annotated operators."""
