"""Test and benchmark infrastructure that is part of the package (so benchmarks, the CLI and
downstream projects can use it too): `cluster` emulates several hosts on one machine."""
