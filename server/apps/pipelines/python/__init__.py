"""Triton's python backend: a ``model.py`` with ``TritonPythonModel`` served in worker
processes of its own (:mod:`.device`: the server's side, the ``PYTHON`` device, made of one
module a job, which its docstring lists; ``worker.py``: the process's side; ``ipc.py``: the
transport both speak, and ``kinds.py`` its kinds of message; and
``triton_python_backend_utils.py``, the module models import). The four worker-side modules
need only the standard library and numpy, so a model may run under a Python of its own."""
