"""The training product: config, state (checkpoints), and the explicit loop."""
