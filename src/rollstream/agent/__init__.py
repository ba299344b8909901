"""Multi-turn, tool-using episodes (DESIGN.md, `agent/`): tool calls (``tools``) and sandboxes
for untrusted code (``sandbox``). The agent loop, environments, chat-template rendering and the
OpenAI-compatible proxy build on these."""
