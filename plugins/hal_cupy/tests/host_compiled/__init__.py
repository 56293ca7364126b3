"""Host-compiled kernels: hal's CUDA/HIP kernel sources built for the CPU with g++ (see ``harness``)."""
