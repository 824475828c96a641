"""Where experts live and how they move: host store, device pools, handle tables, budget, cache, execution paths."""
