"""Applications on the data plane: generation, Python models, ensembles and DAGs."""
