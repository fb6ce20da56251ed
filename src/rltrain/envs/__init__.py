"""Environments for multi-turn, tool-using rollouts."""
