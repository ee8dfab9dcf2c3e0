"""millpond.protos — filled in by later milestones."""
