"""Sizing a run for a machine: the resource plan of a config (plan: parameters, memory, FLOPs, time; normlab-describe)
and the GPU preflight (preflight: a few real steps, MFU and memory measured)."""
