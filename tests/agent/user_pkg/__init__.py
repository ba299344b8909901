"""What a user brings, named by import path (``tests.agent.user_pkg.envs:GuessNumber``): an
environment, an OpenAI-SDK agent and tools, written against the public interfaces only."""
