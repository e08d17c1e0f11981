"""`hpczeco train`: a GLA language model in PyTorch trained with ZeCO sequence parallelism x data parallelism.

Modules, in the order a step uses them: :mod:`.options` (the command line, checked collectively),
:mod:`.parallel` (SP x DP layout from the MPI world, gradient all-reduce), :mod:`hpczeco.drivers.data` (the
byte-level stream), :mod:`.config` and :mod:`.model` (named shapes, fla's GLA architecture), :mod:`.memory`
(the estimate checked before any work), :mod:`.checkpoint` (HDF5 state, asynchronous saves), :mod:`.metrics`
(tokens/s, MFU, step split, loss curve), :mod:`.faults` (test hooks, SIGUSR1), and :mod:`.loop`, the loop itself.
``docs/benchmarks/train.md`` says how to run the GPU benchmark.
"""

from .loop import TrainResult, main, run
from .options import build_parser

__all__ = ["run", "main", "TrainResult", "build_parser"]
