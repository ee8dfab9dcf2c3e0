"""millpond.deploy — filled in by later milestones."""
