"""Benchmarks run by ``adaflash bench <name>``: each module has ``main(argv=None)``."""
