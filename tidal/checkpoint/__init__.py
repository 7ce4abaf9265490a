"""Durable checkpoints: for losing the whole job, and for resuming at another world size."""
