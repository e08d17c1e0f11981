"""The bottom layer every other layer may import: the array backend (numpy | CuPy), per-rank
argument checks, and host-side bfloat16 conversion. Nothing here talks MPI or knows attention."""
