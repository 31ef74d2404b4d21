"""The test suite. Its folders mirror src/refusion/ (model, decoding, training, tasks, evaluation,
serve, cli); cross-cutting tests sit here at the top. Every folder is a package, so pytest puts the
repository root on sys.path and names each module by its path (tests.decoding.test_lookup): shared
code is imported as `from tests.helpers.serving import ...`, and two folders may hold files of the
same name."""
