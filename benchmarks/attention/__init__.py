"""The parts of ``benchmarks/kernel_bench.py`` (modules, not commands): ``problems`` (the paged
layouts and the SDPA baseline) and ``report`` (the derived figures and the tables); here, the
attention shape measured: one layer of Llama-3.1-8B (32 query heads, 8 KV heads, head dim 128)."""

HQ, HKV, D = 32, 8, 128
