"""Protocol errors and the codes of ``error`` replies, each a named constant.

Both sides compare codes by these names, never by bare strings; docs/PROTOCOL.md lists them
for people.
"""

from __future__ import annotations

MALFORMED = "malformed"            # frames or header do not follow the format
VERSION = "version"                # another protocol version
UNKNOWN_KIND = "unknown_kind"      # a kind the master does not serve
BAD_FIELD = "bad_field"            # a body field missing or of the wrong type
DTYPE = "dtype"                    # an array of the wrong dtype
SHAPE = "shape"                    # an array of the wrong shape, or missing / extra arrays
NOT_FINITE = "not_finite"          # NaN or Inf in an update
UNKNOWN_WORKER = "unknown_worker"  # not registered, or not in the cluster's worker list
STALE_ROUND = "stale_round"        # an update for a round that is not open
NOT_SELECTED = "not_selected"      # an update from a worker not sampled for this round
NOT_READY = "not_ready"            # asked for the model before there is one
REJECTED = "rejected"              # refused by the model family (its own reason follows)
IDENTITY = "identity"              # the worker_id is not the one the sender's key belongs to
TOO_LARGE = "too_large"            # a message, header or list over its limit
BUSY = "busy"                      # the sender exceeded its request rate (fair service)
EXCLUDED = "excluded"              # the worker was excluded from this job (the reason follows)
OUTLIER = "outlier"                # an update far outside the round's (not aggregated)
REPLACED = "replaced"              # another process registered under this worker's name since

#: Every code an ``error`` reply may carry.
ERROR_CODES = (MALFORMED, VERSION, UNKNOWN_KIND, BAD_FIELD, DTYPE, SHAPE, NOT_FINITE,
               UNKNOWN_WORKER, STALE_ROUND, NOT_SELECTED, NOT_READY, REJECTED, IDENTITY,
               TOO_LARGE, BUSY, EXCLUDED, OUTLIER, REPLACED)


class ProtocolError(ValueError):
    """A message that does not follow the protocol.

    Parameters
    ----------
    message : str
        One line saying what is wrong.
    code : str, default MALFORMED
        Machine-readable reason, one of :data:`ERROR_CODES`, sent back in error replies.
    """

    def __init__(self, message: str, code: str = MALFORMED) -> None:
        super().__init__(message)
        self.code = code
