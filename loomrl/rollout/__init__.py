"""The rollout pool: rollout workers (positions -> scored groups) and their Ray actor."""
