"""The fused boundary kernel: config (launch shape), loads and epilogue roles, the kernel, the call path."""
