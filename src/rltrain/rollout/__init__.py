"""Inference engines that produce rollouts."""
