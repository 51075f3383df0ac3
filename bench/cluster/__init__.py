"""Ray Serve replicas: adapter-affinity (multiplexed) routing vs plain load balancing."""
