"""The data: sources and token shards (numpy only, shared with torch_ref), the record order, the data half of a
run's identity, and the input pipeline: grain over any random-access records, ordered, sharded, prefetched,
checkpointable."""
