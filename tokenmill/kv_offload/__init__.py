"""KV tiers under the block pool: full prefix blocks evicted from the pool live on in host memory and on disk,
under their chained hash, and a later prompt with that prefix reads them back instead of prefilling them.

- `host_tier.py`: blocks in process memory, least recently used out first.
- `disk_tier.py`: blocks as files in a directory that outlives the process (checksummed, atomic writes).
- `store.py`: both tiers behind one index, with a worker thread for disk reads and writes (the step loop
  never waits on the disk).
- `identity.py`: what a block's KV depends on besides its tokens (model file, dtypes, block size): the disk
  tier's namespace, so no block of another model or configuration is ever read.

The scheduler's side (which requests wait for a tier load, and when a hit is worth loading) is
core/tier_loads.py.
"""
