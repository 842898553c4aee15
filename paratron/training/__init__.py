"""The training loop, its command, evaluation, metrics, generation."""
