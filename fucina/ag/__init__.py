"""The autograd layer: the public Tensor and ExecContext (grad nodes arrive with the autograd issue)."""
