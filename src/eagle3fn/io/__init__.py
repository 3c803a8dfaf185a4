"""Side effects live here: target models, chat data, feature caches, checkpoints."""
