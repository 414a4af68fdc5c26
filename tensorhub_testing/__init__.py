"""Test and benchmark support, outside the product package: an emulated multi-host cluster
(`cluster`), a TensorHub fleet on it (`fleet`), a Ray cluster on it (`ray_cluster`), ranks
as threads (`ranks`) and the tests' one wait (`waits`). Imported from the repository root
(pytest, `python -m bench`, `python -m tensorhub_testing.cluster`); not shipped in the wheel."""
