"""The warm start, bottom to top: demonstrations (``demos``), behaviour cloning (``sft``),
playing and held-out evaluation (``heldout``), DAgger rounds (``dagger``), and the cache RL
starts from (``cache``)."""
