"""Lightning callbacks, one module per concern: progress (throughput, MFU, the progress log), angles (the angle study
during training), stops (preemption signals, the non-finite guard). Checkpoints, and everything else that touches the
run directory, are normlab.training.rundir.directory's."""
