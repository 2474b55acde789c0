"""Other projects speaking to jitk: FlashInfer-Bench (jitk.fib)."""
