"""The run directory, its whole lifecycle in one folder: what makes a folder a run directory and what it holds (files:
the recognition rule, the directory's writes and their errors), who may use it (claim), whether its saved config is
the run's (config), its checkpoints (checkpoints), metrics.csv and angles.csv (tables), the validations they lost
(revalidate), and the owner of it all while a run trains (directory.RunDirectory). Only `directory` imports
Lightning: the commands that only read a run directory import the others alone."""
