"""The serving engine: scheduler, paged KV blocks, batched speculation, and its async front."""
