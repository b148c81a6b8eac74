"""The PyTorch reference engine and its parts: model files, the model, attention kernels, the
static decode step, CPU GEMM tuning, sampling, devices and the scheduler settings an executor
runs. The bottom floor of ``orthrus_real``: it imports nothing else of the package."""
