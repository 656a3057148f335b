"""What every layer shares, and which imports nothing of normlab: the error types and their exit codes (errors),
the project's places and run names (paths), and the rule by which a command writes its outputs (outputs)."""
