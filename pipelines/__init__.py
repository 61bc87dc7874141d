"""Ray composition of adbatch library calls: tasks, actors, Ray Data plans. Thin by design."""
