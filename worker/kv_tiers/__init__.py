"""The worker's side of the KV tiers: host slots, block files and their writer (docs/kv-tiers.md)."""
