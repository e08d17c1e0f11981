"""Long-running programs: training and prefill loops, benchmarks, HDF5 checkpointing."""
