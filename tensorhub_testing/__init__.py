"""Test and benchmark support, outside the product package: an emulated multi-host cluster
(`cluster`), a TensorHub fleet on it (`fleet`) or on this host's loopback (`local_fleet`),
a Ray cluster on the emulated one (`ray_cluster`), the chaos run (`chaos`), ranks as
threads (`ranks`) and the tests' one wait (`waits`). Imported from the repository root
(pytest, `python -m bench`, `python -m tensorhub_testing.cluster`); not shipped in the wheel."""
