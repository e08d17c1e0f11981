"""``python -m hpczeco.torch --bench``: the GPU benchmark of the torch glue (:mod:`hpczeco.torch.bench`)."""

from .bench import main

raise SystemExit(main())
