"""`das demo`: built-in RL-style rollouts with each drafting strategy, and the report a person reads."""
