"""Model ops, one per module. Each has a NumPy implementation (the CPU path and the oracle that
GPU tests compare against) and a dispatch point that sends CuPy arrays to `kvshare.ops.gpu`
(imported lazily, only on the GPU path). Each op's docstring is the exact contract (shapes,
dtypes, in-place behaviour) that its GPU twin must follow."""
