"""Device kernels for the hot spots, installed as ``areal_npu.kernels``.

Each kernel has a pure-PyTorch reference that is both the CPU path and the test oracle.
"""
