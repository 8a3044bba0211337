"""Simulation: the real fault-tolerance protocol under a seeded scheduler (``ftlm.sim.protocol``)."""
