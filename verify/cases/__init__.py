"""What one case runs on a rank (an operator under a partition, a layout conversion, a whole model
under a policy, micro-batched, resumed, as replicas or a pipeline, a torch parallelization) and its
samples; the kinds that answer a rank's jobs with them are :mod:`verify.kinds`."""
