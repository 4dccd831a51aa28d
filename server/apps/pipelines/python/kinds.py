"""The kinds of message between the server and a Python model's process, declared once.

Triton's python_backend names every message between its server and a model's stub in one enum
(``PYTHONSTUB_CommandType`` in ``src/ipc_message.h``: ``ExecuteRequest``, ``ExecuteResponse``,
``InferExecRequest``, ``LogRequest``, ...); here a message is a JSON header whose ``op`` is one
of :class:`Kind`, and a model's call to the server beside BLS names one of :class:`Call`. Both
sides use them by name: the server (``device.py`` and the modules it is made of), the process
(``worker.py``, Triton's stub) and the module models import (``triton_python_backend_utils``).

===================  =====================  ============================================
who sends it         kind                   what answers it, read by
===================  =====================  ============================================
server, main         AUTO_COMPLETE          COMPLETED (the config, or an error)
server, main         INITIALIZE             INITIALIZED (with the two arenas beside it)
server, a stream     EXECUTE                RESULT (responses, or an error)
server, main         FINALIZE               FINALIZED
server, any thread   CANCEL                 nothing: a notice (``is_cancelled()``)
server, main         CHECKS                 nothing: the readiness socket beside it
server, checks       IS_READY               a reply by its ``id`` on that socket
process, any thread  SEND                   nothing: a decoupled request's response
process, any thread  BLS                    replies by ``call`` id (one, or a stream)
process, any thread  BLS_CANCEL             nothing: the call's final reply comes
process, any thread  CALL                   one reply by ``call`` id
process, any thread  LOG                    nothing: a Logger line
===================  =====================  ============================================

No imports: the process imports this module before the model, and its start is measured.
"""

__all__ = ["LOG_LEVELS", "PROCESS_HANDLES", "SERVER_HANDLES", "Call", "Kind"]


class Kind:
    """A message's ``op``."""

    __slots__ = ()

    # the server to the process's main thread, each answered by the kind below it
    AUTO_COMPLETE = "auto_complete"
    COMPLETED = "completed"
    INITIALIZE = "initialize"
    INITIALIZED = "initialized"
    EXECUTE = "execute"
    RESULT = "result"
    FINALIZE = "finalize"
    FINALIZED = "finalized"
    # the server's notices, read by whichever thread of the process reads
    CANCEL = "cancel"
    CHECKS = "checks"
    # on the readiness socket
    IS_READY = "is_ready"
    # the process's messages the server handles as it reads them
    SEND = "send"
    BLS = "bls"
    BLS_CANCEL = "bls_cancel"
    CALL = "call"
    LOG = "log"


#: what the server handles at once on the thread that reads them (every other message answers
#: the thread that waits for it)
SERVER_HANDLES = frozenset({Kind.SEND, Kind.BLS, Kind.BLS_CANCEL, Kind.CALL, Kind.LOG})
#: the server's notices the process handles at once on the thread that reads them
PROCESS_HANDLES = frozenset({Kind.CANCEL, Kind.CHECKS})


class Call:
    """What a model asks the server besides BLS: a :attr:`Kind.CALL` message's ``what``
    (``calls.py`` answers each)."""

    __slots__ = ()

    METRIC_FAMILY = "metric_family"
    METRIC = "metric"
    METRIC_OP = "metric_op"
    LOAD_MODEL = "load_model"
    UNLOAD_MODEL = "unload_model"
    IS_MODEL_READY = "is_model_ready"


#: a :attr:`Kind.LOG` message's ``level``: Triton's Logger levels, by their number
LOG_LEVELS = ("INFO", "WARNING", "ERROR", "VERBOSE")
