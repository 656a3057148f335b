"""A training run: train(cfg) and the builders every entry point shares (pipeline), the LightningModule (module), the
run directory (run_dir, with its claim, checkpoint_files, run_tables, run_config and run_files; revalidate, which
regenerates the validation rows metrics.csv lost), the one loader of a trained model that every command reading a
checkpoint uses (loader), the callbacks, the strategies, loggers, runtime settings and the checks of a config before
anything is written."""
