"""What every layer shares, and which imports nothing of normlab above it: the error types and their exit codes
(errors), the project's places (paths), what identifies a run (run_identity) and how its directory is named
(run_names), what moved since a run or a command line was written (moved), composing the configs (compose), atomic
writes (atomic), the rule by which a command writes its outputs (outputs), and a command's cost measured from
outside while it runs (measure)."""
