"""The Ray runtime (``runtime.kind: ray``): the cluster a run uses and engines as actors."""
