"""The target's forward passes for decoding: attention layout, KV caches, the lean CPU forward and its kernels."""
