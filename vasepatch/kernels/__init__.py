"""Attention kernels over the cache's slots: pure tensor code, no cache, no model.

- `grouped`: masked attention grouped by KV head (`sdpa` and `eager`), the causal prompt path, the eager
  math path with soft-capping and attention sinks;
- `varlen`: packing helpers for the variable-length kernels;
- `backends`: the varlen backends (`flash_attn`, `torch_varlen`) and which can run where.

The transformers integration (`vasepatch.integration.attention`) chooses among them for each step.
"""
