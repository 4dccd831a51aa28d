"""plugserve on a Ray cluster: the Ray Serve application (``pip install 'plugserve[ray]'``).

    serve run plugserve.ray:app model_repository=DIR num_replicas=2
    python -m plugserve.ray model_repository=DIR > serve.yaml && serve deploy serve.yaml

Each replica holds a plugserve server's Core and the model repository; KServe v2 gRPC goes
through Serve's gRPC proxy to plugserve's own servicer, KServe v2 REST and the OpenAI routes
through Serve's HTTP proxy to plugserve's own REST application. ``app.py`` builds the
application from its arguments, ``replica.py`` is a replica, ``http.py`` and
``kserve_grpc.py`` hand Serve's requests to the server's code. The RAY device (running a
network on another node from any plugserve server) is ``plugserve.plugins.ray``.
docs/scale-out.md says when to use which.

The folder is ``rayserve/`` (mapped to ``plugserve.ray`` in pyproject's ``package-dir``), not
``ray/``: a folder named ``ray`` at the checkout's top would be imported as Ray itself by any
process started there (``serve run`` puts its working folder first on ``sys.path``).
"""

from plugserve.ray.app import GRPC_SERVICER, app, serve_config

__all__ = ["GRPC_SERVICER", "app", "serve_config"]
