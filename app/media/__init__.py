"""Media preparation: fetch the bytes (fetch), decode images and videos (decode), resize and
patchify (preprocess), and the per-request pipeline with its cache key (pipeline)."""
