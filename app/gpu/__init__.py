"""What every CUDA user in the project shares: garbage collection paused around graph capture, and the
attention kernels PyTorch may choose."""
