"""Long-running programs and the `hpczeco` command line: training and prefill loops, benchmarks, HDF5
checkpointing."""
