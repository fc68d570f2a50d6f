"""The input pipeline: grain over any random-access records, ordered, sharded, prefetched, checkpointable."""
