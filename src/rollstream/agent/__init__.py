"""Multi-turn, tool-using episodes (DESIGN.md, `agent/`): the agent loop (``loop``),
environments (``environment``), token-exact chat rendering (``chat``), tool calls (``tools``)
and sandboxes for untrusted code (``sandbox``)."""
