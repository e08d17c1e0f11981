"""Everything that talks MPI. Scans any associative operator; knows nothing about attention."""

from .agree import CollectiveInputError, collective_check, local_error

__all__ = ["CollectiveInputError", "collective_check", "local_error"]
