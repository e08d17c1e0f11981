"""Everything that talks MPI. Scans any associative operator; knows nothing about attention.

Layout (one concern per module): :mod:`.scan` (the public entry), :mod:`.ring`, :mod:`.tree`,
:mod:`.baselines` (one file per algorithm), :mod:`.handle` (a scan in flight and its progress),
:mod:`.kernels` (the operator's reference beside its kernel), :mod:`.names` (topology and transport
names and their checks), :mod:`.selection` (which transport, cached in :mod:`.context`),
:mod:`.transport` / :mod:`.device` (host and device transports), :mod:`.agree` (collective
validation), :mod:`.settings` (the ``HPCZECO_*`` variables), :mod:`.watchdog` (timeouts, aborting the job when a
rank stalls or fails), :mod:`.lifeline` (ranks that leave the job, guards, :func:`abort_on_error`), :mod:`.timed`
(collectives that honour the timeout), :mod:`.halo`, :mod:`.dispatch` (task dispatcher),
:mod:`.costmodel` / :mod:`.calibrate` (the scans' cost model and its measurement).

The names users call are imported here (:data:`__all__`); the library's own building blocks (the collective
validation of :mod:`.agree`, the checks of :mod:`.names`, the whole-state relay of :mod:`.ring`, ...) are imported
from their submodules.
"""

from .errors import CollectiveInputError
from .lifeline import abort_on_error
from .names import TOPOLOGIES, TRANSPORT_NAMES
from .scan import ScanHandle, scan, scan_start
from .selection import get_transport
from .transport import Transport

__all__ = [
    "scan",
    "scan_start",
    "ScanHandle",
    "TOPOLOGIES",
    "TRANSPORT_NAMES",
    "Transport",
    "get_transport",
    "CollectiveInputError",
    "abort_on_error",
]
