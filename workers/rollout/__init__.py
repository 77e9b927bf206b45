"""Rollout workers: epochs of a problem set through vLLM, trajectories handed to the bus."""
