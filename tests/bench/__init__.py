"""The benchmarks' and ``make mutate``'s own tests."""
