"""Compute kernels shared by the model code (the paged-attention kernel lives in pdserve.kernels.attention)."""
