"""`make bench`: the boundary benchmarks, with their baselines measured in the same run."""
