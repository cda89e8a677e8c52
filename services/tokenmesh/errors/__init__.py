"""One error taxonomy for the whole mesh, by job.

Every error a service raises on purpose is a :class:`MeshError` (``_taxonomy``): each class knows its gRPC status
code and the HTTP status the gateway uses. ``_status`` turns them into a ``google.rpc.Status`` with its details
and back (also a status a multiplexed stream ended with); :class:`ErrorInterceptor` (``_interceptor``) maps them to
statuses for every call shape. Errors a worker reports about a generation travel as a typed ``GenerationError``;
the class is decided once, from the error itself, by :func:`classify_backend_message` (``_classes``).
"""

from tokenmesh.errors._classes import (
    CALLER_ERROR_CLASSES,
    ERROR_CLASS_TO_EXCEPTION,
    classify_backend_message,
    from_generation_error,
)
from tokenmesh.errors._interceptor import Authorize, ErrorInterceptor, Gate
from tokenmesh.errors._status import code_of, from_rpc_error, from_status, rpc_error, status_code
from tokenmesh.errors._taxonomy import (
    DOMAIN,
    ERRORS,
    MAX_DESCRIPTION,
    MAX_MESSAGE,
    RETRY_AFTER,
    Aborted,
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FieldViolation,
    Internal,
    InvalidArgument,
    MeshError,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    label,
)

__all__ = [
    "CALLER_ERROR_CLASSES",
    "DOMAIN",
    "ERRORS",
    "ERROR_CLASS_TO_EXCEPTION",
    "MAX_DESCRIPTION",
    "MAX_MESSAGE",
    "RETRY_AFTER",
    "Aborted",
    "AlreadyExists",
    "Authorize",
    "Cancelled",
    "DeadlineExceeded",
    "ErrorInterceptor",
    "FieldViolation",
    "Gate",
    "Internal",
    "InvalidArgument",
    "MeshError",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "classify_backend_message",
    "code_of",
    "from_generation_error",
    "from_rpc_error",
    "from_status",
    "label",
    "rpc_error",
    "status_code",
]
