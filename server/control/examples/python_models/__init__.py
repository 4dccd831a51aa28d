"""The ``model.py`` files of the bundled example pipelines (``server/control/examples/pipelines.py``
copies each into its model's version folder): Triton Python models, run by the server's
PYTHON device in a process of their own, where ``triton_python_backend_utils`` is importable.
They are not imported as part of plugserve."""
