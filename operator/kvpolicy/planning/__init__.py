"""The planner and what it knows: GPU facts from node labels, the attention backends, the pure `plan`."""
