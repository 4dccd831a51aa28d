"""Model control: what is loaded (the Core and its devices, the repository, config formats,
load/unload)."""
