"""Eviction inside transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers
serve --continuous-batching`): `hooks` installs it on a patched model's managers, `eviction` evicts each request of a
batch processor, `layout` reads and writes a request's slots in the paged cache."""
