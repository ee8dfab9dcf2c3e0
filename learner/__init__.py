"""millpond.learner — filled in by later milestones."""
