"""TEST DOUBLE of NVIDIA apex (see tests/doubles/README.md). Not apex: it runs on the CPU and casts nothing."""

IS_TEST_DOUBLE = True
