"""The plugserve.v1 plugin-API service."""
