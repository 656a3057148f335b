"""The angle probe: where the norm sites of a model are, the hooks that read their inputs and outputs, and the
streaming statistics of the angle to the uniform vector, with the table they are written to. Training's callback,
the angles command, the ablation and the report all measure through it."""
