"""CUDA kernels (CuPy RawKernels from the *.cu files here, Numba CUDA kernels). Knows nothing of MPI."""
