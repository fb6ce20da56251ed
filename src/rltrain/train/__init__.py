"""Trainer roles (FSDP2 workers); plain Python, no Ray."""
