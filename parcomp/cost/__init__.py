"""The cost model and the machine: memory per rank, link times, checkpoint load, rank placement."""
