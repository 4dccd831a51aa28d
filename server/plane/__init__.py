"""The data plane: the request path every protocol shares (admission, budget, deadlines, sequences,
shared memory, response streams, metrics)."""
