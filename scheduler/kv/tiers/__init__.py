"""The KV tiers behind the device pool: host memory and block files on disk (kv_tiers.py)."""
