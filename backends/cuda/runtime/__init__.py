"""The runtime stage: launching generated kernels, measuring candidates, choosing per node, CUDA graphs."""
