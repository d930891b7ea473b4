"""The agent in its environments: prompts and actions, generation engines, environments, and
episodes played in groups."""
