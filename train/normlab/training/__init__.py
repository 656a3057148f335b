"""A training run: train(cfg) and the builders every entry point shares (pipeline), the LightningModule (module), the
run directory and its checkpoints (run_dir), the callbacks, the strategies, loggers, runtime settings and the checks
of a config before anything is written."""
