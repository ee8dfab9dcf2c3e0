"""millpond.actors — filled in by later milestones."""
