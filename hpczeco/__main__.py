"""``python -m hpczeco``: runs the ``hpczeco`` command line, :mod:`hpczeco.drivers.cli`.

Python starts ``python -m PACKAGE`` from ``PACKAGE/__main__.py``, so this launcher has to sit inside
the package, while the command line itself is a driver (the top layer). It is a program entry point,
not a module of the library: nothing imports it, so the import below is no dependency of ``hpczeco``
on its drivers.

``main`` is the guarded entry (:func:`hpczeco.drivers.cli.main`): a rank that fails prints its error and
aborts the whole job (``MPI_Abort`` on ``MPI_COMM_WORLD``), so no rank is left waiting in a collective.
"""

import sys

from hpczeco.drivers.cli import main

sys.exit(main())
