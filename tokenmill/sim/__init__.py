"""`tokenmill sim`: the real scheduler on a simulated clock, with a roofline cost model for each step."""
