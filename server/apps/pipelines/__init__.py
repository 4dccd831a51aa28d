"""Applications, not single graphs: Python models (Triton's python backend contract), and what
composes models. Each room is a package of its own beside the data plane, and uses it as any
client would (see docs/python_models.md)."""
