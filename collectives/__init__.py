"""Everything that talks MPI. Scans any associative operator; knows nothing about attention.

Layout (one concern per module): :mod:`.scan` (the public entry), :mod:`.ring`, :mod:`.tree`,
:mod:`.baselines` (one file per algorithm), :mod:`.handle` (a scan in flight and its progress),
:mod:`.kernels` (the operator's reference beside its kernel), :mod:`.names` (topology and transport
names and their checks), :mod:`.selection` (which transport, cached in :mod:`.context`),
:mod:`.transport` / :mod:`.device` (host and device transports), :mod:`.agree` (collective
validation), :mod:`.watchdog` (timeouts, aborting the job when a rank stalls or fails:
:func:`abort_on_error`), :mod:`.timed` (collectives that honour the timeout), :mod:`.halo`,
:mod:`.dispatch` (task dispatcher),
:mod:`.costmodel` / :mod:`.calibrate` (the scans' cost model and its measurement).
"""

from .agree import CollectiveInputError, agree_fast, collective_check, local_error
from .names import TOPOLOGIES, TRANSPORT_NAMES, check_blocks, check_topology, check_transport_name
from .ring import relay_recv, relay_send
from .scan import ScanHandle, scan, scan_start
from .watchdog import abort_on_error

__all__ = [
    "CollectiveInputError",
    "collective_check",
    "local_error",
    "agree_fast",
    "TOPOLOGIES",
    "TRANSPORT_NAMES",
    "check_topology",
    "check_blocks",
    "check_transport_name",
    "ScanHandle",
    "scan",
    "scan_start",
    "relay_recv",
    "relay_send",
    "abort_on_error",
]
