"""Real KV tensors (issue 13): a paged KV cache in torch, a tiny transformer
that reads and writes it through the scheduler's block tables, an external
KV store in host memory with a batched sync/async loader that can be told to
fail, and per-block checksums that say which block holds the wrong KV.

Modules (each needs torch; importing this package does not):

- ``kvspec.gpu.paged_cache``: ``PagedKVCache``, the pool of blocks of every group;
- ``kvspec.gpu.model``: ``TinyConfig``, ``TinyTransformer`` (paged and reference forwards);
- ``kvspec.gpu.store``: ``KVStore``, blocks by hash in (pinned) host memory;
- ``kvspec.gpu.loader``: ``KVLoader``, ``LoadFault``, ``LoadReport``;
- ``kvspec.gpu.checksum``: checksums against the reference, bit-exact fingerprints.

docs/notes/kv-tensors.md says how the scheduler side is meant to use them.
"""
