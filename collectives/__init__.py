"""Everything that talks MPI. Scans any associative operator; knows nothing about attention."""

from .agree import CollectiveInputError, collective_check, local_error
from .scan import TOPOLOGIES, ScanHandle, relay_recv, relay_send, scan, scan_start

__all__ = [
    "CollectiveInputError",
    "collective_check",
    "local_error",
    "TOPOLOGIES",
    "ScanHandle",
    "scan",
    "scan_start",
    "relay_recv",
    "relay_send",
]
